//! The allocator actor: owns the host segments' free space.
//!
//! Inside each segment a TLSF-style offset allocator (the `offset-allocator` crate: O(1) alloc
//! and free, bounded fragmentation, bookkeeping outside the managed memory) hands out runs of
//! 64-byte units, so every object is 64-byte aligned by construction.

use std::collections::BTreeMap;
use std::sync::Arc;

use kameo::message::{Context, Message};
use kameo::Actor;
use offset_allocator::{Allocation, Allocator};

use crate::segment::Segment;
use crate::types::{HolderId, ALIGNMENT};

/// Most live allocations per segment (the allocator preallocates this many nodes, ~24 B each).
/// This is the store's object limit (PROTOCOL.md): past it a create fails with
/// `TooManyObjects` unless evicting an unreferenced object frees a slot.
pub const MAX_ALLOCS_PER_SEGMENT: u32 = 1 << 20;

/// A run of host memory handed to one object.
#[derive(Clone, Copy)]
pub struct HostBlock {
    pub segment: u32,
    pub offset: u64,
    /// Bytes reserved (the object's size rounded up to the allocator's bin, at least one unit).
    pub reserved: u64,
    /// Bytes counted against the store's capacity: the size rounded up to [`ALIGNMENT`]. The
    /// rest of the reservation is never touched, so never resident: counting it would make an
    /// object as large as the store (Plasma's test does this) not fit.
    pub charged: u64,
    allocation: Allocation,
}

impl std::fmt::Debug for HostBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBlock")
            .field("segment", &self.segment)
            .field("offset", &self.offset)
            .field("reserved", &self.reserved)
            .field("charged", &self.charged)
            .finish()
    }
}

/// Why an allocation failed: the caller evicts for either, but reports them differently.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocFailure {
    /// No free run is large enough (or the size cannot be represented at all).
    NoSpace,
    /// Every allocation slot is taken, however much memory is free.
    TooManyAllocations { limit: u64 },
}

/// Free-space bookkeeping for one segment, in [`ALIGNMENT`]-byte units.
pub struct SegmentAllocator {
    inner: Allocator,
    capacity: u64,
    used: u64,
    live: u64,
    max_allocs: u64,
}

impl SegmentAllocator {
    /// Manages `capacity` bytes (rounded down to whole units; at most 2^32 units = 256 GiB).
    pub fn new(capacity: u64) -> Self {
        Self::with_max_allocations(capacity, MAX_ALLOCS_PER_SEGMENT)
    }

    /// As [`SegmentAllocator::new`], holding at most `max_allocs` allocations at once.
    pub fn with_max_allocations(capacity: u64, max_allocs: u32) -> Self {
        let units = (capacity / ALIGNMENT).min(u32::MAX as u64 - 1) as u32;
        let max_allocs = max_allocs.min(units).clamp(1, MAX_ALLOCS_PER_SEGMENT);
        SegmentAllocator {
            // The inner allocator spends a node on every free run too (at most one more than
            // the live allocations), so it gets twice the nodes: the object limit is then ours
            // to enforce (`TooManyAllocations`), never its silent "no space".
            inner: Allocator::with_max_allocs(
                units,
                max_allocs.saturating_mul(2).saturating_add(1),
            ),
            capacity: units as u64 * ALIGNMENT,
            used: 0,
            live: 0,
            max_allocs: max_allocs as u64,
        }
    }

    /// Reserves room for `size` bytes.
    pub fn allocate(&mut self, size: u64) -> Result<(u64, u64, Allocation), AllocFailure> {
        let units = reserved_units(size)
            .and_then(|u| u32::try_from(u).ok())
            .ok_or(AllocFailure::NoSpace)?;
        if self.live >= self.max_allocs {
            return Err(AllocFailure::TooManyAllocations {
                limit: self.max_allocs,
            });
        }
        let allocation = self.inner.allocate(units).ok_or(AllocFailure::NoSpace)?;
        let reserved = units as u64 * ALIGNMENT;
        self.used += reserved;
        self.live += 1;
        Ok((allocation.offset as u64 * ALIGNMENT, reserved, allocation))
    }

