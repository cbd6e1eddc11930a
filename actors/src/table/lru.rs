//! The LRU: per device (host memory, or one GPU: each has its own capacity), the evictable
//! entries in order of last use, and their bytes. Eviction
//! ([`super::eviction`]) reads victims from here oldest first; which entries are in it is the
//! table's rule (sealed, named, unreferenced, not parked: see `ObjectTable::check_invariants`).
//!
//! Order: positions are monotonic nanoseconds ([`vovp_shm::now_stamp`]), kept unique per device,
//! so that the access stamps clients leave in their hold tables (a get without a message)
//! fold into the same order ([`Lru::touch`]): an object got that way since it entered moves to
//! where that get puts it.
//!
//! Invariants (checked by [`Lru::check`]): an entry is in at most one device's order, at the
//! position its [`LruPlace`] says; a device's byte count is the sum of its entries' reserved
//! bytes.

use std::collections::{BTreeMap, HashMap};

use vovp_types::Device;

/// An entry's position in its device's order while it is evictable (kept in the entry).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct LruPlace(Option<u64>);

impl LruPlace {
    pub(super) fn is_evictable(&self) -> bool {
        self.0.is_some()
    }
}

/// Per device, the evictable entries (position -> key) and their reserved bytes.
#[derive(Default)]
pub(super) struct Lru {
    order: HashMap<Device, BTreeMap<u64, usize>>,
    bytes: HashMap<Device, u64>,
    /// The last position given (positions only grow).
    tick: u64,
}

impl Lru {
    fn next_tick(&mut self) -> u64 {
        self.tick = (self.tick + 1).max(vovp_shm::now_stamp());
        self.tick
    }

    /// `key` becomes evictable in `device` as its most recently used entry.
    pub(super) fn enter(
        &mut self,
        key: usize,
        place: &mut LruPlace,
        device: Device,
        reserved: u64,
    ) {
        debug_assert!(place.0.is_none(), "entered the LRU twice");
        let tick = self.next_tick();
        place.0 = Some(tick);
        self.order.entry(device).or_default().insert(tick, key);
        *self.bytes.entry(device).or_insert(0) += reserved;
    }

    /// Takes the entry at `place` out of `device`'s order, if it is in it.
    pub(super) fn leave(&mut self, place: &mut LruPlace, device: Device, reserved: u64) {
        let Some(tick) = place.0.take() else {
            return;
        };
        if let Some(order) = self.order.get_mut(&device) {
            order.remove(&tick);
        }
        if let Some(b) = self.bytes.get_mut(&device) {
            *b -= reserved;
        }
    }

    /// A client got the entry at `stamp` (its hold table's access stamp, not trusted to lie
    /// in the future: the caller caps it at now): moves it there if that is later than its
    /// position.
    pub(super) fn touch(&mut self, key: usize, place: &mut LruPlace, device: Device, stamp: u64) {
        let Some(old) = place.0.filter(|&t| t < stamp) else {
            return;
        };
        let Some(order) = self.order.get_mut(&device) else {
            return;
        };
        let mut tick = stamp;
        while order.contains_key(&tick) {
            tick += 1;
        }
        order.remove(&old);
        order.insert(tick, key);
        self.tick = self.tick.max(tick);
        place.0 = Some(tick);
    }

