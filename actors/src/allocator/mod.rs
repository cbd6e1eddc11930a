//! The allocator actor: owns the host segments' free space. Segment 0 is the store's own
//! (embedded creates, inline puts, CUDA objects' metadata); every client that creates objects
//! gets arenas of its own, which only it can write. Everything is under one budget of
//! `capacity` bytes: of objects (what eviction frees) and of resident pages.
//!
//! - this module: segments and arenas (which segment an object goes to, when an arena goes),
//!   the object budget, and the actor's messages;
//! - [`segment_allocator`]: free space inside one segment (offset allocation, 64-byte units);
//! - [`residency`]: the pages the kernel holds for the segments, backed at create and given
//!   back when freed, within `capacity` + [`RESIDENT_SLACK_PAGES`] pages;
//! - [`range_set`]: the byte ranges residency keeps.

mod range_set;
mod residency;
mod segment_allocator;

use std::collections::BTreeMap;
use std::sync::Arc;

use kameo::message::{Context, Message};
use kameo::Actor;

use crate::segment::Segment;
use residency::{Residency, SegmentPages};
use vovp_types::{HolderId, ALIGNMENT};

pub use residency::RESIDENT_SLACK_PAGES;
pub use segment_allocator::{reserved_bytes, SegmentAllocator};
pub(crate) use segment_allocator::{AllocFailure, HostBlock};

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
    /// Bytes more the store could back now: what the machine (and its memory cgroups) has
    /// available less [`crate::memory_room::BACKING_MARGIN`], plus the store's own freed pages
    /// (`u64::MAX` when creates are not backed, or the machine's room cannot be read).
    pub backable: u64,
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

/// One segment and what the allocator knows of it.
struct SegmentState {
    segment: Arc<Segment>,
    alloc: SegmentAllocator,
    /// The client that writes this segment (`None`: segment 0, the store's own).
    owner: Option<HolderId>,
    /// The owner has disconnected: nothing new goes here; the segment goes with its last object.
    orphaned: bool,
    /// Its pages as the budget counts them.
    pages: SegmentPages,
}

impl SegmentState {
    fn new(segment: Arc<Segment>, alloc: SegmentAllocator, owner: Option<HolderId>) -> Self {
        SegmentState {
            pages: SegmentPages::new(&segment),
            segment,
            alloc,
            owner,
            orphaned: false,
        }
    }
}

/// The allocator actor: segment 0 (the store's own, `capacity` bytes) plus one or more arenas
/// per client that creates objects, all under one budget of `capacity` bytes — of objects
/// (eviction's measure) and of resident pages (freed pages are given back before the budget is
/// passed; see [`RESIDENT_SLACK_PAGES`]). Every new page an object needs is backed at create
/// (see `AllocatorActor::with_backing`).
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
    /// The pages' budget, backing and audit ([`residency`]).
    residency: Residency,
}

impl std::fmt::Debug for AllocatorActor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The actor's state is large and changes under the caller; its name is what a log needs.
        f.debug_struct("AllocatorActor").finish_non_exhaustive()
    }
}

