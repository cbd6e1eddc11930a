//! Disjoint, coalesced byte ranges: how [`super::residency`] keeps a segment's backed pages
//! and its freed ranges, with exact byte counts (a byte is never counted twice).

use std::collections::BTreeMap;

/// Disjoint, coalesced byte ranges (start -> end).
#[derive(Debug, Default)]
pub(super) struct RangeSet {
    map: BTreeMap<u64, u64>,
    bytes: u64,
}

impl RangeSet {
    /// Adds `start..end` (merging with what it touches).
    pub(super) fn insert(&mut self, mut start: u64, mut end: u64) {
        if end <= start {
            return;
        }
        self.remove(start, end); // never count a byte twice
        if let Some((&s, &e)) = self.map.range(..start).next_back() {
            if e == start {
                self.map.remove(&s);
                self.bytes -= e - s;
                start = s;
            }
        }
        if let Some(e) = self.map.remove(&end) {
            self.bytes -= e - end;
            end = e;
        }
        self.map.insert(start, end);
        self.bytes += end - start;
    }

    /// Removes `start..end`; returns the pieces that were in the set.
    pub(super) fn remove(&mut self, start: u64, end: u64) -> Vec<(u64, u64)> {
        let overlapping: Vec<(u64, u64)> = self
            .map
            .range(..end)
            .rev()
            .take_while(|(_, &e)| e > start)
            .map(|(&s, &e)| (s, e))
            .collect();
        let mut taken = Vec::with_capacity(overlapping.len());
        for (s, e) in overlapping.into_iter().rev() {
            self.map.remove(&s);
            self.bytes -= e - s;
            taken.push((s.max(start), e.min(end)));
            if s < start {
                self.map.insert(s, start);
                self.bytes += start - s;
            }
            if e > end {
                self.map.insert(end, e);
                self.bytes += e - end;
            }
        }
        taken
    }

    /// The parts of `start..end` that are not in the set.
    pub(super) fn gaps(&self, start: u64, end: u64) -> Vec<(u64, u64)> {
        let mut gaps = Vec::new();
        let mut at = start;
        // The range that starts before `start` may reach into it.
        if let Some((_, &e)) = self.map.range(..start).next_back() {
            at = at.max(e);
        }
        for (&s, &e) in self.map.range(start..end) {
            if s > at {
                gaps.push((at, s));
            }
            at = at.max(e);
        }
        if at < end {
            gaps.push((at, end));
        }
        gaps
    }

    pub(super) fn clear(&mut self) {
        self.map.clear();
        self.bytes = 0;
    }

    /// Bytes in the set.
    pub(super) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The ranges, in order.
    pub(super) fn ranges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.map.iter().map(|(&s, &e)| (s, e))
    }

    /// The range that starts last before `end`, if any (what an audit reports).
    pub(super) fn last_before(&self, end: u64) -> Option<(u64, u64)> {
        self.map.range(..end).next_back().map(|(&s, &e)| (s, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The range sets never double count, never overlap, and report exactly the gaps.
        #[test]
        fn range_sets_match_a_model(ops in proptest::collection::vec((0u64..64, 1u64..16, 0u8..3), 1..200)) {
            let mut set = RangeSet::default();
            let mut model = [false; 80];
            for (start, len, op) in ops {
                let end = start + len;
                let span = start as usize..end as usize;
                match op {
                    0 => {
                        set.insert(start, end);
                        model[span].iter_mut().for_each(|b| *b = true);
                    }
                    1 => {
                        let was = model[span.clone()].iter().filter(|b| **b).count() as u64;
                        let taken: u64 = set.remove(start, end).iter().map(|(a, b)| b - a).sum();
                        prop_assert_eq!(taken, was);
                        model[span].iter_mut().for_each(|b| *b = false);
                    }
                    _ => {
                        let mut gap = [false; 80];
                        for (a, b) in set.gaps(start, end) {
                            prop_assert!(a >= start && b <= end && a < b);
                            gap[a as usize..b as usize].iter_mut().for_each(|g| *g = true);
                        }
                        for i in span {
                            prop_assert_eq!(gap[i], !model[i], "byte {}", i);
                        }
                    }
                }
                let counted = model.iter().filter(|b| **b).count() as u64;
                prop_assert_eq!(set.bytes, counted);
                let mut last = 0;
                for (&s, &e) in &set.map {
                    // Disjoint and coalesced: a range never starts where the last one ended.
                    prop_assert!(s > last || (s == 0 && last == 0));
                    prop_assert!(e > s);
                    last = e;
                }
            }
        }
    }
}
