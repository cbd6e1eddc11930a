//! Residency: the pages the kernel holds for the segments, counted so that they stay within
//! the store's budget. The allocator counts objects in 64-byte units, but the kernel backs
//! whole pages: a 64-byte object costs a page, and freed pages stay resident until punched. So
//! each segment keeps its backed pages and its freed ranges ([`SegmentPages`]); a create backs
//! its object's new pages (`fallocate`, after checking the machine has room:
//! [`crate::memory_room`]) or fails like a full store, freed pages are kept warm for the next
//! object within the capacity and given back before it is passed, and the total never passes
//! `capacity` + [`RESIDENT_SLACK_PAGES`] pages.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::range_set::RangeSet;
use super::{AllocFailure, AllocatorActor, SegmentState};
use crate::memory_room::MachineRoom;
use crate::segment::Segment;

#[cfg(test)]
mod tests;

/// How far the segments' pages may go past the capacity, in pages (4 KiB; 2 MiB with huge
/// pages): the budget counts objects in 64-byte units but the kernel backs whole pages, so an
/// object that is not page-aligned at both ends touches a little more than it is charged (an
/// object of the whole capacity a few KiB more, in an arena of its own). Past this, a create
/// first gives back freed pages and then fails (the table evicts and retries), so the pages the
/// store holds never exceed `capacity + RESIDENT_SLACK_PAGES` pages. (Freed pages kept warm
/// are given back before the capacity itself is passed: the slack is never cache.)
///
/// Why the kernel's count stays within it, at every instant: (1) every page the kernel holds
/// for a segment lies in that segment's `backed` ranges: pages become resident only by this
/// actor's `fallocate` (recorded in `backed` in the same message) or by a client touching a
/// live object, which lies inside `backed`; nobody touches a range after it is punched (its
/// objects are gone, their creators' writes ended: lends by the handshake of `vovp_shm::lend`,
/// creates by their seal or abort, or their process is dead). The one exception: a client
/// that keeps writing after its connection ended (broken, or closed by the daemon) can touch
/// its own orphaned arena, outside the count until that arena goes with its last object;
/// bounded by that client's arenas, and a dead process writes nothing. (2) `backed` only grows in
/// [`AllocatorActor::back`], after the check against `capacity + slack`, and a message that
/// moves memory between segments punches first and allocates second. (1) is checked after
/// every message by [`PageAudit`] (`VOVP_AUDIT_PAGES=1`: a 10-minute soak found no page
/// outside). Measuring from outside: the segments are separate memfds, read one at a time, so
/// a reader that reads segment A before a message punches it and segment B after the same
/// message allocated there counts both: +1.7 MiB over `-m` in 20 s of three clients putting
/// 1–4 MiB objects, never past the bound once the daemon is stopped while it is read
/// (`vovp_tests::memfd`). That, not a leak, was the 10-minute soak's +1.3 to +2 MiB.
pub const RESIDENT_SLACK_PAGES: u64 = 64;

/// One segment's pages as the budget counts them.
#[derive(Debug)]
pub(super) struct SegmentPages {
    /// The kernel's unit for this segment's memory.
    page: u64,
    /// Pages that may hold memory (page-aligned ranges): every page a live object touches,
    /// plus freed pages not given back yet — kept so that a later object at the same place
    /// finds them already backed. This, not the objects' bytes, is what the kernel allocates
    /// (a 64-byte object costs a whole page), so the resident budget counts it.
    pub(super) backed: RangeSet,
    /// Freed byte ranges whose pages may still be backed: where giving pages back looks.
    pub(super) freed: RangeSet,
    /// Live objects by the page their first or last byte is in (page index -> count): such a
    /// page is shared with whatever is next to the object, and stays when a freed neighbour's
    /// pages are given back. (A page strictly inside an object is covered by it whole.)
    edges: BTreeMap<u64, u32>,
}

impl SegmentPages {
    pub(super) fn new(segment: &Segment) -> Self {
        let page = segment.page_size();
        let mut backed = RangeSet::default();
        if segment.prefaulted() {
            // Populated at start and meant to stay so: counted whole, never given back.
            backed.insert(0, segment.len().next_multiple_of(page));
        }
        SegmentPages {
            page,
            backed,
            freed: RangeSet::default(),
            edges: BTreeMap::new(),
        }
    }

    /// The pages `start..end` touches, as a byte range.
    fn pages(&self, start: u64, end: u64) -> (u64, u64) {
        (
            start / self.page * self.page,
            end.next_multiple_of(self.page),
        )
    }

    fn edge_pages(&self, start: u64, end: u64) -> [u64; 2] {
        [start / self.page, (end - 1) / self.page]
    }

    /// A live object now occupies `start..end`: the ranges of its pages not backed yet (to
    /// back with [`AllocatorActor::back`], or to [`Self::vacate`] if that fails).
    pub(super) fn occupy(&mut self, start: u64, end: u64) -> Vec<(u64, u64)> {
        self.freed.remove(start, end);
        let [first, last] = self.edge_pages(start, end);
        *self.edges.entry(first).or_default() += 1;
        if last != first {
            *self.edges.entry(last).or_default() += 1;
        }
        let (ps, pe) = self.pages(start, end);
        self.backed.gaps(ps, pe)
    }