    pub fn free(&mut self, allocation: Allocation, reserved: u64) {
        self.inner.free(allocation);
        self.used -= reserved;
        self.live -= 1;
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn used(&self) -> u64 {
        self.used
    }

    pub fn live_allocations(&self) -> u64 {
        self.live
    }

    /// The largest request that would succeed now.
    pub fn largest_free(&self) -> u64 {
        self.inner.storage_report().largest_free_region as u64 * ALIGNMENT
    }
}

/// Units reserved for `size` bytes: rounded up to the allocator's bin size (3 mantissa bits,
/// so at most 12.5 % over); `None` when that overflows (sizes near 2^64, which no segment can
/// hold anyway: callers treat it as "does not fit", never as a small number). The offset allocator only searches bins at or above the rounded-up
/// request, so a freed block of an unrounded size could not be reused by a request of the very
/// same size; rounding makes equal sizes reuse each other's blocks exactly, which keeps eviction
/// from freeing more objects than the new one needs.
pub fn reserved_units(size: u64) -> Option<u64> {
    let units = size.div_ceil(ALIGNMENT).max(1);
    if units < 8 {
        return Some(units);
    }
    let step = 1u64 << (63 - units.leading_zeros() - 3);
    units.div_ceil(step).checked_mul(step)
}

/// Bytes reserved for an allocation of `size` bytes (`None` on overflow).
pub fn reserved_bytes(size: u64) -> Option<u64> {
    reserved_units(size)?.checked_mul(ALIGNMENT)
}

/// Usage of host memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, kameo::Reply)]
pub struct HostUsage {
    pub capacity: u64,
    pub used: u64,
    pub live_allocations: u64,
    /// Upper bound of the pages the segments may hold (allocated plus freed but not yet given
    /// back to the kernel); kept at or below `capacity`.
    pub resident: u64,
    /// Live segments (the store's own plus client arenas).
    pub segments: u64,
}

/// Who may write into a new object: the store itself (segment 0: embedded creates, inline puts,
/// which the store copies in) or one client, whose objects go into its own arenas.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Writer {
    Store,
    Client(HolderId),
}

/// Live allocations an arena holds at most (its node pool is preallocated: keep arenas light).
const ARENA_MAX_ALLOCS: u32 = 4096;

struct SegmentState {
    segment: Arc<Segment>,
    alloc: SegmentAllocator,
    /// The client that writes this segment (`None`: segment 0, the store's own).
    owner: Option<HolderId>,
    /// The owner has disconnected: nothing new goes here; the segment goes with its last object.
    orphaned: bool,
    /// Freed ranges whose pages were not given back yet (start -> end), kept so a later object
    /// at the same place finds its pages already faulted in, and counted as resident.
    dirty: BTreeMap<u64, u64>,
    dirty_bytes: u64,
    /// Bytes of the live objects here that can be touched (their `charged` bytes).
    charged: u64,
}

impl SegmentState {
    fn new(segment: Arc<Segment>, alloc: SegmentAllocator, owner: Option<HolderId>) -> Self {
        SegmentState {
            segment,
            alloc,
            owner,
            orphaned: false,
            dirty: BTreeMap::new(),
            dirty_bytes: 0,
            charged: 0,
        }
    }

    /// Records `start..end` as freed but still resident (merging with neighbours).
    fn add_dirty(&mut self, mut start: u64, mut end: u64) {
        self.take_dirty(start, end); // never count a byte twice
        if let Some((&s, &e)) = self.dirty.range(..start).next_back() {
            if e == start {
                self.dirty.remove(&s);
                self.dirty_bytes -= e - s;
                start = s;
            }
        }
        if let Some(&e) = self.dirty.get(&end) {
            self.dirty.remove(&end);
            self.dirty_bytes -= e - end;
            end = e;
        }
        self.dirty.insert(start, end);
        self.dirty_bytes += end - start;
    }

