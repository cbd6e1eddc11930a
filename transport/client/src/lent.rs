//! Puts through a lend (LEND / PUBLISH): the client writes the object into a part of its own
//! arena the store lent it, then one PUBLISH creates and seals it, so a put costs one round
//! trip whatever its size and the bytes never cross the socket. The client hands out ranges
//! of its current lend in order (a bump allocator); the store checks each published range.
//!
//! A lend is replaced (LEND again, which retires the old one) only while no put is writing
//! into it: the store frees a retired lend once its objects are gone, and a put still writing
//! into it would then write memory the store may have handed out again.

use std::sync::{Arc, Mutex};

use vovp::Lend;

use crate::mapping::MappedSegment;

/// Puts smaller than this go inline (PUT: the bytes ride in the frame, the daemon copies them
/// into its own segment): the socket copy is cheap there, and small objects packed into lends
/// would pin whole lends (a lend's memory comes back only with its last object).
pub const CLIENT_LEND_MIN: usize = 64 * 1024;

/// The bytes an object takes in a lend: data padded to 64 bytes, then the metadata, rounded
/// to 64 (the store checks the same arithmetic).
pub(crate) fn block_len(size: usize, metadata_len: usize) -> Option<u64> {
    vovp::lends::block_len(size as u64, metadata_len as u64)
}

/// This client's current lend.
struct Current {
    /// The connection generation it was lent on (a reconnect forgets it).
    generation: u64,
    lend: Lend,
    segment: Arc<MappedSegment>,
    /// Next free offset (absolute in the segment).
    cursor: u64,
    /// Puts writing into it now.
    writing: u32,
}

/// The lend state of one client.
#[derive(Default)]
pub(crate) struct LendSlot {
    current: Option<Current>,
    /// The largest block the store lends for (learnt from its first lend).
    max_object: Option<u64>,
    /// The store lends nothing (embedded, `--prefault`, a small store, an old daemon).
    refused: bool,
}

/// A range of the current lend reserved for one put; give it back with [`Lends::done`].
pub(crate) struct Reserved {
    pub lend: u64,
    pub offset: u64,
    pub generation: u64,
    /// Where to write the data.
    pub ptr: *mut u8,
    /// Keeps the mapping alive while writing.
    pub _segment: Arc<MappedSegment>,
}

/// What a reservation needs from the driver: a new lend, mapped writable.
pub(crate) type TakeLend<'a> =
    dyn FnMut(u64) -> Result<(Lend, Arc<MappedSegment>, u64), vovp::Error> + 'a;

#[derive(Default)]
pub(crate) struct Lends {
    slot: Mutex<LendSlot>,
}

impl Lends {
    /// Whether a put of `size` data bytes and `metadata_len` metadata bytes should go through a
    /// lend: big enough to be worth it, small enough for one, and a store that lends.
    pub(crate) fn wants(&self, size: usize, metadata_len: usize) -> Option<u64> {
        if size < CLIENT_LEND_MIN {
            return None;
        }
        let need = block_len(size, metadata_len)?;
        let slot = self.slot.lock().ok()?;
        if slot.refused || slot.max_object.is_some_and(|m| need > m) {
            return None;
        }
        Some(need)
    }

    /// Reserves `need` bytes for a put on connection `generation`, taking a new lend through
    /// `take` when the current one is full and nobody writes into it. `None`: no lend now
    /// (the caller creates instead); the store refusing to lend at all is remembered.
    pub(crate) fn reserve(
        &self,
        need: u64,
        generation: u64,
        take: &mut TakeLend<'_>,
    ) -> Option<Reserved> {
        let mut slot = self.slot.lock().ok()?;
        if slot
            .current
            .as_ref()
            .is_some_and(|c| c.generation != generation)
        {
            slot.current = None;
        }
        let fits = |c: &Current| c.cursor + need <= c.lend.offset + c.lend.size;
        match &slot.current {
            Some(c) if fits(c) => {}
            Some(c) if c.writing > 0 => return None,
            _ => match take(need) {
                Ok((lend, segment, generation)) => {
                    slot.max_object = Some(lend.max_object);
                    slot.current = Some(Current {
                        generation,
                        cursor: lend.offset,
                        lend,
                        segment,
                        writing: 0,
                    });
                }
                // MALFORMED (a store that lends nothing, or a daemon without LEND): for good.
                Err(vovp::Error::Protocol(_) | vovp::Error::Config(_)) => {
                    slot.refused = true;
                    return None;
                }
                Err(e) => {
                    tracing::debug!("vovp: no lend ({e}); creating instead");
                    return None;
                }
            },
        }
        let c = slot.current.as_mut()?;
        if !fits(c) {
            return None;
        }
        let offset = c.cursor;
        c.cursor += need;
        c.writing += 1;
        let base = c.segment.writable_base().ok()?;
        Some(Reserved {
            lend: c.lend.id,
            offset,
            generation: c.generation,
            // SAFETY: inside the lend, which lies inside the mapped segment (checked when the
            // lend was taken).
            ptr: unsafe { base.add(offset as usize) },
            _segment: c.segment.clone(),
        })
    }

    /// The put that reserved a range of lend `lend` has written it (and published it or not).
    pub(crate) fn done(&self, lend: u64) {
        if let Ok(mut slot) = self.slot.lock() {
            if let Some(c) = slot.current.as_mut().filter(|c| c.lend.id == lend) {
                c.writing = c.writing.saturating_sub(1);
            }
        }
    }
}
