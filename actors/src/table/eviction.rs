//! Eviction: when a device is full, which unreferenced sealed objects go ([`ObjectTable::victims`],
//! from the LRU, oldest first) and what becomes of each one picked
//! ([`ObjectTable::evict_victim`]: freed now, or parked while a hold table names it). Those
//! two functions are the one place for each decision. With spilling on, the spill policy
//! decides each victim's fate ([`SpillChoice`]): written to disk ([`Victim::Spilling`], see
//! [`super::residency`]), dropped from memory at once because its file is still whole on disk
//! from an earlier spill ([`Victim::OnDisk`]), or evicted as before.
//!
//! Race with clients: a client takes a hold through its hold table with no message, so a
//! candidate may become held between the first look and its unpublish. Candidates are
//! therefore unpublished first and checked again after; those held now are parked instead of
//! evicted and the next candidates tried, so every round either evicts, parks or stops.

use std::collections::HashSet;

use vovp_types::{Device, NotificationKind, ObjectId};

use super::publication::Publication;
use super::residency::Spilling;
use super::{Freed, ObjectTable};
use crate::block::Block;

/// What became of an eviction victim.
enum Victim {
    /// Gone: its memory goes back to its allocator.
    Freed(Freed),
    /// A hold table named it after all: parked (out of the LRU) until none does, under this
    /// generation.
    Parked { generation: u64 },
    /// Its bytes go to disk; its memory goes back when the write lands.
    Spilling(Spilling),
    /// Its file from an earlier spill is whole: on disk only now, its memory goes back now.
    OnDisk(Block),
}

/// What a round of making room did: memory freed now (objects gone, and objects on disk only
/// now whose blocks are `released`), and victims being spilled (whose memory comes back when
/// their files are written).
#[derive(Debug, Default)]
pub(crate) struct Room {
    pub freed: Vec<Freed>,
    pub released: Vec<Block>,
    pub spilling: Vec<Spilling>,
}

/// What becomes of a victim that could be spilled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SpillChoice {
    /// Write its file (the bound admits it).
    Write,
    /// Its file is on disk already (written before, the object unchanged since: sealed).
    OnDisk,
    /// Evict it (the bound is reached).
    Evict,
}

/// Asked of each victim that could be spilled (id, name, data size, bytes its block frees).
pub(crate) type SpillPolicy<'a> = &'a mut dyn FnMut(SpillCandidate<'_>) -> SpillChoice;

/// A victim that could be spilled.
#[derive(Debug)]
pub(crate) struct SpillCandidate<'a> {
    pub id: ObjectId,
    pub name: &'a str,
    pub size: u64,
    pub frees: u64,
}

impl ObjectTable {
    /// Objects that eviction could free in `device` now.
    pub(crate) fn evictable_objects(&self, device: Device) -> usize {
        self.lru.objects(device)
    }

    /// Bytes that eviction could free in `device` now.
    pub(crate) fn evictable_bytes(&self, device: Device) -> u64 {
        self.lru.bytes(device)
    }

    /// Evicts least-recently-used unreferenced sealed objects of `device` until at least `bytes`
    /// are freed or none is left (see the module doc for objects clients hold meanwhile).
    pub(crate) fn evict(&mut self, device: Device, bytes: u64) -> Vec<Freed> {
        self.evict_with(device, bytes, None).freed
    }

    /// [`Self::evict`], spilling the victims `spill` admits (host objects only) instead of
    /// dropping them (the ones it refuses are evicted); their bytes count towards `bytes` too.
    pub(crate) fn evict_with(
        &mut self,
        device: Device,
        bytes: u64,
        mut spill: Option<SpillPolicy<'_>>,
    ) -> Room {
        self.fold_access_stamps();
        let mut held = self.publication.held_generations();
        let mut room = Room::default();
        let mut total = 0;
        while total < bytes {
            let candidates = self.victims(device, bytes - total, &held);
            if candidates.is_empty() {
                break;
            }
            for &key in &candidates {
                self.publication.unpublish(&mut self.objects[key].listing);
            }
            let held_now = self.publication.held_generations();
            for key in candidates {
                match self.evict_victim(key, &held_now, spill.as_mut()) {
                    Victim::Freed(f) => {
                        total += f.block.reserved();
                        room.freed.push(f);
                    }
                    Victim::Parked { generation } => {
                        held.insert(generation);
                    }
                    Victim::Spilling(s) => {
                        total += s.block.reserved();
                        room.spilling.push(s);
                    }
                    Victim::OnDisk(block) => {
                        total += block.reserved();
                        room.released.push(block);
                    }
                }
            }
        }
        room
    }