    /// `device`'s evictable entries, least recently used first.
    pub(super) fn oldest_first(&self, device: Device) -> impl Iterator<Item = usize> + '_ {
        self.order
            .get(&device)
            .into_iter()
            .flat_map(|order| order.values().copied())
    }

    /// Entries that eviction could free in `device` now.
    pub(super) fn objects(&self, device: Device) -> usize {
        self.order.get(&device).map_or(0, BTreeMap::len)
    }

    /// Entries evictable on any device.
    pub(super) fn len(&self) -> usize {
        self.order.values().map(BTreeMap::len).sum()
    }

    /// Bytes that eviction could free in `device` now.
    pub(super) fn bytes(&self, device: Device) -> u64 {
        self.bytes.get(&device).copied().unwrap_or(0)
    }

    /// The invariants in the module doc; `place_of(key)` is where the entry says it is, with
    /// its device and reserved bytes.
    pub(super) fn check(
        &self,
        place_of: impl Fn(usize) -> Option<(LruPlace, Device, u64)>,
    ) -> Result<(), String> {
        for (device, order) in &self.order {
            let mut sum = 0;
            for (&tick, &key) in order {
                match place_of(key) {
                    Some((LruPlace(Some(t)), p, reserved)) if t == tick && p == *device => {
                        sum += reserved
                    }
                    _ => {
                        return Err(format!(
                            "{device:?}: LRU position {tick} of key {key} wrong"
                        ))
                    }
                }
            }
            if sum != self.bytes(*device) {
                return Err(format!(
                    "{device:?}: evictable bytes {} != {sum}",
                    self.bytes(*device)
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPU: Device = Device::Cuda(0);

    fn lru_of(sizes: &[u64]) -> (Lru, Vec<LruPlace>) {
        let mut lru = Lru::default();
        let mut places = vec![LruPlace::default(); sizes.len()];
        for (key, &size) in sizes.iter().enumerate() {
            lru.enter(key, &mut places[key], GPU, size);
        }
        (lru, places)
    }

    fn check(lru: &Lru, places: &[LruPlace], sizes: &[u64]) {
        lru.check(|k| places.get(k).map(|p| (*p, GPU, sizes[k])))
            .unwrap();
    }

    #[test]
    fn entries_leave_in_order_of_entry_and_pools_are_apart() {
        let sizes = [10, 20, 30];
        let (mut lru, mut places) = lru_of(&sizes);
        assert_eq!(lru.oldest_first(GPU).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!((lru.objects(GPU), lru.bytes(GPU)), (3, 60));
        assert_eq!((lru.objects(Device::Cpu), lru.bytes(Device::Cpu)), (0, 0));
        check(&lru, &places, &sizes);
        lru.leave(&mut places[1], GPU, 20);
        assert!(!places[1].is_evictable());
        // Leaving twice changes nothing.
        lru.leave(&mut places[1], GPU, 20);
        assert_eq!(lru.oldest_first(GPU).collect::<Vec<_>>(), [0, 2]);
        assert_eq!(lru.bytes(GPU), 40);
        // Back in: the most recent.
        lru.enter(1, &mut places[1], GPU, 20);
        assert_eq!(lru.oldest_first(GPU).collect::<Vec<_>>(), [0, 2, 1]);
        check(&lru, &places, &sizes);
    }

    #[test]
    fn a_later_access_stamp_moves_an_entry_an_earlier_one_does_not() {
        let sizes = [1, 1, 1];
        let (mut lru, mut places) = lru_of(&sizes);
        let now = vovp_shm::now_stamp() + 1_000_000;
        lru.touch(0, &mut places[0], GPU, now);
        assert_eq!(lru.oldest_first(GPU).collect::<Vec<_>>(), [1, 2, 0]);
        // Two clients with the same stamp: positions stay unique.
        lru.touch(1, &mut places[1], GPU, now);
        assert_eq!(lru.oldest_first(GPU).collect::<Vec<_>>(), [2, 0, 1]);
        // An older stamp (a get before it entered) leaves it where it is.
        lru.touch(2, &mut places[2], GPU, 1);
        assert_eq!(lru.oldest_first(GPU).collect::<Vec<_>>(), [2, 0, 1]);
        // New entries still come after every folded stamp.
        places.push(LruPlace::default());
        lru.enter(3, &mut places[3], GPU, 1);
        assert_eq!(lru.oldest_first(GPU).last(), Some(3));
        check(&lru, &places, &[1, 1, 1, 1]);
    }

    #[test]
    fn the_check_catches_a_wrong_byte_count_or_position() {
        let sizes = [5, 7];
        let (lru, places) = lru_of(&sizes);
        assert!(lru.check(|k| Some((places[k], GPU, 1))).is_err());
        assert!(lru
            .check(|k| Some((LruPlace::default(), GPU, sizes[k])))
            .is_err());
    }
}
