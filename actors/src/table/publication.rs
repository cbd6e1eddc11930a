//! Publication: the table's use of the shared directory. Sealed, named, non-ephemeral host
//! objects are published there, so clients get them without a message, holding them through
//! their hold tables ([`crate::shared_regions`]); an object is unpublished before its memory
//! may go, and while a hold table still names it after that, it is *parked*: out of the LRU
//! and the directory, neither freed nor evictable, until no table names it
//! ([`super::ObjectTable::collect_parked`]).
//!
//! A publication is named by its generation: what hold tables record, so what must be unheld
//! before the memory goes. An entry keeps the generation of its last publication after it is
//! unpublished, for exactly that check.
//!
//! Invariants (checked by [`Publication::check`]): the parked set is exactly the entries
//! marked parked; a parked entry is not published; a published entry's generation is its
//! current publication's.

use std::collections::{HashMap, HashSet};

use vovp_types::{Counted, HolderId, Location, ALIGNMENT};

use super::objects::{Entry, Objects};
use crate::shared_regions::{Published, SharedRegions};

/// An entry's state in the directory (kept in the entry).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Listing {
    /// Where it is in the directory, while published.
    published: Option<Published>,
    /// The generation of its last publication (0: never published).
    generation: u64,
    /// Waiting for hold tables to let go of `generation`.
    parked: bool,
}

impl Listing {
    pub(super) fn is_parked(&self) -> bool {
        self.parked
    }

    /// Its last publication's generation (0: never published).
    pub(super) fn generation(&self) -> u64 {
        self.generation
    }

    /// Holds on it through hold tables, from a [`Publication::hold_counts`] snapshot.
    pub(super) fn holds(&self, counts: &HashMap<u64, u32>) -> u32 {
        match self.generation {
            0 => 0,
            g => counts.get(&g).copied().unwrap_or(0),
        }
    }
}

/// The shared regions (when the store publishes) and the parked entries.
#[derive(Default)]
pub(super) struct Publication {
    regions: Option<SharedRegions>,
    /// Keys of parked entries.
    parked: HashSet<usize>,
}

impl Publication {
    pub(super) fn new(regions: Option<SharedRegions>) -> Self {
        Publication {
            regions,
            parked: HashSet::new(),
        }
    }

    pub(super) fn regions(&self) -> Option<&SharedRegions> {
        self.regions.as_ref()
    }

    pub(super) fn regions_mut(&mut self) -> Option<&mut SharedRegions> {
        self.regions.as_mut()
    }

    /// Publishes `e` if it may be: sealed, named, not ephemeral, not parked, not published yet,
    /// in host memory. Its metadata must already be in its block, after the data padded to
    /// [`ALIGNMENT`] (the table actor writes it there at create). Unpublished objects are still
    /// served over the socket, so a full directory costs speed only.
    pub(super) fn publish(&mut self, e: &mut Entry) {
        let Some(regions) = self.regions.as_mut() else {
            return;
        };
        let Location::Host { segment, offset } = e.block.location() else {
            return;
        };
        if !e.is_kept_unreferenced() || e.listing.parked || e.listing.published.is_some() {
            return;
        }
        if e.residency != super::residency::Residency::Resident {
            return;
        }
        let Some(meta_offset) = e
            .size
            .checked_next_multiple_of(ALIGNMENT)
            .and_then(|d| offset.checked_add(d))
        else {
            return;
        };
        let published = regions.publish(&vovp_shm::Publish {
            name: e.name.as_str().as_bytes(),
            object_id: e.id.get(),
            segment,
            offset,
            size: e.size,
            meta_offset,
            meta_len: e.metadata.len() as u64,
            flags: 0,
            version: e.version,
        });
        if let Some(p) = published {
            e.listing.published = Some(p);
            e.listing.generation = p.generation;
        }
    }

    /// Takes the entry out of the directory (no new hold on it can validate after this).
    pub(super) fn unpublish(&mut self, listing: &mut Listing) {
        if let (Some(regions), Some(p)) = (self.regions.as_mut(), listing.published.take()) {
            regions.unpublish(p);
        }
    }

    /// Whether the entry is in the directory now.
    pub(super) fn is_published(&self, listing: &Listing) -> bool {
        listing.published.is_some()
    }

    /// Whether a hold table names the entry's last publication (call after unpublishing).
    pub(super) fn is_held(&self, listing: &Listing) -> bool {
        listing.generation != 0
            && self
                .regions
                .as_ref()
                .is_some_and(|r| r.is_held(listing.generation))
    }