    /// The least recently used entries of `device` that free at least `need` bytes together
    /// (fewer if the device has fewer), skipping those whose publication is in `held`.
    fn victims(&self, device: Device, need: u64, held: &HashSet<u64>) -> Vec<usize> {
        let mut victims = Vec::new();
        let mut bytes = 0;
        for key in self.lru.oldest_first(device) {
            let e = &self.objects[key];
            if Publication::among(&e.listing, held) {
                continue;
            }
            victims.push(key);
            bytes += e.block.reserved();
            if bytes >= need {
                break;
            }
        }
        victims
    }

    /// What becomes of the victim `key` (unpublished already), given the generations held
    /// after its unpublish, and the spill policy when spilling is on.
    fn evict_victim(
        &mut self,
        key: usize,
        held_now: &HashSet<u64>,
        spill: Option<&mut SpillPolicy<'_>>,
    ) -> Victim {
        let listing = self.objects[key].listing;
        if Publication::among(&listing, held_now) {
            self.park(key);
            return Victim::Parked {
                generation: listing.generation(),
            };
        }
        if let Some(choose) = spill.filter(|_| self.spillable(key)) {
            let e = &self.objects[key];
            let candidate = SpillCandidate {
                id: e.id,
                name: e.name.as_str(),
                size: e.size,
                frees: e.block.reserved(),
            };
            match choose(candidate) {
                SpillChoice::Write => return Victim::Spilling(self.begin_spill(key)),
                SpillChoice::OnDisk => return Victim::OnDisk(self.drop_to_disk(key)),
                SpillChoice::Evict => {}
            }
        }
        self.activity
            .record(NotificationKind::Evicted, &self.objects[key]);
        let f = self.remove(key);
        self.activity.evicted(f.block.reserved());
        Victim::Freed(f)
    }

    /// Moves objects that clients got through their hold tables since they entered the LRU
    /// to where those gets put them (a get without a message leaves only a stamp).
    fn fold_access_stamps(&mut self) {
        let stamps = self.publication.stamps();
        if stamps.is_empty() {
            return;
        }
        let now = vovp_shm::now_stamp();
        for (object_id, stamp) in stamps {
            let Some(key) = self.objects.key_of(ObjectId::from_raw(object_id)) else {
                continue;
            };
            let e = &mut self.objects[key];
            let device = e.block.device();
            // A client's stamp is not trusted to lie in the future.
            self.lru.touch(key, &mut e.lru, device, stamp.min(now));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::test_support::{n, names, ok, put, A, B, GPU0};

    #[test]
    fn eviction_follows_least_recent_use_and_spares_held_objects() {
        let mut t = ObjectTable::new();
        put(&mut t, "a", 100);
        put(&mut t, "b", 100);
        put(&mut t, "c", 100);
        put(&mut t, "d", 100);
        // Using "a" makes it the most recent; "b" stays held.
        let a = t.get_now(&n("a"), 0, B).unwrap();
        t.release(a.id, B).unwrap();
        let _b = t.get_now(&n("b"), 0, B).unwrap();
        assert_eq!(t.evictable_objects(GPU0), 3);
        assert_eq!(t.evictable_bytes(GPU0), 300);

        // At least one byte: exactly the least recently used object.
        let freed = t.evict(GPU0, 1);
        assert_eq!(names(&freed), ["c"]);
        // Other devices are not touched.
        assert!(t.evict(Device::Cuda(1), u64::MAX).is_empty());
        assert!(t.evict(Device::Cpu, u64::MAX).is_empty());
        let freed = t.evict(GPU0, 150);
        assert_eq!(names(&freed), ["d", "a"]);
        assert!(t.evict(GPU0, u64::MAX).is_empty());
        assert!(t.contains(&n("b")));
        let s = t.stats();
        assert_eq!((s.evicted_objects, s.evicted_bytes), (3, 300));
        assert!(!t.contains(&n("a")) && t.check_name_free(&n("a"), false, A).is_ok());
        ok(&t);
    }

    #[test]
    fn evicted_objects_are_announced_and_their_names_free() {
        let mut t = ObjectTable::new();
        t.set_recording(true);
        put(&mut t, "x", 64);
        t.take_events();
        let freed = t.evict(GPU0, 64);
        assert_eq!(names(&freed), ["x"]);
        let events = t.take_events();
        assert_eq!(
            events.iter().map(|e| e.kind).collect::<Vec<_>>(),
            [NotificationKind::Evicted]
        );
        assert!(t.get_now(&n("x"), 0, B).is_none());
        assert!(t.is_empty());
        ok(&t);
    }
}
