//! Puts through a lend (LEND / PUBLISH): the client writes the object into a part of its own
//! arena the store lent it, then one PUBLISH creates and seals it, so a put costs one round
//! trip whatever its size and the bytes never cross the socket. The client hands out ranges
//! of its current lend in order (a bump allocator); the store checks each published range.
//!
//! A lend is replaced (LEND again, which retires the old one) only while no put is writing
//! into it: the store frees a retired lend once its objects are gone, and a put still writing
//! into it would then write memory the store may have handed out again. For the same reason
//! each put announces itself in the connection's hold table before writing and withdraws only
//! after PUBLISH's reply (`vovp_shm::lend`; a kept put that did not wait for it withdraws when
//! the reply is read, `OwedObject::writing`): the store, short of memory, takes back a lend only
//! while no put writes into it, and a put that finds its lend taken back asks for a new one.
//!
//! On by default ([`crate::ClientOptions::no_lend_puts`] opts out); a connection without a
//! hold table (`no_shared_reads`, a daemon with `--no-shared-reads`) gets no lend.

use std::sync::{Arc, Mutex};

use vovp_proto::Request;
use vovp_shm::copy::parallel_copy;
use vovp_shm::{LendWrite, SharedReader};
use vovp_types::{Error, Lend, PutOptions};

use crate::core::{requests, Answered};
use crate::mapping::MappedSegment;

/// The bytes an object takes in a lend: data padded to 64 bytes, then the metadata, rounded
/// to 64 (the store checks the same arithmetic).
pub(crate) fn block_len(size: usize, metadata_len: usize) -> Option<u64> {
    vovp_types::lends::block_len(size as u64, metadata_len as u64)
}

/// This client's current lend.
struct Current {
    /// The connection generation it was lent on (a reconnect forgets it).
    generation: u64,
    lend: Lend,
    segment: Arc<MappedSegment>,
    /// The connection's hold table, where puts announce themselves (see the module doc).
    shared: Arc<SharedReader>,
    /// Next free offset (absolute in the segment).
    cursor: u64,
    /// Puts writing into it now.
    writing: u32,
    /// The store took it back: no new put writes into it.
    revoked: bool,
}

impl Current {
    /// The next `need` bytes, for one put; announced in the hold table (so the store cannot
    /// take the lend back under it) unless the store already took it back.
    fn take(&mut self, need: u64, slot: &Arc<Mutex<LendSlot>>) -> Result<Reserved, NoRange> {
        let end = self.lend.offset + self.lend.size;
        if self.revoked || need > self.lend.max_object || self.cursor + need > end {
            return Err(NoRange::Full);
        }
        let base = self.segment.own_base().map_err(|_| NoRange::Unusable)?;
        match self.shared.begin_lend_write(self.lend.id) {
            LendWrite::Granted => {}
            LendWrite::Revoked => {
                self.revoked = true;
                return Err(NoRange::Full);
            }
            LendWrite::Unusable => return Err(NoRange::Unusable),
        }
        let offset = self.cursor;
        self.cursor += need;
        self.writing += 1;
        Ok(Reserved {
            lend: self.lend.id,
            segment_id: self.lend.segment,
            offset,
            generation: self.generation,
            // SAFETY: inside the lend, which lies inside the mapped segment (checked when the
            // lend was taken).
            ptr: unsafe { base.add(offset as usize) },
            segment: self.segment.clone(),
            shared: self.shared.clone(),
            slot: slot.clone(),
            gone: false,
        })
    }
}

/// Why [`Current::take`] gave no range.
enum NoRange {
    /// Full, too small, or taken back by the store: a new lend would do.
    Full,
    /// This process cannot announce its writes (a forked child): no lend at all.
    Unusable,
}

/// After a LEND the store could not grant (short of memory), puts go another way this long
/// before asking again: under sustained memory pressure every put would otherwise pay a
/// failing LEND round trip first.
const LEND_RETRY: std::time::Duration = std::time::Duration::from_millis(100);

