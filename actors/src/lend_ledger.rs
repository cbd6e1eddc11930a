//! The lend ledger: the store's record of the lends, parts of a client's own arena lent to it
//! so that a put costs no CREATE round trip (the client's side is vovp-client's `lent`).
//! The client writes each object at an offset of its lend (data padded to 64 bytes, then room
//! for the metadata) and PUBLISHes it: one message creates and seals it. Plain data structure
//! (the table actor owns one), unit-testable without a runtime.
//!
//! Memory: a lend is one allocator block, charged whole to the budget while it lives. Objects
//! published from it do not own memory of their own: freeing one gives the lend back one
//! object, and the lend's block goes back to the allocator when the lend is retired (its holder
//! took a new one or went away, or the store took it back) and its last object is gone — a slab's trade-off, bounded by
//! the lend's size ([`vovp_types::lends::lend_size`]; PROTOCOL.md, "Limits").
//!
//! Trust: the client says where it wrote; the store checks that the range lies inside a lend
//! of that client and overlaps no live object published from it, so a client can only name
//! memory it may write anyway (its own arena) and never two objects in one place.

use std::collections::{BTreeMap, HashMap};

use crate::allocator::HostBlock;
use crate::block::LentBlock;
use vovp_types::lends::{block_len, max_object};
use vovp_types::Error;
use vovp_types::ALIGNMENT;
use vovp_types::{Counted, HolderId, Lend};

fn lend_of(id: u64, block: &HostBlock) -> Lend {
    Lend {
        id,
        segment: block.segment,
        offset: block.offset,
        size: block.charged,
        max_object: max_object(block.charged),
    }
}

struct LendState {
    holder: HolderId,
    block: HostBlock,
    /// Live objects published from it: start → end (absolute offsets in the segment).
    objects: BTreeMap<u64, u64>,
    /// Live objects, including empty ones (which take no range).
    live: u32,
    /// Takes no new object (its holder took a new lend or went away, or the store took it
    /// back); freed with its last one.
    retired: bool,
}

/// Which of a holder's two current lends: the big one ([`vovp_types::lends::lend_size`]; taken back when the
/// store is short of memory) or the small one (LEND_SMALL; small objects published without
/// waiting for the reply, never taken back).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum LendKind {
    Big,
    Small,
}

/// Every lend of the store, and each holder's current ones.
#[derive(Default)]
pub(crate) struct LendLedger {
    by_id: HashMap<u64, LendState>,
    current: HashMap<(HolderId, LendKind), u64>,
    next_id: u64,
    /// Lends handed out, ever (new ones and current ones handed again), with their sizes:
    /// for the metrics.
    made: Counted,
}

impl LendLedger {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Retires `holder`'s current lend of `kind` (it is about to take another, or is gone);
    /// its block when nothing published from it is alive.
    pub(crate) fn retire(&mut self, holder: HolderId, kind: LendKind) -> Option<HostBlock> {
        let id = self.current.remove(&(holder, kind))?;
        let state = self.by_id.get_mut(&id)?;
        state.retired = true;
        self.free_if_done(id)
    }

    /// Every holder's current big lend that holds no live object: (holder, lend id). (Small
    /// lends are never taken back: the hold table's one revocation word is the big lend's.)
    pub(crate) fn current_empty(&self) -> Vec<(HolderId, u64)> {
        self.current
            .iter()
            .filter(|((_, kind), id)| {
                *kind == LendKind::Big && self.by_id.get(id).is_some_and(|s| s.live == 0)
            })
            .map(|((h, _), id)| (*h, *id))
            .collect()
    }

    /// `holder`'s current lend again, from its start, when nothing published from it is alive
    /// any more: its pages are warm in the client (a put/delete cycle then writes the same
    /// memory over and over, as CREATE's exact-fit reuse does, instead of fresh pages).
    pub(crate) fn reuse_empty(&mut self, holder: HolderId, kind: LendKind) -> Option<Lend> {
        let id = *self.current.get(&(holder, kind))?;
        let state = self.by_id.get(&id).filter(|s| s.live == 0)?;
        self.made.add(state.block.charged);
        Some(lend_of(id, &state.block))
    }

