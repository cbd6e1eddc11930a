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

/// Maps a new lend's pages into this process on a thread of its own (`MADV_POPULATE_WRITE`):
/// the store allocated them at LEND, but each page's first write here would still fault (and
/// clear it) inside a put. A lend handed out again is warm already. Best effort: an older
/// kernel without the advice just leaves the faults to the puts.
fn populate_in_background(segment: &Arc<MappedSegment>, lend: &Lend) {
    const PAGE: u64 = 4096;
    let Ok(base) = segment.writable_base() else {
        return;
    };
    let start = lend.offset / PAGE * PAGE;
    let end = (lend.offset + lend.size).div_ceil(PAGE) * PAGE;
    let end = end.min(segment.len());
    let (addr, len) = (base as usize + start as usize, (end - start) as usize);
    let keep = segment.clone();
    let _ = std::thread::Builder::new()
        .name("vovp-lend-populate".into())
        .spawn(move || {
            // SAFETY: whole pages of this client's own read-write mapping, kept mapped by
            // `keep`; populating writes nothing (it maps and clears the pages the store
            // allocated, as a first write would).
            let _ = unsafe {
                rustix::mm::madvise(
                    addr as *mut std::ffi::c_void,
                    len,
                    rustix::mm::Advice::LinuxPopulateWrite,
                )
            };
            drop(keep);
        });
}

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
            // Until the store said how big a lend's objects may be, ask for any lend (the
            // reply says): asking for `need` would be refused, and asked again, for every put
            // too big for a lend.
            _ => match take(if slot.max_object.is_some() { need } else { 0 }) {
                Ok((lend, segment, generation)) => {
                    slot.max_object = Some(lend.max_object);
                    let again = slot.current.as_ref().is_some_and(|c| c.lend.id == lend.id);
                    if !again {
                        populate_in_background(&segment, &lend);
                    }
                    slot.current = Some(Current {
                        generation,
                        cursor: lend.offset,
                        lend,
                        segment,
                        writing: 0,
                    });
                }
                // The store may have retired the current lend before failing (a full store):
                // nothing more may be written into it, it may be freed.
                Err(e) => {
                    slot.current = None;
                    // MALFORMED (a store that lends nothing, or a daemon without LEND): for good.
                    if matches!(e, vovp::Error::Protocol(_) | vovp::Error::Config(_)) {
                        slot.refused = true;
                    } else {
                        tracing::debug!("vovp: no lend ({e}); creating instead");
                    }
                    return None;
                }
            },
        }
        let c = slot.current.as_mut()?;
        if need > c.lend.max_object || !fits(c) {
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
    /// `gone`: the store answered that it knows no such lend; it is forgotten here too.
    pub(crate) fn done(&self, lend: u64, gone: bool) {
        if let Ok(mut slot) = self.slot.lock() {
            if let Some(c) = slot.current.as_mut().filter(|c| c.lend.id == lend) {
                c.writing = c.writing.saturating_sub(1);
                if gone && c.writing == 0 {
                    slot.current = None;
                }
            }
        }
    }
}