/// The lend state of one client.
#[derive(Default)]
pub(crate) struct LendSlot {
    current: Option<Current>,
    /// A LEND is on its way (one at a time; other puts meanwhile go another way).
    lending: bool,
    /// The id of the last lend, to tell a lend handed out again (warm) from a new one.
    last_id: Option<u64>,
    /// The largest block the store lends for (learnt from its first lend).
    max_object: Option<u64>,
    /// No lend is asked for: the client opted out, or the store lends nothing
    /// (`--prefault`, a small store, `--no-shared-reads`, an old daemon).
    refused: bool,
    /// No LEND before this (the last one failed for want of memory).
    retry_after: Option<std::time::Instant>,
}

/// A range of the current lend reserved for one put. Dropping it ends the put's use of the
/// lend (also when a driver's future is cancelled), so the lend can be replaced again.
pub(crate) struct Reserved {
    pub lend: u64,
    /// The segment the lend lies in, and the range's offset there.
    pub segment_id: u32,
    pub offset: u64,
    pub generation: u64,
    /// Where to write the data.
    ptr: *mut u8,
    /// Keeps the mapping alive while writing.
    segment: Arc<MappedSegment>,
    /// Where this put announced itself; withdrawn when it is dropped.
    shared: Arc<SharedReader>,
    slot: Arc<Mutex<LendSlot>>,
    /// The store said it has no such lend: forget it.
    gone: bool,
}

// SAFETY: the pointer is into a shared mapping that `segment` keeps alive; the range is this
// put's alone, and only `write` (which takes `&self` once, in the put's own task) writes it.
unsafe impl Send for Reserved {}
unsafe impl Sync for Reserved {}

impl Drop for Reserved {
    fn drop(&mut self) {
        // The put is over (its PUBLISH answered, or abandoned): the store may take the lend
        // back from now on as far as this put is concerned.
        self.shared.end_lend_write();
        if let Ok(mut slot) = self.slot.lock() {
            // Lend ids start again with a new daemon: the connection generation tells them apart.
            if let Some(c) = slot
                .current
                .as_mut()
                .filter(|c| c.lend.id == self.lend && c.generation == self.generation)
            {
                c.writing = c.writing.saturating_sub(1);
                if self.gone && c.writing == 0 {
                    slot.current = None;
                }
            }
        }
    }
}

impl Reserved {
    /// The store answered that it has no such lend: forget it when this put ends.
    pub(crate) fn lend_gone(&mut self) {
        self.gone = true;
        // No further put takes a range of it (it is forgotten once no put writes into it).
        if let Ok(mut slot) = self.slot.lock() {
            if let Some(c) = (slot.current.as_mut())
                .filter(|c| c.lend.id == self.lend && c.generation == self.generation)
            {
                c.revoked = true;
            }
        }
    }

    /// Where the range starts in this process.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The mapping the range lies in.
    pub(crate) fn mapping(&self) -> &Arc<MappedSegment> {
        &self.segment
    }

    /// Writes the object's bytes into the reserved range; the PUBLISH that makes it an object
    /// with `options` (whether it keeps the reference and waits for its reply included).
    pub(crate) fn write<'a>(
        &self,
        name: &'a str,
        data: &[u8],
        metadata: &'a [u8],
        options: &PutOptions,
    ) -> Result<Request<'a>, Error> {
        // SAFETY: a range of this client's own lend, mapped writable and kept mapped by `self`,
        // reserved for this put alone (block_len(data, metadata) bytes from `ptr`).
        let dst = unsafe { std::slice::from_raw_parts_mut(self.ptr, data.len()) };
        parallel_copy(dst, data);
        let size = data.len() as u64;
        requests::publish(self.lend, self.offset, name, options, metadata, size)
    }
}

