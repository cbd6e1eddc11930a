//! Objects and names: the slab of entries, the name index, the index of unsealed replacements
//! and every holder's references. What an object *is* (its id, name, block, version, whether it
//! is sealed, named, referenced); what happens to it (eviction, publication, waiting gets) is
//! the other parts' and the table's.
//!
//! Ids: an entry's id is its slab key in the low 32 bits and the table's incarnation counter at
//! its insert in the high 32, so an id of a removed entry never names the entry that reuses
//! its key (a stale release is `NotHeld`, a stale seal `NotFound`).
//!
//! Invariants (checked by [`Objects::check`]):
//! - an entry's `refcount` is the sum of what the holders hold of it, and no holder keeps a
//!   zero count;
//! - `by_name` maps exactly the `named` entries' names to them (one per name);
//! - `replacements` maps exactly the `replacing` entries, by (name, creator); a replacement is
//!   neither named nor sealed;
//! - an entry is sealed exactly when its version is above 0.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::SystemTime;

use slab::Slab;
use vovp_types::{Error, HolderId, ObjectId, ObjectName, ObjectRef};

use super::lru::LruPlace;
use super::publication::Listing;
use super::residency::Residency;
use crate::block::Block;

/// One object of the table.
pub(super) struct Entry {
    pub id: ObjectId,
    pub name: ObjectName,
    pub size: u64,
    pub metadata: Arc<[u8]>,
    pub block: Block,
    pub sealed: bool,
    pub ephemeral: bool,
    /// False once deleted: the name is free again, the memory waits for the last holder.
    pub named: bool,
    pub creator: HolderId,
    pub refcount: u32,
    pub last_access: SystemTime,
    /// Its name's version: given at seal (0 before).
    pub version: u64,
    /// The version its seal must give it (an explicit version: above the name's present
    /// one), instead of the next one.
    pub wanted_version: Option<u64>,
    /// An unsealed replacement (in `replacements`, not `by_name`): the name is another
    /// object's until this one's seal.
    pub replacing: bool,
    /// Its place in its device's eviction order ([`super::lru`]).
    pub lru: LruPlace,
    /// Its publication in the shared directory ([`super::publication`]).
    pub listing: Listing,
    /// In memory, on disk, or on its way between them ([`super::residency`]).
    pub residency: Residency,
}

impl Entry {
    pub(super) fn object_ref(&self) -> ObjectRef {
        ObjectRef {
            id: self.id,
            name: self.name.clone(),
            size: self.size,
            metadata: self.metadata.clone(),
            location: self.block.location(),
            version: self.version,
        }
    }

    /// Sealed, still named and not ephemeral: what stays in the table, evictable, once nobody
    /// references it.
    pub(super) fn is_kept_unreferenced(&self) -> bool {
        self.sealed && self.named && !self.ephemeral
    }
}

/// What an insert is asked to make: an unsealed object in `block`, whose `creator` holds one
/// reference; with `replace`, a taken name whose object is sealed gets a replacement.
pub(crate) struct NewObject {
    pub name: ObjectName,
    pub size: u64,
    pub metadata: Arc<[u8]>,
    pub block: Block,
    pub ephemeral: bool,
    pub replace: bool,
    pub creator: HolderId,
    /// Seal as exactly this version (see [`Objects::check_version`]).
    pub version: Option<u64>,
}

/// The entries, their names and their holders' references.
#[derive(Default)]
pub(super) struct Objects {
    slab: Slab<Entry>,
    by_name: HashMap<ObjectName, usize>,
    /// Unsealed replacements, by name and creator.
    replacements: HashMap<(ObjectName, HolderId), usize>,
    /// Per holder: the entries it references, and how many times each.
    holders: HashMap<HolderId, HashMap<usize, u32>>,
    incarnation: u32,
}

impl std::ops::Index<usize> for Objects {
    type Output = Entry;

    fn index(&self, key: usize) -> &Entry {
        &self.slab[key]
    }
}

impl std::ops::IndexMut<usize> for Objects {
    fn index_mut(&mut self, key: usize) -> &mut Entry {
        &mut self.slab[key]
    }
}

impl Objects {
    /// The key of the entry `id` names, if it is still that entry.
    pub(super) fn key_of(&self, id: ObjectId) -> Option<usize> {
        let key = (id.get() & 0xFFFF_FFFF) as usize;
        match self.slab.get(key) {
            Some(e) if e.id == id => Some(key),
            _ => None,
        }
    }

