//! Free space inside one segment: a TLSF-style offset allocator (the `offset-allocator` crate:
//! O(1) alloc and free, bounded fragmentation, bookkeeping outside the managed memory) handing
//! out runs of 64-byte units, so every object is 64-byte aligned by construction. Sizes are
//! rounded up to the allocator's bins ([`reserved_units`]) so that a freed block serves the
//! next request of the same size exactly. Pure bookkeeping: no memory is touched here (what
//! becomes resident is [`super::residency`]'s).

use offset_allocator::{Allocation, Allocator};
use vovp_types::ALIGNMENT;

/// Most live allocations per segment (the allocator preallocates this many nodes, ~24 B each).
/// This is the store's object limit (PROTOCOL.md): past it a create fails with
/// `TooManyObjects` unless evicting an unreferenced object frees a slot.
const MAX_ALLOCS_PER_SEGMENT: u32 = vovp_types::MAX_OBJECTS as u32;

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
    pub(super) allocation: Allocation,
}

#[cfg(test)]
impl HostBlock {
    /// A block of `size` bytes at the start of a fresh allocator, labelled as `segment`
    /// (for tests of what holds blocks, not of the allocator).
    pub(crate) fn for_tests(segment: u32, size: u64) -> HostBlock {
        let mut a = SegmentAllocator::new(size.max(ALIGNMENT) * 2);
        let (offset, reserved, allocation) = a.allocate(size).expect("room");
        HostBlock {
            segment,
            offset,
            reserved,
            charged: size,
            allocation,
        }
    }
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
#[derive(Debug)]
pub struct SegmentAllocator {
    inner: Allocator,
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

    /// Gives back what [`Self::allocate`] reserved.
    pub fn free(&mut self, allocation: Allocation, reserved: u64) {
        self.inner.free(allocation);
        self.used -= reserved;
        self.live -= 1;
    }

    /// Bytes reserved now.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Allocations held now.
    pub fn live_allocations(&self) -> u64 {
        self.live
    }
}

/// Units reserved for `size` bytes: rounded up to the allocator's bin size (3 mantissa bits,
/// so at most 12.5 % over); `None` when that overflows (sizes near 2^64, which no segment can
/// hold anyway: callers treat it as "does not fit", never as a small number). The offset
/// allocator only searches bins at or above the rounded-up request, so a freed block of an
/// unrounded size could not be reused by a request of the very same size; rounding makes equal
/// sizes reuse each other's blocks exactly, which keeps eviction from freeing more objects
/// than the new one needs.
pub(crate) fn reserved_units(size: u64) -> Option<u64> {
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