/// A PUBLISH of `reserved` answered on connection `generation`: an error unless that is the
/// connection the lend belongs to (reconnected in between, the new daemon knows no such lend).
pub(crate) fn check_answered(
    reserved: &Reserved,
    &(_, generation): &Answered,
) -> Result<(), Error> {
    if generation != reserved.generation {
        return Err(Error::Connection(
            "the daemon went away during a put; put again".into(),
        ));
    }
    Ok(())
}

/// A LEND's answer, `lend` in `segment` (mapped), from connection `answered`: the lend to
/// install once it lies in a segment this client may write.
pub(crate) fn accept(
    lend: Lend,
    segment: Arc<MappedSegment>,
    (maps, generation): &Answered,
) -> Result<Lent, Error> {
    check(&lend, &segment)?;
    // The store lends only to connections with a hold table; one without gets no lend route
    // (`crate::core::put_paths`), so this is a daemon out of step: put another way.
    let shared = maps.shared.clone().ok_or_else(|| {
        Error::Config("a lend without a hold table to take it back through".into())
    })?;
    Ok((lend, segment, *generation, shared))
}

/// A lend must lie inside a segment this client may write.
pub(crate) fn check(lend: &Lend, segment: &MappedSegment) -> Result<(), Error> {
    let end = lend.offset.checked_add(lend.size);
    if !segment.is_own() || end.is_none_or(|e| e > segment.len()) {
        return Err(Error::Protocol(format!(
            "lend {} ({} bytes at {}) is not writable in segment {}",
            lend.id, lend.size, lend.offset, lend.segment
        )));
    }
    Ok(())
}

/// What [`ClientLend::reserve`] answers.
pub(crate) enum Reservation {
    Got(Reserved),
    /// Send LEND for `at_least` bytes, then hand the outcome to [`LendAsked::install`].
    Lend(LendAsked),
    /// The current lend is full (or taken back) and puts still write into it, so it cannot be
    /// replaced yet: put another way, or end those puts and ask again.
    Busy,
    /// No lend now: put another way.
    No,
}

/// A LEND to send (`at_least`); its outcome goes to [`LendAsked::install`]. Dropped without
/// it (an error before the reply, a cancelled future), the client may ask again later.
pub(crate) struct LendAsked {
    pub at_least: u64,
    need: u64,
    slot: Arc<Mutex<LendSlot>>,
    installed: bool,
}

impl Drop for LendAsked {
    fn drop(&mut self) {
        if !self.installed {
            if let Ok(mut slot) = self.slot.lock() {
                slot.lending = false;
            }
        }
    }
}

/// A new lend, its segment mapped writable, the connection generation it belongs to, and that
/// connection's hold table.
pub(crate) type Lent = (Lend, Arc<MappedSegment>, u64, Arc<SharedReader>);

/// Maps a new lend's pages into this process on a thread of its own (`MADV_POPULATE_WRITE`):
/// the store allocated them at LEND, but each page's first write here would still fault (and
/// clear it) inside a put. A lend handed out again is warm already. Best effort: an older
/// kernel without the advice just leaves the faults to the puts.
///
/// Populating faults pages in for writing, so it runs as a put writing into the lend would:
/// under `populating`, an empty reservation announced in the hold table (the handshake of
/// `vovp_shm::lend`) before the lend could be taken back, and withdrawn when it is done. Else
/// it could fault in pages of a lend the store took back and gave back to the machine
/// (outside the store's memory budget).
fn populate_in_background(segment: &Arc<MappedSegment>, lend: &Lend, populating: Reserved) {
    const PAGE: u64 = 4096;
    let Ok(base) = segment.own_base() else {
        return;
    };
    let start = lend.offset / PAGE * PAGE;
    let end = (lend.offset + lend.size).div_ceil(PAGE) * PAGE;
    let end = end.min(segment.len());
    let (addr, len) = (base as usize + start as usize, (end - start) as usize);
    // (A failed spawn drops the reservation at once, withdrawing it.)
    let _ = std::thread::Builder::new()
        .name("vovp-lend-populate".into())
        .spawn(move || {
            // SAFETY: whole pages of this client's own read-write mapping, kept mapped (and
            // the lend this client's) by `populating` until it is done; populating writes
            // nothing (it maps and clears the pages the store allocated, as a first write
            // would).
            let _ = unsafe {
                rustix::mm::madvise(
                    addr as *mut std::ffi::c_void,
                    len,
                    rustix::mm::Advice::LinuxPopulateWrite,
                )
            };
            drop(populating);
        });
}