    /// The entry that holds `name` now (sealed or not).
    pub(super) fn named(&self, name: &ObjectName) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    pub(super) fn named_key(&self, name: &ObjectName) -> Result<usize, Error> {
        self.named(name)
            .ok_or_else(|| Error::NotFound(name.to_string()))
    }

    /// The unsealed object `holder` writes under `name`: its replacement of the name if it
    /// writes one, else the name's object.
    pub(super) fn key_to_finish(
        &self,
        name: &ObjectName,
        holder: HolderId,
    ) -> Result<usize, Error> {
        match self.replacements.get(&(name.clone(), holder)) {
            Some(&key) => Ok(key),
            None => self.named_key(name),
        }
    }

    /// Fails when `creator` may not create `name` now: the name is taken (sealed or not;
    /// deleted-but-referenced objects do not count) and this is no `replace`, or it is being
    /// created (unsealed) by a plain create, or `creator` is writing a replacement of it
    /// already.
    pub(super) fn check_name_free(
        &self,
        name: &ObjectName,
        replace: bool,
        creator: HolderId,
    ) -> Result<(), Error> {
        let Some(key) = self.named(name) else {
            return Ok(());
        };
        if !replace {
            return Err(Error::AlreadyExists(name.to_string()));
        }
        if !self.slab[key].sealed {
            return Err(Error::AlreadyExists(format!(
                "{name} (being created: a replace takes the place of a sealed object)"
            )));
        }
        if self.replacements.contains_key(&(name.clone(), creator)) {
            return Err(Error::AlreadyExists(format!(
                "{name} (this client is writing a replacement of it already)"
            )));
        }
        Ok(())
    }

    /// Fails when an object of `name` cannot be sealed as exactly `version` now: 0 is no
    /// version, and a version must be above the name's present (sealed) one. Checked at
    /// insert and again at seal (a newer version may have been sealed in between).
    pub(super) fn check_version(
        &self,
        name: &ObjectName,
        version: Option<u64>,
    ) -> Result<(), Error> {
        let Some(requested) = version else {
            return Ok(());
        };
        if requested == 0 {
            return Err(Error::Protocol(format!(
                "{name}: version 0 is no version (versions count from 1)"
            )));
        }
        match self.named(name).map(|k| &self.slab[k]) {
            Some(e) if e.sealed && e.version >= requested => Err(Error::StaleVersion {
                name: name.to_string(),
                current: e.version,
                requested,
            }),
            _ => Ok(()),
        }
    }

    /// Adds an unsealed entry; its creator holds one reference. A `replace` of a taken name
    /// makes a replacement (unnamed until its seal). Its key.
    pub(super) fn insert(&mut self, new: NewObject) -> Result<usize, Error> {
        self.check_name_free(&new.name, new.replace, new.creator)?;
        self.check_version(&new.name, new.version)?;
        let replacing = self.by_name.contains_key(&new.name);
        self.incarnation = self.incarnation.wrapping_add(1);
        let entry = self.slab.vacant_entry();
        let key = entry.key();
        let id = ObjectId::from_raw((u64::from(self.incarnation) << 32) | key as u64);
        entry.insert(Entry {
            id,
            name: new.name.clone(),
            size: new.size,
            metadata: new.metadata,
            block: new.block,
            sealed: false,
            ephemeral: new.ephemeral,
            named: !replacing,
            creator: new.creator,
            refcount: 0,
            last_access: SystemTime::now(),
            version: 0,
            wanted_version: new.version,
            replacing,
            lru: LruPlace::default(),
            listing: Listing::default(),
            residency: Residency::Resident,
        });
        if replacing {
            self.replacements.insert((new.name, new.creator), key);
        } else {
            self.by_name.insert(new.name, key);
        }
        self.add_ref(key, new.creator);
        Ok(key)
    }

    /// The replacement `key` takes its name over (at its seal; the caller unlinked the name's
    /// previous entry first).
    pub(super) fn take_name(&mut self, key: usize) {
        let e = &mut self.slab[key];
        e.replacing = false;
        e.named = true;
        let (name, creator) = (e.name.clone(), e.creator);
        self.replacements.remove(&(name.clone(), creator));
        self.by_name.insert(name, key);
    }

    /// Frees `key`'s name (deleted, replaced or aborted): the entry stays, unnamed, for its
    /// holders.
    pub(super) fn unname(&mut self, key: usize) {
        let e = &mut self.slab[key];
        if e.replacing {
            e.replacing = false;
            self.replacements.remove(&(e.name.clone(), e.creator));
        } else if e.named {
            e.named = false;
            self.by_name.remove(&e.name);
        }
    }