    /// Records `block` as `holder`'s new current lend of `kind` (retire the old one first).
    pub(crate) fn insert(&mut self, holder: HolderId, kind: LendKind, block: HostBlock) -> Lend {
        self.next_id += 1;
        let id = self.next_id;
        self.by_id.insert(
            id,
            LendState {
                holder,
                block,
                objects: BTreeMap::new(),
                live: 0,
                retired: false,
            },
        );
        self.current.insert((holder, kind), id);
        self.made.add(block.charged);
        lend_of(id, &block)
    }

    /// Checks and records an object of `size` data bytes and `metadata_len` metadata bytes that
    /// `holder` wrote at `offset` of lend `lend`. A retired lend still takes objects written
    /// before it was retired (another thread of the client may publish late).
    pub(crate) fn claim(
        &mut self,
        holder: HolderId,
        lend: u64,
        offset: u64,
        size: u64,
        metadata_len: u64,
    ) -> Result<LentBlock, Error> {
        let state = self
            .by_id
            .get_mut(&lend)
            .filter(|s| s.holder == holder)
            .ok_or_else(|| Error::NotFound(format!("lend {lend} (not this client's, or gone)")))?;
        let len = block_len(size, metadata_len)
            .ok_or_else(|| Error::Protocol(format!("PUBLISH of {size} bytes overflows")))?;
        let start = state.block.offset;
        let end = start + state.block.charged;
        let inside = offset.is_multiple_of(ALIGNMENT)
            && offset >= start
            && offset.checked_add(len).is_some_and(|e| e <= end);
        if !inside {
            return Err(Error::Protocol(format!(
                "PUBLISH at offset {offset} ({len} bytes) is not a 64-byte aligned range of lend \
                 {lend} ({start}..{end})"
            )));
        }
        if len > 0 {
            let before = state.objects.range(..offset + len).next_back();
            if before.is_some_and(|(_, &e)| e > offset) {
                return Err(Error::Protocol(format!(
                    "PUBLISH at offset {offset} overlaps an object already published from lend \
                     {lend}"
                )));
            }
            state.objects.insert(offset, offset + len);
        }
        state.live += 1;
        Ok(LentBlock {
            lend,
            segment: state.block.segment,
            offset,
            charged: len,
        })
    }

    /// An object published from a lend is gone (or never made it into the table): the lend's
    /// block, when it was the last object of a retired lend.
    pub(crate) fn freed(&mut self, b: &LentBlock) -> Option<HostBlock> {
        let state = self.by_id.get_mut(&b.lend)?;
        if b.charged > 0 {
            state.objects.remove(&b.offset);
        }
        state.live = state.live.saturating_sub(1);
        self.free_if_done(b.lend)
    }

    fn free_if_done(&mut self, id: u64) -> Option<HostBlock> {
        let state = self.by_id.get(&id)?;
        if state.retired && state.live == 0 {
            return self.by_id.remove(&id).map(|s| s.block);
        }
        None
    }

    /// Lends handed out, ever, with their sizes (see `made`).
    pub(crate) fn made(&self) -> Counted {
        self.made
    }