    /// Removes `start..end` from the dirty ranges (a new object took it); returns the bytes
    /// that were dirty, i.e. already resident.
    fn take_dirty(&mut self, start: u64, end: u64) -> u64 {
        let overlapping: Vec<(u64, u64)> = self
            .dirty
            .range(..end)
            .rev()
            .take_while(|(_, &e)| e > start)
            .map(|(&s, &e)| (s, e))
            .collect();
        let mut taken = 0;
        for (s, e) in overlapping {
            self.dirty.remove(&s);
            self.dirty_bytes -= e - s;
            taken += e.min(end) - s.max(start);
            if s < start {
                self.dirty.insert(s, start);
                self.dirty_bytes += start - s;
            }
            if e > end {
                self.dirty.insert(end, e);
                self.dirty_bytes += e - end;
            }
        }
        taken
    }

    /// Gives every dirty page back to the kernel; returns the bytes no longer counted.
    fn punch_all(&mut self) -> u64 {
        for (&s, &e) in &self.dirty {
            self.segment.punch(s, e - s);
        }
        self.dirty.clear();
        std::mem::take(&mut self.dirty_bytes)
    }

    fn resident(&self) -> u64 {
        self.charged + self.dirty_bytes
    }
}

/// The allocator actor: segment 0 (the store's own, `capacity` bytes) plus one or more arenas
/// per client that creates objects, all under one budget of `capacity` bytes — of objects
/// (eviction's measure) and of resident pages (freed pages are given back before the budget is
/// passed).
#[derive(Actor)]
pub struct AllocatorActor {
    /// By segment id (an id is never reused while any client may still map it: ids only grow).
    segments: BTreeMap<u32, SegmentState>,
    next_id: u32,
    capacity: u64,
    used: u64,
    live: u64,
    max_objects: u64,
    /// Virtual size of a client arena (bigger objects get an arena of their own size).
    arena_size: u64,
    /// Client arenas at all; off: every object lives in segment 0 (`--prefault` keeps that,
    /// since arenas are not prefaulted and would double the resident memory).
    arenas: bool,
    huge_pages: bool,
}

impl AllocatorActor {
    /// Manages `capacity` bytes of objects: `segment0` (the store's own segment, at least
    /// `reserved_bytes(capacity)` long, so an object as large as the store fits) and, with
    /// `arenas`, arenas of each client's own.
    pub fn new(segment0: Arc<Segment>, capacity: u64, max_objects: u32, arenas: bool) -> Self {
        let huge_pages = segment0.uses_huge_pages();
        let mut segments = BTreeMap::new();
        let alloc = SegmentAllocator::with_max_allocations(segment0.len(), max_objects);
        segments.insert(0, SegmentState::new(segment0, alloc, None));
        AllocatorActor {
            segments,
            next_id: 1,
            capacity,
            used: 0,
            live: 0,
            max_objects: max_objects as u64,
            arena_size: (capacity / 4).clamp(16 << 20, 1 << 30).min(capacity),
            arenas,
            huge_pages,
        }
    }

    fn usage(&self) -> HostUsage {
        HostUsage {
            capacity: self.capacity,
            used: self.used,
            live_allocations: self.live,
            resident: self.segments.values().map(SegmentState::resident).sum(),
            segments: self.segments.len() as u64,
        }
    }