    /// Every generation held now (fence first: call after unpublishing).
    pub(super) fn held_generations(&self) -> HashSet<u64> {
        self.regions
            .as_ref()
            .map(SharedRegions::held)
            .unwrap_or_default()
    }

    /// Whether `listing`'s last publication is among `held` (a [`Self::held_generations`]).
    pub(super) fn among(listing: &Listing, held: &HashSet<u64>) -> bool {
        listing.generation != 0 && held.contains(&listing.generation)
    }

    /// Parks the entry `key` (the caller takes it out of the LRU).
    pub(super) fn park(&mut self, key: usize, listing: &mut Listing) {
        listing.parked = true;
        self.parked.insert(key);
    }

    /// The parked entries no hold table names now, unparked: the caller frees or re-lists
    /// each.
    pub(super) fn unpark_unheld(&mut self, objects: &mut Objects) -> Vec<usize> {
        if self.parked.is_empty() {
            return Vec::new();
        }
        let held = self.held_generations();
        let ready: Vec<usize> = self
            .parked
            .iter()
            .copied()
            .filter(|&k| !Self::among(&objects[k].listing, &held))
            .collect();
        for &key in &ready {
            self.parked.remove(&key);
            objects[key].listing.parked = false;
        }
        ready
    }

    /// The entry `key` leaves the table: out of the directory and the parked set.
    pub(super) fn forget(&mut self, key: usize, listing: &mut Listing) {
        self.unpublish(listing);
        self.parked.remove(&key);
    }

    /// Entries waiting for clients' holds to go.
    pub(super) fn parked(&self) -> usize {
        self.parked.len()
    }

    /// The holder is gone: its holds no longer pin anything. `true` if it had a hold table.
    pub(super) fn detach(&mut self, holder: HolderId) -> bool {
        self.regions.as_mut().is_some_and(|r| r.detach(holder))
    }

    /// (object id, access stamp) of every hold slot's last get (the LRU fold).
    pub(super) fn stamps(&self) -> Vec<(u64, u64)> {
        self.regions
            .as_ref()
            .map(SharedRegions::stamps)
            .unwrap_or_default()
    }

    /// Holds through hold tables, per generation (a snapshot).
    pub(super) fn hold_counts(&self) -> HashMap<u64, u32> {
        self.regions
            .as_ref()
            .map(SharedRegions::hold_counts)
            .unwrap_or_default()
    }

    /// Per holder with a hold table, the generations its holds name now (a snapshot).
    pub(super) fn holds_by_holder(&self) -> Vec<(HolderId, Vec<u64>)> {
        self.regions
            .as_ref()
            .map(SharedRegions::holds_by_holder)
            .unwrap_or_default()
    }

    /// Gets served from the shared directory, ever, summed over the hold tables.
    pub(super) fn shared_gets(&mut self) -> Counted {
        self.regions
            .as_mut()
            .map(SharedRegions::shared_gets)
            .unwrap_or_default()
    }

    /// Holders with at least one hold now.
    pub(super) fn holders_holding(&self) -> HashSet<HolderId> {
        self.regions
            .as_ref()
            .map(SharedRegions::holders_holding)
            .unwrap_or_default()
    }