    /// The object at `start..end` is gone: its range becomes a candidate for giving back.
    pub(super) fn vacate(&mut self, start: u64, end: u64) {
        let [first, last] = self.edge_pages(start, end);
        let pages = if first == last { 1 } else { 2 };
        for p in [first, last].into_iter().take(pages) {
            if let Some(n) = self.edges.get_mut(&p) {
                *n -= 1;
                if *n == 0 {
                    self.edges.remove(&p);
                }
            }
        }
        self.freed.insert(start, end);
    }

    /// Gives every freed page of `segment` back to the kernel, except pages shared with a live
    /// object; returns the backed bytes given back.
    fn punch_freed(&mut self, segment: &Segment) -> u64 {
        let freed: Vec<(u64, u64)> = self.freed.ranges().collect();
        self.freed.clear();
        let mut given = 0;
        for (s, e) in freed {
            let (mut ps, mut pe) = self.pages(s, e);
            // A page this range shares with a live object stays (the object will free it).
            if ps < s && self.edges.contains_key(&(ps / self.page)) {
                ps += self.page;
            }
            if pe > e && pe > ps && self.edges.contains_key(&((pe - 1) / self.page)) {
                pe -= self.page;
            }
            if pe <= ps {
                continue;
            }
            for (a, b) in self.backed.remove(ps, pe) {
                segment.punch(a, b - a);
                given += b - a;
            }
        }
        given
    }

    pub(super) fn resident(&self) -> u64 {
        self.backed.bytes()
    }
}

impl SegmentState {
    /// See [`SegmentPages::punch_freed`].
    pub(super) fn punch_freed(&mut self) -> u64 {
        self.pages.punch_freed(&self.segment)
    }
}

/// The allocator's residency settings and state.
pub(super) struct Residency {
    /// Resident pages may pass `capacity` by this much (partly used pages).
    pub(super) slack: u64,
    /// Back each object's new pages when it is created (after checking the machine's room).
    backing: bool,
    room: MachineRoom,
    /// When a create was last refused for want of machine memory (the warning is rate-limited).
    warned: Option<Instant>,
    /// `VOVP_AUDIT_PAGES` set: the kernel's pages are checked against the count after every
    /// message (see [`PageAudit`]).
    audit: Option<PageAudit>,
}

impl Residency {
    /// For segments of `page_size` pages; backing on.
    pub(super) fn new(page_size: u64) -> Self {
        Residency {
            slack: RESIDENT_SLACK_PAGES * page_size,
            backing: true,
            room: MachineRoom::new(),
            warned: None,
            audit: std::env::var_os("VOVP_AUDIT_PAGES").map(|_| PageAudit::default()),
        }
    }

    /// Bytes more the store could back now (see `HostUsage::backable`): `resident` and `used`
    /// are the allocator's; huge pages come from their own pool, which the machine's figures
    /// do not describe.
    pub(super) fn backable(&mut self, resident: u64, used: u64, huge_pages: bool) -> u64 {
        let checked = self.backing && !huge_pages;
        match checked.then(|| self.room.available()).flatten() {
            // Freed pages (resident beyond the live objects) are the store's to give back.
            Some(room) => room.saturating_add(resident.saturating_sub(used)),
            None => u64::MAX,
        }
    }

    /// A segment dropped while clients may still keep it open: the audit checks it holds no
    /// page.
    pub(super) fn dropped(&mut self, segment: &Arc<Segment>) {
        if let Some(audit) = self.audit.as_mut() {
            audit.dropped.push(Arc::downgrade(segment));
        }
    }
}

/// A self-check for tests and soaks (`VOVP_AUDIT_PAGES=1` in the daemon's environment): after
/// every message, each segment's pages as the kernel holds them (`SEEK_DATA`) must lie inside
/// its `backed` ranges, and a dropped segment the store still keeps open must hold none. A
/// page outside is memory someone touched that the budget does not count: logged once, at
/// ERROR, with "uncounted pages" (what `tests/tests/resident_bound.rs` looks for).
#[derive(Default)]
struct PageAudit {
    reported: HashSet<(u32, u64)>,
    dropped: Vec<Weak<Segment>>,
}

impl AllocatorActor {
    /// Whether a create backs its object's new pages (`fallocate`, after checking that the
    /// machine and the memory cgroup have room for them), so that a create the store accepts
    /// can never fault later (SIGBUS, the OOM killer) in the client that writes it; a create
    /// that cannot be backed fails like a full store (the table evicts, then `OutOfMemory`).
    /// On by default. Off (`--lazy-pages`), pages are allocated on first touch, as Plasma did.
    pub fn with_backing(mut self, backing: bool) -> Self {
        self.residency.backing = backing;
        self
    }

    pub(super) fn resident(&self) -> u64 {
        self.segments.values().map(|s| s.pages.resident()).sum()
    }

