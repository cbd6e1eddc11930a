//! The allocator actor: owns the host segments' free space.
//!
//! Inside each segment a TLSF-style offset allocator (the `offset-allocator` crate: O(1) alloc
//! and free, bounded fragmentation, bookkeeping outside the managed memory) hands out runs of
//! 64-byte units, so every object is 64-byte aligned by construction.

use std::sync::Arc;

use kameo::message::{Context, Message};
use kameo::Actor;
use offset_allocator::{Allocation, Allocator};

use crate::segment::Segment;
use crate::types::ALIGNMENT;

/// Most live allocations per segment (the allocator preallocates this many nodes, ~24 B each).
const MAX_ALLOCS_PER_SEGMENT: u32 = 1 << 20;

/// A run of host memory handed to one object.
#[derive(Clone, Copy)]
pub struct HostBlock {
    pub segment: u32,
    pub offset: u64,
    /// Bytes reserved (the object's size rounded up to [`ALIGNMENT`], at least one unit).
    pub reserved: u64,
    allocation: Allocation,
}

impl std::fmt::Debug for HostBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBlock")
            .field("segment", &self.segment)
            .field("offset", &self.offset)
            .field("reserved", &self.reserved)
            .finish()
    }
}

/// Free-space bookkeeping for one segment, in [`ALIGNMENT`]-byte units.
pub struct SegmentAllocator {
    inner: Allocator,
    capacity: u64,
    used: u64,
    live: u64,
}

impl SegmentAllocator {
    /// Manages `capacity` bytes (rounded down to whole units; at most 2^32 units = 256 GiB).
    pub fn new(capacity: u64) -> Self {
        let units = (capacity / ALIGNMENT).min(u32::MAX as u64 - 1) as u32;
        let max_allocs = units.clamp(1, MAX_ALLOCS_PER_SEGMENT);
        SegmentAllocator {
            inner: Allocator::with_max_allocs(units, max_allocs),
            capacity: units as u64 * ALIGNMENT,
            used: 0,
            live: 0,
        }
    }

    /// Reserves room for `size` bytes; `None` when no free run is large enough.
    pub fn allocate(&mut self, size: u64) -> Option<(u64, u64, Allocation)> {
        let units = u32::try_from(reserved_units(size)).ok()?;
        let allocation = self.inner.allocate(units)?;
        let reserved = units as u64 * ALIGNMENT;
        self.used += reserved;
        self.live += 1;
        Some((allocation.offset as u64 * ALIGNMENT, reserved, allocation))
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
/// so at most 12.5 % over). The offset allocator only searches bins at or above the rounded-up
/// request, so a freed block of an unrounded size could not be reused by a request of the very
/// same size; rounding makes equal sizes reuse each other's blocks exactly, which keeps eviction
/// from freeing more objects than the new one needs.
pub fn reserved_units(size: u64) -> u64 {
    let units = size.div_ceil(ALIGNMENT).max(1);
    if units < 8 {
        return units;
    }
    let step = 1u64 << (63 - units.leading_zeros() - 3);
    units.div_ceil(step) * step
}

/// Bytes reserved for an object of `size` bytes.
pub fn reserved_bytes(size: u64) -> u64 {
    reserved_units(size) * ALIGNMENT
}

/// Usage of host memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, kameo::Reply)]
pub struct HostUsage {
    pub capacity: u64,
    pub used: u64,
    pub live_allocations: u64,
}

/// The allocator actor.
#[derive(Actor)]
pub struct AllocatorActor {
    segments: Arc<[Arc<Segment>]>,
    allocators: Vec<SegmentAllocator>,
}

impl AllocatorActor {
    pub fn new(segments: Arc<[Arc<Segment>]>) -> Self {
        let allocators = segments
            .iter()
            .map(|s| SegmentAllocator::new(s.len()))
            .collect();
        AllocatorActor {
            segments,
            allocators,
        }
    }

    fn usage(&self) -> HostUsage {
        let mut u = HostUsage::default();
        for a in &self.allocators {
            u.capacity += a.capacity();
            u.used += a.used();
            u.live_allocations += a.live_allocations();
        }
        u
    }
}

/// Reserve `size` bytes in any segment. Replies `None` when nothing fits (the table actor then
/// evicts and retries).
pub struct Allocate {
    pub size: u64,
}

impl Message<Allocate> for AllocatorActor {
    type Reply = Option<HostBlock>;

    async fn handle(&mut self, msg: Allocate, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        for (seg, alloc) in self.segments.iter().zip(self.allocators.iter_mut()) {
            if let Some((offset, reserved, allocation)) = alloc.allocate(msg.size) {
                return Some(HostBlock {
                    segment: seg.id(),
                    offset,
                    reserved,
                    allocation,
                });
            }
        }
        None
    }
}

/// Return blocks to their segments.
pub struct Free(pub Vec<HostBlock>);

impl Message<Free> for AllocatorActor {
    type Reply = ();

    async fn handle(&mut self, msg: Free, _: &mut Context<Self, Self::Reply>) {
        for block in msg.0 {
            if let Some(alloc) = self.allocators.get_mut(block.segment as usize) {
                alloc.free(block.allocation, block.reserved);
            }
        }
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
        assert_eq!(reserved_bytes(0), 64);
        assert_eq!(reserved_bytes(65), 128);
        assert_eq!(reserved_units(9 * 64), 9);
        assert_eq!(reserved_units(17 * 64), 18);
        assert_eq!(reserved_bytes((1 << 18) - 64), 1 << 18);
        for size in [1u64, 1000, 123_456_789, 1 << 30] {
            let r = reserved_bytes(size);
            assert!(r >= size && r <= size + size / 8 + 64, "{size} -> {r}");
        }
    }

    #[test]
    fn a_freed_block_serves_the_next_request_of_the_same_size() {
        let mut a = SegmentAllocator::new(1 << 20);
        let size = (1 << 18) - 64;
        let blocks: Vec<_> = (0..4).map(|_| a.allocate(size).unwrap()).collect();
        assert!(a.allocate(size).is_none());
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
        assert!(a.allocate(1).is_none());
        a.free(big, 1 << 20);
        assert_eq!(a.used(), 0);
        assert!(a.allocate(1 << 20).is_some());
    }

    proptest! {
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
                } else if let Some((off, reserved, alloc)) = a.allocate(size) {
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
            prop_assert!(a.allocate(capacity).is_some());
        }
    }
}