    /// Lends alive (current or waiting for their last object).
    pub(crate) fn len(&self) -> usize {
        self.by_id.len()
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(n: u64) -> HolderId {
        HolderId::from_raw(n)
    }

    #[test]
    fn only_the_holder_publishes_only_free_aligned_ranges_inside_its_lend() {
        let mut lends = LendLedger::new();
        let lend = lends.insert(h(1), LendKind::Big, HostBlock::for_tests(3, 4096));
        let start = lend.offset;
        assert!(matches!(
            lends.claim(h(2), lend.id, start, 10, 0),
            Err(Error::NotFound(_))
        ));
        assert!(lends.claim(h(1), lend.id + 1, start, 10, 0).is_err());
        for (offset, size) in [(start + 1, 10), (start + 4096 - 64, 65), (u64::MAX - 63, 1)] {
            assert!(
                matches!(
                    lends.claim(h(1), lend.id, offset, size, 0),
                    Err(Error::Protocol(_))
                ),
                "{offset} {size}"
            );
        }
        let a = lends.claim(h(1), lend.id, start + 128, 100, 20).unwrap();
        assert_eq!((a.segment, a.offset, a.charged), (3, start + 128, 192));
        // Overlaps on either side, or inside.
        for (offset, size) in [(start + 64, 65), (start + 128, 1), (start + 256, 64)] {
            assert!(
                lends.claim(h(1), lend.id, offset, size, 0).is_err(),
                "{offset}"
            );
        }
        // Touching is not overlapping.
        lends.claim(h(1), lend.id, start + 64, 64, 0).unwrap();
        let b = lends.claim(h(1), lend.id, start + 320, 64, 0).unwrap();
        let empty = lends.claim(h(1), lend.id, start + 320, 0, 0).unwrap();
        // A freed object's range may be published again.
        assert!(lends.freed(&a).is_none(), "the current lend stays");
        lends.claim(h(1), lend.id, start + 128, 192, 0).unwrap();
        let _ = (b, empty);
    }

    #[test]
    fn a_retired_lend_goes_with_its_last_object_and_takes_late_publishes_until_then() {
        let mut lends = LendLedger::new();
        let first = lends.insert(h(1), LendKind::Big, HostBlock::for_tests(1, 4096));
        let a = lends.claim(h(1), first.id, first.offset, 64, 0).unwrap();
        assert!(
            lends.retire(h(1), LendKind::Big).is_none(),
            "an object still lives in it"
        );
        let second = lends.insert(h(1), LendKind::Big, HostBlock::for_tests(2, 4096));
        // A put that reserved its range before the new lend still publishes into the old one.
        let late = lends
            .claim(h(1), first.id, first.offset + 64, 64, 0)
            .unwrap();
        assert_eq!(lends.len(), 2);
        assert!(lends.freed(&a).is_none());
        let block = lends.freed(&late).expect("the retired lend's last object");
        assert_eq!(block.segment, 1);
        assert!(lends.claim(h(1), first.id, first.offset, 64, 0).is_err());
        // An empty current lend is handed out again (warm pages), from its start.
        assert_eq!(lends.reuse_empty(h(1), LendKind::Big), Some(second));
        let c = lends.claim(h(1), second.id, second.offset, 64, 0).unwrap();
        assert_eq!(
            lends.reuse_empty(h(1), LendKind::Big),
            None,
            "an object lives in it"
        );
        assert!(lends.freed(&c).is_none());
        // The holder going away retires its current lend: empty, so it goes at once.
        assert_eq!(
            lends.retire(h(1), LendKind::Big).map(|b| b.segment),
            Some(2)
        );
        assert!(lends.is_empty());
        let _ = second;
    }

    #[test]
    fn a_holder_has_a_big_and_a_small_lend_and_only_the_big_one_is_taken_back() {
        let mut lends = LendLedger::new();
        let big = lends.insert(h(1), LendKind::Big, HostBlock::for_tests(1, 1 << 20));
        let small = lends.insert(h(1), LendKind::Small, HostBlock::for_tests(1, 64 << 10));
        assert_ne!(big.id, small.id);
        // Both take objects; retiring one kind leaves the other current.
        let s = lends.claim(h(1), small.id, small.offset, 64, 64).unwrap();
        assert_eq!(
            lends.current_empty(),
            vec![(h(1), big.id)],
            "small lends: never"
        );
        assert_eq!(lends.reuse_empty(h(1), LendKind::Small), None);
        assert!(
            lends.retire(h(1), LendKind::Small).is_none(),
            "an object lives in it"
        );
        assert_eq!(lends.reuse_empty(h(1), LendKind::Big), Some(big));
        // The retired small lend goes with its last object, the big one stays current.
        assert!(lends.freed(&s).is_some());
        assert_eq!(lends.len(), 1);
        assert!(lends.retire(h(1), LendKind::Big).is_some());
        assert!(lends.is_empty());
    }
}