    /// The invariants in the module doc.
    pub(super) fn check(&self, objects: &Objects) -> Result<(), String> {
        for (key, e) in objects.iter() {
            let l = &e.listing;
            if l.parked != self.parked.contains(&key) {
                return Err(format!("{:?}: parked set wrong", e.name));
            }
            if l.parked && l.published.is_some() {
                return Err(format!("{:?}: parked but published", e.name));
            }
            if l.published.is_some_and(|p| p.generation != l.generation) {
                return Err(format!("{:?}: generation wrong", e.name));
            }
        }
        if self.parked.iter().any(|&k| objects.get(k).is_none()) {
            return Err("a removed entry is still parked".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use vovp_shm::SharedReader;
    use vovp_types::{Device, HolderId};

    use crate::allocator::HostBlock;
    use crate::block::Block;
    use crate::shared_regions::{SharedConfig, SharedRegions};
    use crate::table::test_support::{insert, n, names, new_object, ok, refcount, A, B};
    use crate::table::ObjectTable;

    fn publishing_table() -> ObjectTable {
        let config = SharedConfig {
            directory_entries: 1024,
            hold_slots: 64,
        };
        ObjectTable::with_shared(SharedRegions::new(config).unwrap())
    }

    /// `holder`'s side of the shared regions, as a client maps them.
    fn reader(t: &mut ObjectTable, holder: HolderId) -> SharedReader {
        let fds = t.attach_shared(holder).unwrap().unwrap();
        SharedReader::open(&fds.directory, &fds.holds).unwrap()
    }

    /// A sealed host object nobody references (in the LRU, published).
    fn put_host(t: &mut ObjectTable, name: &str, size: u64, ephemeral: bool) {
        let block = Block::Host(HostBlock::for_tests(0, size));
        let r = t
            .insert(new_object(name, size, block, ephemeral, false, A))
            .unwrap();
        t.seal(&n(name), A, Some(r.id)).unwrap();
        if !ephemeral {
            t.release(r.id, A).unwrap();
        }
    }

    #[test]
    fn only_sealed_named_lasting_host_objects_are_published() {
        let mut t = publishing_table();
        let client = reader(&mut t, B);
        put_host(&mut t, "host", 64, false);
        put_host(&mut t, "ephemeral", 64, true);
        insert(&mut t, "device", 64, false);
        t.seal(&n("device"), A, None).unwrap();
        t.insert(new_object(
            "unsealed",
            64,
            Block::Host(HostBlock::for_tests(0, 64)),
            false,
            false,
            A,
        ))
        .unwrap();
        assert!(client.hold("host").is_some());
        for name in ["ephemeral", "device", "unsealed", "missing"] {
            assert!(client.hold(name).is_none(), "{name}");
        }
        // A hold through the table counts as a reference.
        assert_eq!(refcount(&t, "host"), 1);
        assert_eq!(t.stats().shared_holds, 1);
        ok(&t);
    }

    #[test]
    fn a_deleted_object_a_table_holds_is_parked_until_released() {
        let mut t = publishing_table();
        let client = reader(&mut t, B);
        put_host(&mut t, "x", 64, false);
        let hold = client.hold("x").unwrap();
        assert!(t.delete(&n("x")).unwrap().is_none(), "held: not freed");
        assert_eq!((t.parked(), t.stats().pending_delete), (1, 1));
        assert!(client.hold("x").is_none(), "unpublished");
        assert!(t.collect_parked().is_empty(), "still held");
        ok(&t);
        client.release(hold.slot, hold.snapshot).unwrap();
        assert_eq!(names(&t.collect_parked()), ["x"]);
        assert_eq!(t.parked(), 0);
        assert!(t.is_empty());
        ok(&t);
    }

    #[test]
    fn eviction_passes_over_held_objects_and_folds_their_access_stamps() {
        let mut t = publishing_table();
        let client = reader(&mut t, B);
        put_host(&mut t, "old", 64, false);
        put_host(&mut t, "new", 64, false);
        // A get through the table (since released) makes "old" the most recently used.
        let hold = client.hold("old").unwrap();
        client.release(hold.slot, hold.snapshot).unwrap();
        assert_eq!(names(&t.evict(Device::Cpu, 1)), ["new"]);
        ok(&t);
        // Held: never a victim, and the eviction gives up rather than loop.
        put_host(&mut t, "other", 64, false);
        let _held = client.hold("old").unwrap();
        assert_eq!(names(&t.evict(Device::Cpu, u64::MAX)), ["other"]);
        assert!(t.contains(&n("old")));
        assert!(t.evict(Device::Cpu, u64::MAX).is_empty());
        ok(&t);
    }

    #[test]
    fn directory_gets_and_holds_are_counted_per_holder_and_kept_after_it_goes() {
        let mut t = publishing_table();
        let client = reader(&mut t, B);
        put_host(&mut t, "x", 64, false);
        put_host(&mut t, "y", 32, false);
        let first = client.hold("x").unwrap();
        client.release(first.slot, first.snapshot).unwrap();
        let _x = client.hold("x").unwrap();
        let _y = client.hold("y").unwrap();
        let gets = t.activity().shared_gets;
        assert_eq!((gets.count, gets.bytes), (3, 160));
        let usage = t.holder_usage();
        assert_eq!(
            usage
                .iter()
                .map(|u| (u.holder, u.references, u.bytes))
                .collect::<Vec<_>>(),
            [(B, 2, 96)]
        );
        // Read twice: counted once. Gone: its count stays, its holds go.
        assert_eq!(t.activity().shared_gets, gets);
        t.release_holder(B);
        assert_eq!(t.activity().shared_gets, gets);
        assert!(t.holder_usage().is_empty());
        ok(&t);
    }

    #[test]
    fn a_departing_holder_pins_nothing() {
        let mut t = publishing_table();
        let client = reader(&mut t, B);
        put_host(&mut t, "x", 64, false);
        let _hold = client.hold("x").unwrap();
        assert!(t.delete(&n("x")).unwrap().is_none());
        assert_eq!(t.parked(), 1);
        assert_eq!(names(&t.release_holder(B)), ["x"]);
        assert_eq!(t.parked(), 0);
        ok(&t);
    }
}