/// This client's lend: the one it writes into now, and what it learnt of the store's lends.
#[derive(Default)]
pub(crate) struct ClientLend {
    slot: Arc<Mutex<LendSlot>>,
}

impl ClientLend {
    /// The lend of a client that did not opt out ([`crate::ClientOptions::no_lend_puts`]);
    /// otherwise one that never asks for one.
    pub(crate) fn new(enabled: bool) -> Self {
        let lends = ClientLend::default();
        if let Ok(mut slot) = lends.slot.lock() {
            slot.refused = !enabled;
        }
        lends
    }

    /// The largest block (data padded, then metadata) a put may write into a lend of a store
    /// of `capacity` bytes; `None` when this client asks for no lend (opted out, or the store
    /// lends nothing). Until a lend said how large its objects may be, the store's capacity
    /// says it (the size of its lends): an object too big for them asks for no lend (one would
    /// be held for nothing, and the put would wait a round trip more).
    pub(crate) fn largest(&self, capacity: u64) -> Option<u64> {
        let slot = self.slot.lock().ok()?;
        if slot.refused {
            return None;
        }
        (slot.max_object)
            .or_else(|| vovp_types::lends::lend_size(capacity).map(vovp_types::lends::max_object))
    }

    /// Reserves `need` bytes for a put on connection `generation`, or says to ask for a new
    /// lend when the current one is full and no put writes into it (the store retires the old
    /// one when it lends the next, so it is forgotten here first: nothing is written into a
    /// lend the store may free).
    pub(crate) fn reserve(&self, need: u64, generation: u64) -> Reservation {
        let Ok(mut slot) = self.slot.lock() else {
            return Reservation::No;
        };
        // A lend belongs to one connection: a caller on an older one puts another way; a
        // newer connection forgets the old lend once no put writes into it. (Not before: a
        // waiting put still holding a range of it may send its PUBLISH on the new
        // connection, and a restarted daemon numbers its lends from 1 again, so the new
        // lend could carry the old one's id and place. A failed kept put's view of the old
        // lend thus keeps lend puts off until it is dropped.)
        match slot.current.as_ref().map(|c| (c.generation, c.writing)) {
            Some((g, _)) if g > generation => return Reservation::No,
            Some((g, 0)) if g < generation => slot.current = None,
            Some((g, _)) if g < generation => return Reservation::No,
            _ => {}
        }
        if let Some(c) = slot.current.as_mut() {
            match c.take(need, &self.slot) {
                Ok(r) => return Reservation::Got(r),
                Err(NoRange::Unusable) => return Reservation::No,
                Err(NoRange::Full) => {}
            }
        }
        if slot.lending {
            return Reservation::No;
        }
        if slot.current.as_ref().is_some_and(|c| c.writing > 0) {
            return Reservation::Busy;
        }
        if slot
            .retry_after
            .is_some_and(|t| std::time::Instant::now() < t)
        {
            return Reservation::No;
        }
        slot.current = None;
        slot.lending = true;
        // Until the store said how big a lend's objects may be, ask for any lend (the reply
        // says): asking for `need` would be refused, and asked again, for every put too big.
        let at_least = if slot.max_object.is_some() { need } else { 0 };
        Reservation::Lend(LendAsked {
            at_least,
            need,
            slot: self.slot.clone(),
            installed: false,
        })
    }
}