impl AllocatorActor {
    /// Manages `capacity` bytes of objects: `segment0` (the store's own segment, at least
    /// `reserved_bytes(capacity)` long, so an object as large as the store fits) and, with
    /// `arenas`, arenas of each client's own.
    pub fn new(segment0: Arc<Segment>, capacity: u64, max_objects: u32, arenas: bool) -> Self {
        let huge_pages = segment0.uses_huge_pages();
        let residency = Residency::new(segment0.page_size());
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
            residency,
        }
    }

    fn usage(&mut self) -> HostUsage {
        let resident = self.resident();
        let backable = self
            .residency
            .backable(resident, self.used, self.huge_pages);
        HostUsage {
            capacity: self.capacity,
            used: self.used,
            live_allocations: self.live,
            resident,
            segments: self.segments.len() as u64,
            backable,
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
        let end = offset + charged;
        let seg = self.segments.get_mut(&id).expect("placed");
        let gaps = seg.pages.occupy(offset, end);
        if let Err(f) = self.back(id, &gaps) {
            let seg = self.segments.get_mut(&id).expect("placed");
            seg.pages.vacate(offset, end);
            seg.alloc.free(allocation, reserved);
            self.drop_if_done(id);
            return Err(f);
        }
        self.used += charged;
        self.live += 1;
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

    fn free(&mut self, block: HostBlock) {
        let Some(seg) = self.segments.get_mut(&block.segment) else {
            return;
        };
        seg.alloc.free(block.allocation, block.reserved);
        self.used -= block.charged;
        self.live -= 1;
        seg.pages.vacate(block.offset, block.offset + block.charged);
        if seg.orphaned {
            // Nobody will reuse these pages: give them back now.
            seg.punch_freed();
        }
        self.drop_if_done(block.segment);
        // Past the capacity (partly used pages of live objects), freed pages are not kept.
        let over = self.resident().saturating_sub(self.capacity);
        if over > 0 {
            self.give_back(over, block.segment);
        }
    }

    /// Drops a client segment with no object left once it cannot be reused: its owner is gone,
    /// or it is an arena of one big object's size whose pages were given back. An emptied big
    /// arena stays while its pages are warm, because the likeliest next create of its owner is
    /// another object of that size (a training loop's batches): put into the warm arena, a
    /// 1 GiB put runs at memcpy speed instead of taking 262 144 fresh page faults (5× slower).
    fn drop_if_done(&mut self, id: u32) {
        let standard = self.arena_size.next_multiple_of(2 << 20);
        let Some(seg) = self.segments.get(&id) else {
            return;
        };
        if id == 0 || seg.alloc.live_allocations() > 0 {
            return;
        }
        if seg.orphaned || (seg.segment.len() > standard && seg.pages.resident() == 0) {
            if let Some(seg) = self.segments.remove(&id) {
                // Clients that still map it (holding no object in it) keep only address space.
                seg.segment.punch(0, seg.segment.len());
                self.residency.dropped(&seg.segment);
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
                seg.punch_freed();
            }
            self.drop_if_done(id);
        }
    }
}

/// Reserve `size` bytes for an object `writer` will fill. Replies why when nothing fits (the
/// table actor then evicts and retries).
#[derive(Debug)]
pub struct Allocate {
    pub size: u64,
    pub writer: Writer,
}

impl Message<Allocate> for AllocatorActor {
    type Reply = Result<HostBlock, AllocFailure>;

    async fn handle(&mut self, msg: Allocate, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let r = self.allocate(msg.size, msg.writer);
        self.audit("allocate");
        r
    }
}

/// Return blocks to their segments.
#[derive(Debug)]
pub struct Free(pub Vec<HostBlock>);

impl Message<Free> for AllocatorActor {
    type Reply = ();

    async fn handle(&mut self, msg: Free, _: &mut Context<Self, Self::Reply>) {
        for block in msg.0 {
            self.free(block);
        }
        self.audit("free");
    }
}

/// A client went away: its arenas take nothing new and go with their last object.
#[derive(Debug)]
pub struct OwnerGone(pub HolderId);

impl Message<OwnerGone> for AllocatorActor {
    type Reply = ();

    async fn handle(&mut self, msg: OwnerGone, _: &mut Context<Self, Self::Reply>) {
        self.owner_gone(msg.0);
        self.audit("owner_gone");
    }
}

/// A segment for a client to map: its read-write fd for the client that writes it, the
/// read-only fd for everyone else. `None` for a segment that does not exist (any more).
#[derive(Debug)]
pub struct SegmentFor {
    pub id: u32,
    pub holder: HolderId,
}

/// What [`SegmentFor`] answers: the segment and whether the asker may write it.
#[derive(Debug, kameo::Reply)]
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
#[derive(Debug)]
pub struct SegmentById(pub u32);

impl Message<SegmentById> for AllocatorActor {
    type Reply = Option<Arc<Segment>>;

    async fn handle(&mut self, m: SegmentById, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.segments.get(&m.0).map(|s| s.segment.clone())
    }
}

/// Current host usage.
#[derive(Debug)]
pub struct Usage;

impl Message<Usage> for AllocatorActor {
    type Reply = HostUsage;

    async fn handle(&mut self, _: Usage, _: &mut Context<Self, Self::Reply>) -> HostUsage {
        self.usage()
    }
}

#[cfg(test)]
pub(super) fn actor_for_tests(capacity: u64) -> AllocatorActor {
    let seg = Arc::new(Segment::create(0, capacity, false, false).unwrap());
    AllocatorActor::new(seg, capacity, 1 << 20, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn actor(capacity: u64) -> AllocatorActor {
        actor_for_tests(capacity)
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
        // A big object gets an arena of its own size, kept warm when it empties so that the
        // next object of that size reuses it, and dropped once its pages are given back.
        let big = a
            .allocate(40 << 20, Writer::Client(HolderId::from_raw(1)))
            .unwrap();
        assert!(big.segment != c1.segment);
        let segments = a.usage().segments;
        a.free(big);
        assert_eq!(
            a.usage().segments,
            segments,
            "an emptied big arena stays while warm"
        );
        let warm = a.usage().resident;
        let again = a
            .allocate(40 << 20, Writer::Client(HolderId::from_raw(1)))
            .unwrap();
        assert_eq!(again.segment, big.segment, "the next big object reuses it");
        assert_eq!(a.usage().resident, warm, "into pages already backed");
        a.free(again);
        assert!(a.give_back(u64::MAX, 0) >= 40 << 20);
        assert_eq!(
            a.usage().segments,
            segments - 1,
            "given back, it is dropped"
        );
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
}