    fn allocate(&mut self, size: u64, writer: Writer) -> Result<HostBlock, AllocFailure> {
        let reserved = reserved_bytes(size).ok_or(AllocFailure::NoSpace)?;
        let charged = size.next_multiple_of(ALIGNMENT).max(ALIGNMENT);
        if self.used.saturating_add(charged) > self.capacity {
            return Err(AllocFailure::NoSpace);
        }
        if self.live >= self.max_objects {
            return Err(AllocFailure::TooManyAllocations {
                limit: self.max_objects,
            });
        }
        let owner = match writer {
            Writer::Client(h) if self.arenas => Some(h),
            _ => None,
        };
        let candidates: Vec<u32> = self
            .segments
            .iter()
            .filter(|(_, s)| s.owner == owner && !s.orphaned)
            .map(|(&id, _)| id)
            .collect();
        let mut placed = None;
        for id in candidates {
            let seg = self.segments.get_mut(&id).expect("listed");
            if let Ok(a) = seg.alloc.allocate(size) {
                placed = Some((id, a));
                break;
            }
        }
        let (id, (offset, reserved, allocation)) = match (placed, owner) {
            (Some(p), _) => p,
            (None, None) => return Err(AllocFailure::NoSpace),
            (None, Some(h)) => {
                let id = self.new_arena(h, reserved)?;
                let seg = self.segments.get_mut(&id).expect("just made");
                (id, seg.alloc.allocate(size)?)
            }
        };
        let seg = self.segments.get_mut(&id).expect("placed");
        let already_resident = seg.take_dirty(offset, offset + charged);
        seg.charged += charged;
        self.used += charged;
        self.live += 1;
        self.stay_within_budget(charged - already_resident, id);
        Ok(HostBlock {
            segment: id,
            offset,
            reserved,
            charged,
            allocation,
        })
    }

    /// A new arena for `owner` that can hold `reserved` bytes.
    fn new_arena(&mut self, owner: HolderId, reserved: u64) -> Result<u32, AllocFailure> {
        let size = reserved.max(self.arena_size).next_multiple_of(2 << 20);
        let id = self.next_id;
        let segment = Segment::create_arena(id, size, self.huge_pages).map_err(|e| {
            tracing::warn!("cannot create an arena of {size} bytes: {e}");
            AllocFailure::NoSpace
        })?;
        self.next_id = self.next_id.checked_add(1).ok_or(AllocFailure::NoSpace)?;
        let max = (size / ALIGNMENT).min(ARENA_MAX_ALLOCS as u64) as u32;
        let alloc = SegmentAllocator::with_max_allocations(size, max);
        self.segments
            .insert(id, SegmentState::new(Arc::new(segment), alloc, Some(owner)));
        tracing::debug!("arena {id} ({size} bytes) for holder {owner}");
        Ok(id)
    }

    /// Keeps resident pages within the capacity: when `added` new bytes would pass it, freed
    /// pages are given back, those of orphaned arenas first, then any other segment's, and last
    /// those of the segment just used (whose freed pages its owner is likeliest to reuse).
    fn stay_within_budget(&mut self, added: u64, just_used: u32) {
        let resident: u64 = self.segments.values().map(SegmentState::resident).sum();
        let mut over = (resident).saturating_sub(self.capacity);
        if over == 0 || added == 0 {
            return;
        }
        let mut order: Vec<(bool, bool, u32)> = self
            .segments
            .iter()
            .filter(|(_, s)| s.dirty_bytes > 0)
            .map(|(&id, s)| (!s.orphaned, id == just_used, id))
            .collect();
        order.sort();
        for (_, _, id) in order {
            if over == 0 {
                break;
            }
            if let Some(seg) = self.segments.get_mut(&id) {
                over = over.saturating_sub(seg.punch_all());
            }
        }
    }

    fn free(&mut self, block: HostBlock) {
        let Some(seg) = self.segments.get_mut(&block.segment) else {
            return;
        };
        seg.alloc.free(block.allocation, block.reserved);
        seg.charged -= block.charged;
        self.used -= block.charged;
        self.live -= 1;
        if seg.orphaned {
            // Nobody will reuse these pages: give them back now.
            seg.segment.punch(block.offset, block.charged);
        } else {
            seg.add_dirty(block.offset, block.offset + block.charged);
        }
        self.drop_if_done(block.segment);
    }

    /// Drops a client segment with no object left once it cannot be reused: its owner is gone,
    /// or it is an arena of one big object's size.
    fn drop_if_done(&mut self, id: u32) {
        let standard = self.arena_size.next_multiple_of(2 << 20);
        let Some(seg) = self.segments.get(&id) else {
            return;
        };
        if id == 0 || seg.alloc.live_allocations() > 0 {
            return;
        }
        if seg.orphaned || seg.segment.len() > standard {
            if let Some(mut seg) = self.segments.remove(&id) {
                // Clients that still map it (holding no object in it) keep only address space.
                seg.segment.punch(0, seg.segment.len());
                seg.dirty.clear();
                tracing::debug!("segment {id} dropped");
            }
        }
    }