    /// One more reference of `holder` to `key`.
    pub(super) fn add_ref(&mut self, key: usize, holder: HolderId) {
        let e = &mut self.slab[key];
        e.refcount += 1;
        e.last_access = SystemTime::now();
        *self
            .holders
            .entry(holder)
            .or_default()
            .entry(key)
            .or_insert(0) += 1;
    }

    /// Drops one reference of `holder` to object `id`: the entry's key (its `refcount` says
    /// whether that was the last). `NotHeld` when `holder` holds none.
    pub(super) fn drop_ref(&mut self, id: ObjectId, holder: HolderId) -> Result<usize, Error> {
        let key = self.key_of(id).ok_or(Error::NotHeld(id.get()))?;
        self.drop_holders_count(holder, key, 1)
            .ok_or(Error::NotHeld(id.get()))?;
        self.slab[key].refcount -= 1;
        Ok(key)
    }

    /// Takes `count` of `holder`'s references to `key` off its books (not off the entry's
    /// refcount); `None` when it holds fewer.
    fn drop_holders_count(&mut self, holder: HolderId, key: usize, count: u32) -> Option<()> {
        let held = self.holders.get_mut(&holder)?;
        let n = held.get_mut(&key).filter(|n| **n >= count)?;
        *n -= count;
        if *n == 0 {
            held.remove(&key);
            if held.is_empty() {
                self.holders.remove(&holder);
            }
        }
        Some(())
    }

    /// Drops every reference `holder` has to `key` (the entry is about to be removed: an
    /// abort drops its creator's).
    pub(super) fn drop_refs_to(&mut self, key: usize, holder: HolderId) {
        let Some(held) = self.holders.get_mut(&holder) else {
            return;
        };
        if let Some(count) = held.remove(&key) {
            self.slab[key].refcount -= count;
        }
        if held.is_empty() {
            self.holders.remove(&holder);
        }
    }

    /// Drops every reference `holder` has: (key, count) of each entry it referenced, whose
    /// refcounts are lowered already.
    pub(super) fn drop_holder(&mut self, holder: HolderId) -> Vec<usize> {
        let Some(held) = self.holders.remove(&holder) else {
            return Vec::new();
        };
        held.into_iter()
            .map(|(key, count)| {
                self.slab[key].refcount -= count;
                key
            })
            .collect()
    }

    /// Removes the entry and its names.
    pub(super) fn remove(&mut self, key: usize) -> Entry {
        self.unname(key);
        self.slab.remove(key)
    }

    /// Whether `name` is sealed and present.
    pub(super) fn contains(&self, name: &ObjectName) -> bool {
        self.named(name).is_some_and(|k| self.slab[k].sealed)
    }