impl LendAsked {
    /// The outcome of this LEND; then reserves the put's bytes in the new lend.
    pub(crate) fn install(mut self, lent: Result<Lent, vovp_types::Error>) -> Option<Reserved> {
        let slot_ref = self.slot.clone();
        let mut slot = slot_ref.lock().ok()?;
        // Under the same lock as the new lend goes in: no other put may ask for one between.
        slot.lending = false;
        self.installed = true;
        match lent {
            Ok((lend, segment, generation, shared)) => {
                slot.max_object = Some(lend.max_object);
                let fresh = slot.last_id != Some(lend.id);
                slot.last_id = Some(lend.id);
                slot.retry_after = None;
                let current = slot.current.insert(Current {
                    generation,
                    cursor: lend.offset,
                    lend,
                    segment,
                    shared,
                    writing: 0,
                    revoked: false,
                });
                // The populate is a writer like a put (an empty reservation, announced now
                // under the lock): the store cannot take the lend back under it, and this
                // client asks for no new lend while it runs.
                let populate = fresh
                    .then(|| current.take(0, &slot_ref).ok())
                    .flatten()
                    .map(|r| (current.segment.clone(), current.lend, r));
                let reserved = current.take(self.need, &slot_ref).ok();
                // Started once the lock is let go: a failed spawn drops the populate's
                // reservation, whose drop takes this lock.
                drop(slot);
                if let Some((segment, lend, populating)) = populate {
                    populate_in_background(&segment, &lend, populating);
                }
                reserved
            }
            Err(e) => {
                // The store's answer that it lends nothing (MALFORMED), or a daemon without
                // LEND (UNKNOWN_OPCODE): for good. Anything else: maybe next time.
                let refusal = match &e {
                    vovp_types::Error::Protocol(m) => {
                        m.starts_with("MALFORMED") || m.starts_with("UNKNOWN_OPCODE")
                    }
                    vovp_types::Error::Config(_) => true,
                    _ => false,
                };
                if refusal {
                    slot.refused = true;
                } else {
                    tracing::debug!("vovp: no lend ({e}); putting another way");
                    slot.retry_after = Some(std::time::Instant::now() + LEND_RETRY);
                }
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{foreign_segment, mappings, own_segment, Table};
    use std::time::{Duration, Instant};

    const MIB: u64 = 1 << 20;

    /// Lend `id` of `size` bytes at `offset` of a fresh arena, its largest object a quarter.
    fn lent(
        table: &Table,
        id: u64,
        offset: u64,
        size: u64,
        generation: u64,
    ) -> Result<Lent, Error> {
        let lend = Lend {
            id,
            segment: 1,
            offset,
            size,
            max_object: size / 4,
        };
        Ok((
            lend,
            own_segment(offset + size),
            generation,
            table.reader.clone(),
        ))
    }

    fn what(r: &Reservation) -> &'static str {
        match r {
            Reservation::Got(_) => "got",
            Reservation::Lend(_) => "lend",
            Reservation::Busy => "busy",
            Reservation::No => "no",
        }
    }

    fn got(r: Reservation) -> Reserved {
        match r {
            Reservation::Got(r) => r,
            other => panic!("a range, not {}", what(&other)),
        }
    }

    fn asked(r: Reservation) -> LendAsked {
        match r {
            Reservation::Lend(a) => a,
            other => panic!("a LEND to send, not {}", what(&other)),
        }
    }

    /// Puts writing into the current lend, once the populating thread of a fresh lend (a
    /// writer like a put) is done.
    fn writers_settled(lend: &ClientLend, puts: u32) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let writing = lend
                .slot
                .lock()
                .unwrap()
                .current
                .as_ref()
                .map_or(0, |c| c.writing);
            if writing == puts {
                return;
            }
            assert!(Instant::now() < deadline, "{writing} writers, not {puts}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn the_largest_object_is_the_stores_until_a_lend_says_and_none_once_refused() {
        let table = Table::new();
        let lend = ClientLend::new(true);
        // A 1 GiB store lends 16 MiB, for objects up to 4 MiB; one under 64 MiB lends nothing.
        assert_eq!(lend.largest(1 << 30), Some(4 * MIB));
        assert_eq!(lend.largest(32 * MIB), None);
        assert_eq!(ClientLend::new(false).largest(1 << 30), None);
        let r = asked(lend.reserve(64, 0)).install(lent(&table, 1, 0, 4 * MIB, 0));
        assert!(r.is_some());
        assert_eq!(lend.largest(1 << 30), Some(MIB));
        // The store's answer that it lends nothing holds for good.
        let refused = ClientLend::new(true);
        let e = Error::Protocol("MALFORMED: no lends here".into());
        assert!(asked(refused.reserve(64, 0)).install(Err(e)).is_none());
        assert_eq!(refused.largest(1 << 30), None);
    }

    #[test]
    fn puts_take_ranges_in_order_and_a_full_lend_is_replaced_only_once_none_writes() {
        let table = Table::new();
        let lend = ClientLend::new(true);
        let first = asked(lend.reserve(128, 0));
        // Until a lend said how large its objects may be, any lend is asked for.
        assert_eq!(first.at_least, 0);
        let a = first.install(lent(&table, 1, 4096, 1024, 0)).unwrap();
        let b = got(lend.reserve(128, 0));
        let c = got(lend.reserve(256, 0));
        assert_eq!(
            (a.offset, b.offset, c.offset),
            (4096, 4096 + 128, 4096 + 256)
        );
        assert_eq!((a.lend, a.segment_id, a.generation), (1, 1, 0));
        // Too big for the lend's objects, or past its end: full, and puts write into it.
        assert_eq!(what(&lend.reserve(257, 0)), "busy");
        let d = got(lend.reserve(256, 0));
        let e = got(lend.reserve(256, 0));
        assert_eq!(e.offset + 256, 4096 + 1024, "the lend is full");
        assert_eq!(what(&lend.reserve(64, 0)), "busy");
        // The store cannot take it back while puts write into it.
        writers_settled(&lend, 5);
        assert!(!table.holds.lend_revoker().revoke(1));
        drop((a, b, c, d, e));
        writers_settled(&lend, 0);
        let next = asked(lend.reserve(256, 0));
        assert_eq!(next.at_least, 256, "the store's object size is known now");
        let f = next.install(lent(&table, 2, 0, 1024, 0)).unwrap();
        assert_eq!((f.lend, f.offset), (2, 0));
    }

    #[test]
    fn a_lend_the_store_took_back_is_not_written_and_another_is_asked_for() {
        let table = Table::new();
        let lend = ClientLend::new(true);
        let a = asked(lend.reserve(64, 0)).install(lent(&table, 1, 0, 4096, 0));
        drop(a);
        writers_settled(&lend, 0);
        assert!(table.holds.lend_revoker().revoke(1));
        let r = lend.reserve(64, 0);
        assert_eq!(what(&r), "lend");
    }

    #[test]
    fn one_lend_is_asked_for_at_a_time_and_a_dropped_ask_may_be_made_again() {
        let table = Table::new();
        let lend = ClientLend::new(true);
        let first = asked(lend.reserve(64, 0));
        assert_eq!(what(&lend.reserve(64, 0)), "no", "a LEND is on its way");
        drop(first);
        let again = asked(lend.reserve(64, 0));
        assert!(again.install(lent(&table, 1, 0, 4096, 0)).is_some());
    }

    #[test]
    fn a_lend_the_store_could_not_grant_is_not_asked_again_at_once() {
        let lend = ClientLend::new(true);
        let short = Error::OutOfMemory {
            requested: 1,
            available: 0,
        };
        assert!(asked(lend.reserve(64, 0)).install(Err(short)).is_none());
        assert_eq!(what(&lend.reserve(64, 0)), "no");
        assert_eq!(lend.largest(1 << 30), Some(4 * MIB), "not refused for good");
    }

    #[test]
    fn a_lend_belongs_to_its_connection() {
        let table = Table::new();
        let lend = ClientLend::new(true);
        let a = asked(lend.reserve(64, 1)).install(lent(&table, 1, 0, 4096, 1));
        // A caller of an older connection puts another way.
        assert_eq!(what(&lend.reserve(64, 0)), "no");
        // A newer one waits for the old lend's puts, then forgets it.
        writers_settled(&lend, 1);
        assert_eq!(what(&lend.reserve(64, 2)), "no");
        drop(a);
        writers_settled(&lend, 0);
        assert_eq!(what(&lend.reserve(64, 2)), "lend");
    }

    #[test]
    fn a_lend_the_store_no_longer_has_is_forgotten_once_its_last_put_ends() {
        let table = Table::new();
        let lend = ClientLend::new(true);
        let mut a = asked(lend.reserve(64, 0))
            .install(lent(&table, 1, 0, 4096, 0))
            .unwrap();
        a.lend_gone();
        writers_settled(&lend, 1);
        assert_eq!(what(&lend.reserve(64, 0)), "busy");
        drop(a);
        assert!(lend.slot.lock().unwrap().current.is_none());
        assert_eq!(what(&lend.reserve(64, 0)), "lend");
    }

    #[test]
    fn a_range_takes_the_bytes_and_publishes_them_with_the_options() {
        let table = Table::new();
        let lend = ClientLend::new(true);
        let r = asked(lend.reserve(128, 0))
            .install(lent(&table, 3, 1024, 4096, 0))
            .unwrap();
        let options = PutOptions {
            replace: true,
            keep_reference: true,
            pipelined: true,
            ..Default::default()
        };
        let req = r.write("n", b"bytes", b"meta", &options).unwrap();
        let publish = requests::publish(3, 1024, "n", &options, b"meta", 5).unwrap();
        assert_eq!(req, publish);
        // SAFETY: the range's first 5 bytes, just written, kept mapped by `r`.
        let written = unsafe { std::slice::from_raw_parts(r.ptr(), 5) };
        assert_eq!(written, b"bytes");
        assert!(matches!(
            r.write("", b"", b"", &options),
            Err(Error::InvalidName(_))
        ));
    }

    #[test]
    fn a_lend_lies_in_a_segment_this_client_writes_on_the_connection_that_lent_it() {
        let lend = |offset, size| Lend {
            id: 1,
            segment: 1,
            offset,
            size,
            max_object: size / 4,
        };
        let own = own_segment(8192);
        assert!(check(&lend(4096, 4096), &own).is_ok());
        assert!(matches!(
            check(&lend(4096, 4097), &own),
            Err(Error::Protocol(_))
        ));
        assert!(matches!(
            check(&lend(u64::MAX, 2), &own),
            Err(Error::Protocol(_))
        ));
        let theirs = foreign_segment(8192);
        assert!(matches!(
            check(&lend(0, 4096), &theirs),
            Err(Error::Protocol(_))
        ));
        // A lend on a connection without a hold table: a daemon out of step.
        let answered = (Arc::new(mappings(1 << 30, None)), 0);
        let no_table = accept(lend(0, 4096), own.clone(), &answered);
        assert!(matches!(no_table, Err(Error::Config(_))));
        // A PUBLISH answered on a newer connection than its lend's.
        let table = Table::new();
        let lends = ClientLend::new(true);
        let r = asked(lends.reserve(64, 0))
            .install(lent(&table, 1, 0, 4096, 0))
            .unwrap();
        let maps = Arc::new(mappings(1 << 30, Some(table.reader.clone())));
        assert!(check_answered(&r, &(maps.clone(), 0)).is_ok());
        assert!(matches!(
            check_answered(&r, &(maps, 1)),
            Err(Error::Connection(_))
        ));
    }
}