    fn owner_gone(&mut self, holder: HolderId) {
        let ids: Vec<u32> = self
            .segments
            .iter()
            .filter(|(_, s)| s.owner == Some(holder))
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            if let Some(seg) = self.segments.get_mut(&id) {
                seg.orphaned = true;
                seg.punch_all();
            }
            self.drop_if_done(id);
        }
    }
}

/// Reserve `size` bytes for an object `writer` will fill. Replies why when nothing fits (the
/// table actor then evicts and retries).
pub struct Allocate {
    pub size: u64,
    pub writer: Writer,
}

impl Message<Allocate> for AllocatorActor {
    type Reply = Result<HostBlock, AllocFailure>;

    async fn handle(&mut self, msg: Allocate, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.allocate(msg.size, msg.writer)
    }
}

/// Return blocks to their segments.
pub struct Free(pub Vec<HostBlock>);

impl Message<Free> for AllocatorActor {
    type Reply = ();

    async fn handle(&mut self, msg: Free, _: &mut Context<Self, Self::Reply>) {
        for block in msg.0 {
            self.free(block);
        }
    }
}

/// A client went away: its arenas take nothing new and go with their last object.
pub struct OwnerGone(pub HolderId);

impl Message<OwnerGone> for AllocatorActor {
    type Reply = ();

    async fn handle(&mut self, msg: OwnerGone, _: &mut Context<Self, Self::Reply>) {
        self.owner_gone(msg.0);
    }
}

/// A segment for a client to map: its read-write fd for the client that writes it, the
/// read-only fd for everyone else. `None` for a segment that does not exist (any more).
pub struct SegmentFor {
    pub id: u32,
    pub holder: HolderId,
}

/// What [`SegmentFor`] answers: the segment and whether the asker may write it.
#[derive(kameo::Reply)]
pub struct SegmentGrant {
    pub segment: Arc<Segment>,
    pub writable: bool,
}

impl Message<SegmentFor> for AllocatorActor {
    type Reply = Option<SegmentGrant>;

    async fn handle(&mut self, m: SegmentFor, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let seg = self.segments.get(&m.id)?;
        Some(SegmentGrant {
            segment: seg.segment.clone(),
            writable: seg.owner == Some(m.holder) && !seg.orphaned,
        })
    }
}

/// The segment with id `0` or any other live one, for the store's own access (views of
/// embedded gets).
pub struct SegmentById(pub u32);

impl Message<SegmentById> for AllocatorActor {
    type Reply = Option<Arc<Segment>>;

    async fn handle(&mut self, m: SegmentById, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.segments.get(&m.0).map(|s| s.segment.clone())
    }
}

/// Current host usage.
pub struct Usage;

impl Message<Usage> for AllocatorActor {
    type Reply = HostUsage;