    /// Keys of the named entries (any order).
    pub(super) fn named_keys(&self) -> impl Iterator<Item = usize> + '_ {
        self.by_name.values().copied()
    }

    /// Entries that have a name or will at their seal (named + unsealed replacements).
    pub(super) fn named_or_replacing(&self) -> usize {
        self.by_name.len() + self.replacements.len()
    }

    /// Holders with at least one reference.
    pub(super) fn holders(&self) -> impl Iterator<Item = &HolderId> {
        self.holders.keys()
    }

    /// Every holder's references: the entries it holds, and how many times each.
    pub(super) fn references(&self) -> impl Iterator<Item = (HolderId, &HashMap<usize, u32>)> {
        self.holders.iter().map(|(h, refs)| (*h, refs))
    }

    pub(super) fn is_holder(&self, holder: &HolderId) -> bool {
        self.holders.contains_key(holder)
    }

    pub(super) fn get(&self, key: usize) -> Option<&Entry> {
        self.slab.get(key)
    }

    /// One past the highest key the slab has had room for (list cursors run up to it).
    pub(super) fn key_bound(&self) -> usize {
        self.slab.capacity()
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (usize, &Entry)> {
        self.slab.iter()
    }

    pub(super) fn len(&self) -> usize {
        self.slab.len()
    }

    /// The invariants in the module doc.
    pub(super) fn check(&self) -> Result<(), String> {
        let mut counted: HashMap<usize, u32> = HashMap::new();
        for held in self.holders.values() {
            for (&k, &c) in held {
                if c == 0 {
                    return Err(format!("zero count kept for key {k}"));
                }
                *counted.entry(k).or_insert(0) += c;
            }
        }
        for (k, e) in &self.slab {
            let c = counted.get(&k).copied().unwrap_or(0);
            if c != e.refcount {
                return Err(format!(
                    "{:?}: refcount {} but holders hold {c}",
                    e.name, e.refcount
                ));
            }
            if e.named && self.by_name.get(&e.name) != Some(&k) {
                return Err(format!("{:?}: name index wrong", e.name));
            }
            if e.replacing != (self.replacements.get(&(e.name.clone(), e.creator)) == Some(&k))
                || (e.replacing && (e.named || e.sealed))
            {
                return Err(format!("{:?}: replacement index wrong", e.name));
            }
            if e.sealed != (e.version > 0) {
                return Err(format!("{:?}: version {} wrong", e.name, e.version));
            }
        }
        if self.by_name.values().any(|&k| !self.slab[k].named) {
            return Err("the name index names an unnamed entry".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::test_support::{block, n, A, B};

    fn new(name: &str, replace: bool, creator: HolderId) -> NewObject {
        NewObject {
            name: n(name),
            size: 8,
            metadata: Arc::from(&[][..]),
            block: block(0, 8),
            ephemeral: false,
            replace,
            creator,
            version: None,
        }
    }

    fn seal(o: &mut Objects, key: usize) {
        o[key].sealed = true;
        o[key].version = 1;
    }

    #[test]
    fn ids_name_one_incarnation_of_a_key() {
        let mut o = Objects::default();
        let k = o.insert(new("x", false, A)).unwrap();
        let id = o[k].id;
        assert_eq!(o.key_of(id), Some(k));
        assert_eq!(o.drop_ref(id, A), Ok(k));
        o.remove(k);
        // The key is reused by the next insert, under another id.
        let k2 = o.insert(new("y", false, A)).unwrap();
        assert_eq!(k2, k);
        assert_ne!(o[k2].id, id);
        assert_eq!(o.key_of(id), None);
        assert_eq!(o.drop_ref(id, A), Err(Error::NotHeld(id.get())));
        o.check().unwrap();
    }

    #[test]
    fn a_name_is_taken_until_replaced_by_its_creator_once_at_a_time() {
        let mut o = Objects::default();
        let k = o.insert(new("x", false, A)).unwrap();
        // Unsealed: taken, and not replaceable yet.
        assert_eq!(
            o.check_name_free(&n("x"), false, B),
            Err(Error::AlreadyExists("x".into()))
        );
        assert!(o.insert(new("x", true, B)).is_err());
        seal(&mut o, k);
        let r = o.insert(new("x", true, B)).unwrap();
        assert!(o[r].replacing && !o[r].named);
        assert_eq!(o.named(&n("x")), Some(k));
        assert_eq!(o.key_to_finish(&n("x"), B), Ok(r));
        assert_eq!(o.key_to_finish(&n("x"), A), Ok(k));
        assert!(o.insert(new("x", true, B)).is_err(), "one at a time");
        let other = o.insert(new("x", true, A)).unwrap();
        assert_eq!(o.named_or_replacing(), 3);
        o.check().unwrap();
        // B's seal: the previous entry gives the name up, the replacement takes it.
        seal(&mut o, r);
        o.unname(k);
        o.take_name(r);
        assert_eq!(o.named(&n("x")), Some(r));
        assert!(!o[k].named);
        // A's replacement is still one.
        assert_eq!(o.key_to_finish(&n("x"), A), Ok(other));
        o.check().unwrap();
    }

    #[test]
    fn references_are_counted_per_holder_and_dropped_with_it() {
        let mut o = Objects::default();
        let k = o.insert(new("x", false, A)).unwrap();
        o.add_ref(k, B);
        o.add_ref(k, B);
        assert_eq!(o[k].refcount, 3);
        assert!(o.is_holder(&B));
        let id = o[k].id;
        assert_eq!(o.drop_ref(id, B), Ok(k));
        assert_eq!(o.drop_holder(B), vec![k]);
        assert_eq!(o[k].refcount, 1);
        assert!(!o.is_holder(&B));
        assert_eq!(o.drop_ref(id, B), Err(Error::NotHeld(id.get())));
        o.drop_refs_to(k, A);
        assert_eq!(o[k].refcount, 0);
        assert_eq!(o.holders().count(), 0);
        o.check().unwrap();
    }
}