    /// The check of [`PageAudit`], when on.
    pub(super) fn audit(&mut self, after: &str) {
        let Some(audit) = self.residency.audit.as_mut() else {
            return;
        };
        audit.dropped.retain(|w| w.strong_count() > 0);
        for seg in audit.dropped.iter().filter_map(Weak::upgrade) {
            let n = seg.allocated_bytes();
            if n > 0 && audit.reported.insert((seg.id(), u64::MAX)) {
                tracing::error!(
                    "uncounted pages: dropped segment {} holds {n} bytes after {after}: {:?}",
                    seg.id(),
                    seg.data_extents()
                );
            }
        }
        for (&id, seg) in &self.segments {
            for (start, end) in seg.segment.data_extents() {
                for (a, b) in seg.pages.backed.gaps(start, end) {
                    if audit.reported.insert((id, a)) {
                        tracing::error!(
                            "uncounted pages: segment {id} (owner {:?}, orphaned {}, {} live) \
                             bytes {a}..{b} after {after}; counted {:?}",
                            seg.owner,
                            seg.orphaned,
                            seg.alloc.live_allocations(),
                            seg.pages.backed.last_before(b),
                        );
                    }
                }
            }
        }
    }

    /// Makes the pages `gaps` of segment `id` (pages a new object touches that are not
    /// resident yet) resident: within the budget (giving freed pages back first), and, with
    /// backing on, allocated now after checking the machine has room for them.
    pub(super) fn back(&mut self, id: u32, gaps: &[(u64, u64)]) -> Result<(), AllocFailure> {
        let new: u64 = gaps.iter().map(|(a, b)| b - a).sum();
        if new == 0 {
            return Ok(());
        }
        // Freed pages are kept warm within the capacity; the slack is only for the partly used
        // pages of live objects, never more cache.
        let over = (self.resident() + new).saturating_sub(self.capacity);
        if over > 0 {
            self.give_back(over, id);
        }
        if self.resident() + new > self.capacity.saturating_add(self.residency.slack) {
            return Err(AllocFailure::NoSpace);
        }
        if self.residency.backing {
            // Huge pages come from their own reserved pool, not from what the machine has
            // available: there `fallocate` itself says ENOSPC, and no OOM killer is involved.
            let huge = self.segments[&id].segment.uses_huge_pages();
            if !huge && !self.residency.room.take(new) {
                // Our own freed pages are memory the machine gets back.
                if self.give_back(u64::MAX, id) > 0 {
                    self.residency.room.invalidate();
                }
                if !self.residency.room.take(new) {
                    self.refused(new, "the machine or its memory cgroup has too little left");
                    return Err(AllocFailure::NoSpace);
                }
            }
            let mut result = self.fallocate(id, gaps);
            if result.is_err() && self.give_back(u64::MAX, id) > 0 {
                result = self.fallocate(id, gaps);
            }
            if let Err(e) = result {
                let seg = &self.segments[&id];
                for &(a, b) in gaps {
                    seg.segment.punch(a, b - a); // what was backed before the failure
                }
                self.residency.room.invalidate();
                self.refused(new, &format!("fallocate: {e}"));
                return Err(AllocFailure::NoSpace);
            }
        }
        let seg = self.segments.get_mut(&id).expect("backed");
        for &(a, b) in gaps {
            seg.pages.backed.insert(a, b);
        }
        Ok(())
    }

    fn fallocate(&self, id: u32, gaps: &[(u64, u64)]) -> Result<(), rustix::io::Errno> {
        let seg = &self.segments[&id];
        gaps.iter()
            .try_for_each(|&(a, b)| seg.segment.back(a, b - a))
    }

    /// Says (at most every 10 s) that a create was refused for want of memory to back it.
    fn refused(&mut self, bytes: u64, why: &str) {
        if self
            .residency
            .warned
            .is_none_or(|at| at.elapsed() >= Duration::from_secs(10))
        {
            self.residency.warned = Some(Instant::now());
            tracing::warn!(
                "a create needing {bytes} new bytes of memory was refused ({why}; last reading \
                 {:?} bytes available): the store answers OUT_OF_MEMORY, not SIGBUS later",
                self.residency.room.last()
            );
        }
    }

    /// Gives freed pages back until `wanted` bytes were (or none are left): those of orphaned
    /// arenas first, then any other segment's, and last those of the segment just used (whose
    /// freed pages its owner is likeliest to reuse). Returns the bytes given back.
    pub(super) fn give_back(&mut self, wanted: u64, just_used: u32) -> u64 {
        let mut order: Vec<(bool, bool, u32)> = self
            .segments
            .iter()
            .filter(|(_, s)| s.pages.freed.bytes() > 0)
            .map(|(&id, s)| (!s.orphaned, id == just_used, id))
            .collect();
        order.sort();
        let mut given = 0;
        for (_, _, id) in order {
            if given >= wanted {
                break;
            }
            if let Some(seg) = self.segments.get_mut(&id) {
                given += seg.punch_freed();
            }
            self.drop_if_done(id);
        }
        given
    }
}