    async fn handle(&mut self, _: Usage, _: &mut Context<Self, Self::Reply>) -> HostUsage {
        self.usage()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn reservation_rounds_to_bins() {
        assert_eq!(reserved_bytes(0), Some(64));
        assert_eq!(reserved_bytes(65), Some(128));
        assert_eq!(reserved_units(9 * 64), Some(9));
        assert_eq!(reserved_units(17 * 64), Some(18));
        assert_eq!(reserved_bytes((1 << 18) - 64), Some(1 << 18));
        for size in [1u64, 1000, 123_456_789, 1 << 30] {
            let r = reserved_bytes(size).unwrap();
            assert!(r >= size && r <= size + size / 8 + 64, "{size} -> {r}");
        }
    }

    /// Regression (daemon spun forever on CREATE of 2^64-1): sizes whose reservation does not
    /// fit in a u64 are "no space", never a wrapped-around small number.
    #[test]
    fn sizes_near_u64_max_never_wrap() {
        for size in [u64::MAX, u64::MAX - 63, 0xF000_0000_0000_0001, 1 << 63] {
            let r = reserved_bytes(size);
            assert!(r.is_none_or(|r| r >= size), "{size:#x} -> {r:?}");
        }
        assert_eq!(reserved_bytes(u64::MAX), None);
        let mut a = SegmentAllocator::new(1 << 20);
        assert_eq!(a.allocate(u64::MAX).err(), Some(AllocFailure::NoSpace));
        assert_eq!(a.allocate(1 << 40).err(), Some(AllocFailure::NoSpace));
    }

    #[test]
    fn slot_exhaustion_is_its_own_failure() {
        // 64 units: at most 64 allocations, whatever their size.
        let mut a = SegmentAllocator::new(64 * ALIGNMENT);
        let live: Vec<_> = (0..64).map(|_| a.allocate(1).unwrap()).collect();
        assert_eq!(
            a.allocate(1).err(),
            Some(AllocFailure::TooManyAllocations { limit: 64 })
        );
        a.free(live[0].2, live[0].1);
        assert!(a.allocate(1).is_ok());
    }

    #[test]
    fn a_freed_block_serves_the_next_request_of_the_same_size() {
        let mut a = SegmentAllocator::new(1 << 20);
        let size = (1 << 18) - 64;
        let blocks: Vec<_> = (0..4).map(|_| a.allocate(size).unwrap()).collect();
        assert!(a.allocate(size).is_err());
        a.free(blocks[1].2, blocks[1].1);
        assert_eq!(a.allocate(size).unwrap().0, blocks[1].0);
    }

    #[test]
    fn zero_sized_objects_get_distinct_offsets() {
        let mut a = SegmentAllocator::new(1 << 16);
        let (o1, r1, _) = a.allocate(0).unwrap();
        let (o2, _, _) = a.allocate(0).unwrap();
        assert_ne!(o1, o2);
        assert_eq!(r1, ALIGNMENT);
    }

    #[test]
    fn fills_exactly_and_refuses_beyond() {
        let mut a = SegmentAllocator::new(1 << 20);
        let (_, _, big) = a.allocate(1 << 20).unwrap();
        assert!(a.allocate(1).is_err());
        a.free(big, 1 << 20);
        assert_eq!(a.used(), 0);
        assert!(a.allocate(1 << 20).is_ok());
    }

    fn actor(capacity: u64) -> AllocatorActor {
        let seg = Arc::new(Segment::create(0, capacity, false, false).unwrap());
        AllocatorActor::new(seg, capacity, 1 << 20, true)
    }

    #[test]
    fn each_client_writes_its_own_arenas_and_the_store_segment_0() {
        let mut a = actor(64 << 20);
        let s = a.allocate(1000, Writer::Store).unwrap();
        let c1 = a
            .allocate(1000, Writer::Client(HolderId::from_raw(1)))
            .unwrap();
        let c2 = a
            .allocate(1000, Writer::Client(HolderId::from_raw(2)))
            .unwrap();
        let c1b = a
            .allocate(1000, Writer::Client(HolderId::from_raw(1)))
            .unwrap();
        assert_eq!(s.segment, 0);
        assert!(c1.segment != 0 && c2.segment != 0 && c1.segment != c2.segment);
        assert_eq!(c1b.segment, c1.segment, "one arena serves many objects");
        // A big object gets an arena of its own size, dropped with it.
        let big = a
            .allocate(40 << 20, Writer::Client(HolderId::from_raw(1)))
            .unwrap();
        assert!(big.segment != c1.segment);
        let segments = a.usage().segments;
        a.free(big);
        assert_eq!(a.usage().segments, segments - 1);
        // A client gone: its arenas go with their last object.
        a.owner_gone(HolderId::from_raw(1));
        a.free(c1);
        assert!(a.segments.contains_key(&c1b.segment));
        a.free(c1b);
        assert!(!a.segments.contains_key(&c1b.segment));
        for b in [s, c2] {
            a.free(b);
        }
        assert_eq!(a.usage().used, 0);
    }

    #[test]
    fn freed_pages_are_reused_warm_and_given_back_before_the_budget_is_passed() {
        let cap = 64 << 20;
        let mut a = actor(cap);
        let blocks: Vec<_> = (0..12)
            .map(|_| {
                a.allocate(4 << 20, Writer::Client(HolderId::from_raw(1)))
                    .unwrap()
            })
            .collect();
        for b in blocks {
            a.free(b);
        }
        // 48 MiB freed but kept (the owner's next objects find them faulted in).
        assert_eq!(a.usage().resident, 48 << 20);
        let again = a
            .allocate(4 << 20, Writer::Client(HolderId::from_raw(1)))
            .unwrap();
        assert_eq!(a.usage().resident, 48 << 20, "reused, not newly resident");
        a.free(again);
        // Another client needs 40 MiB: the first client's freed pages are given back.
        let other: Vec<_> = (0..10)
            .map(|_| {
                a.allocate(4 << 20, Writer::Client(HolderId::from_raw(2)))
                    .unwrap()
            })
            .collect();
        let u = a.usage();
        assert!(u.resident <= cap, "{u:?}");
        assert_eq!(u.used, 40 << 20);
        for b in other {
            a.free(b);
        }
    }

    proptest! {
        /// The dirty-range bookkeeping never double counts and never overlaps.
        #[test]
        fn dirty_ranges_stay_disjoint(ops in proptest::collection::vec((0u64..64, 1u64..16, any::<bool>()), 1..200)) {
            let seg = Segment::create(0, 1 << 20, false, false).unwrap();
            let mut st = SegmentState::new(Arc::new(seg), SegmentAllocator::new(1 << 20), None);
            let mut model = [false; 80];
            for (start, len, add) in ops {
                let end = start + len;
                if add {
                    st.add_dirty(start, end);
                    model[start as usize..end as usize].iter_mut().for_each(|b| *b = true);
                } else {
                    let was = model[start as usize..end as usize].iter().filter(|b| **b).count() as u64;
                    prop_assert_eq!(st.take_dirty(start, end), was);
                    model[start as usize..end as usize].iter_mut().for_each(|b| *b = false);
                }
                let counted = model.iter().filter(|b| **b).count() as u64;
                prop_assert_eq!(st.dirty_bytes, counted);
                let mut last = 0;
                for (&s, &e) in &st.dirty {
                    prop_assert!(s >= last && e > s);
                    last = e;
                }
            }
        }


        /// Random alloc/free sequences never overlap, stay aligned, and give everything back.
        #[test]
        fn allocations_never_overlap(ops in proptest::collection::vec((0u64..200_000, any::<bool>()), 1..300)) {
            let capacity = 8 << 20;
            let mut a = SegmentAllocator::new(capacity);
            let mut live: Vec<(u64, u64, Allocation)> = Vec::new();
            for (size, free_one) in ops {
                if free_one && !live.is_empty() {
                    let idx = (size as usize) % live.len();
                    let (_, reserved, alloc) = live.swap_remove(idx);
                    a.free(alloc, reserved);
                } else if let Ok((off, reserved, alloc)) = a.allocate(size) {
                    prop_assert_eq!(off % ALIGNMENT, 0);
                    prop_assert!(reserved >= size);
                    prop_assert!(off + reserved <= capacity);
                    for &(o, r, _) in &live {
                        prop_assert!(off + reserved <= o || o + r <= off, "overlap");
                    }
                    live.push((off, reserved, alloc));
                }
                let sum: u64 = live.iter().map(|l| l.1).sum();
                prop_assert_eq!(a.used(), sum);
            }
            for (_, reserved, alloc) in live.drain(..) {
                a.free(alloc, reserved);
            }
            prop_assert_eq!(a.used(), 0);
            prop_assert_eq!(a.live_allocations(), 0);
            // Coalesced back into one run.
            prop_assert!(a.allocate(capacity).is_ok());
        }
    }
}
