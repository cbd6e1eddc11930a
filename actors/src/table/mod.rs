//! The object table: names, life cycle, per-holder reference counts, the LRU of evictable
//! objects, waiting gets and publication in the shared directory. Plain synchronous data
//! structure (the table actor wraps it), so every rule of the object life cycle is
//! unit-testable without a runtime.
//!
//! Life cycle: `insert` (unsealed, creator holds one reference) → `seal` (immutable, visible)
//! → references come and go through `get`/`release` → sealed objects with no reference sit in
//! the LRU and may be evicted → `delete` unlinks the name at once and frees the memory when the
//! last holder releases. An unsealed object lives only while its creator holds it: the creator's
//! release (or disconnect) aborts it.
//!
//! Versions: a name's first sealed object is version 1. A create with `replace` of a name whose
//! object is sealed makes a *replacement*: unnamed (not found by get, not listed) until its
//! seal, which moves the name to it as the next version in one step and unlinks the previous
//! version as `delete` would (its holders keep it; its memory goes with the last of them).
//! Replacements of one name by different creators seal in any order, each taking the next
//! version; one creator writes one replacement of a name at a time.
//!
//! Parts, each with its own invariants in its module doc:
//! - [`objects`]: the entries, their names and the holders' references;
//! - [`lru`]: per device, the evictable entries in order of use;
//! - [`waiting`]: the gets waiting for names to be sealed;
//! - [`publication`]: the shared directory, and the entries parked while hold tables name them;
//! - [`stats`]: counters and notifications ([`stats::Activity`]), and the views (`list`,
//!   pages, STATS);
//! - [`eviction`]: which entries go when a device is full, and what becomes of each;
//! - [`residency`]: entries whose bytes are spilled to disk or on their way (the disk side
//!   is [`crate::spill`]'s).
//!
//! This module coordinates them; its own invariant (checked by
//! [`ObjectTable::check_invariants`]): an entry is in the LRU exactly when it is sealed, named,
//! unreferenced, not parked and resident.

mod eviction;
mod lru;
mod objects;
mod publication;
mod residency;
mod stats;
mod waiting;

#[cfg(test)]
mod test_support;
#[cfg(test)]
mod tests;

use std::time::SystemTime;

use vovp_types::{
    Error, HolderId, Notification, NotificationKind, ObjectId, ObjectName, ObjectRef,
};

use crate::block::Block;
use crate::shared_regions::{SharedFds, SharedRegions};
use lru::Lru;
use objects::Objects;
use publication::Publication;
use stats::Activity;
use waiting::GetQueue;

pub(crate) use eviction::{Room, SpillCandidate, SpillChoice};
pub(crate) use objects::NewObject;
pub(crate) use residency::{RestoreEnd, SpillEnd, Spilling};
pub(crate) use waiting::{CompletedGet, GetReply, GetResults, WaiterId};

use residency::Residency;

/// A get that waits: its waiter, and the spilled objects whose restore it needs started (the
/// table actor starts each once, however many gets wait for it).
#[derive(Debug)]
pub(crate) struct StartedGet {
    pub waiter: WaiterId,
    pub restores: Vec<ObjectId>,
}

/// What a seal did: the version the object became, the gets it completed, and the previous
/// version's memory when a replace freed it at once.
pub(crate) struct Sealed {
    pub version: u64,
    pub done: Vec<CompletedGet>,
    pub freed: Option<Freed>,
}

/// An object that left the table and whose memory must go back to its allocator.
#[derive(Debug)]
pub(crate) struct Freed {
    /// Which incarnation it was (an IO of it may still be in flight).
    pub id: ObjectId,
    pub block: Block,
    /// Which object it was: the tests check it, logs print it (`Debug`).
    #[allow(dead_code)]
    pub name: ObjectName,
    #[allow(dead_code)]
    pub size: u64,
}

/// The parts (see the module doc).
#[derive(Default)]
pub(crate) struct ObjectTable {
    objects: Objects,
    lru: Lru,
    waiting: GetQueue,
    publication: Publication,
    activity: Activity,
    /// Gets that ended outside a seal or a restore (the name of a spilled object they waited
    /// for went): the actor sends them ([`ObjectTable::take_finished_gets`]).
    finished: Vec<CompletedGet>,
}

impl ObjectTable {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// A table that publishes its sealed host objects in `regions` (clients then get them
    /// without a message while their hold tables pin them).
    pub(crate) fn with_shared(regions: SharedRegions) -> Self {
        ObjectTable {
            publication: Publication::new(Some(regions)),
            ..Self::default()
        }
    }

    /// The shared directory and hold tables, when the store publishes (the lend handshake and
    /// pipelined puts' counts are read there).
    pub(crate) fn shared_regions(&self) -> Option<&SharedRegions> {
        self.publication.regions()
    }

    /// Gives `holder` its hold table and the directory to map (`None`: not publishing).
    pub(crate) fn attach_shared(&mut self, holder: HolderId) -> Option<Result<SharedFds, Error>> {
        Some(self.publication.regions_mut()?.attach(holder))
    }

    /// Record changes as notifications (while someone subscribes).
    pub(crate) fn set_recording(&mut self, on: bool) {
        self.activity.set_recording(on);
    }

    pub(crate) fn recording(&self) -> bool {
        self.activity.recording()
    }

    /// Notifications recorded since the last call.
    pub(crate) fn take_events(&mut self) -> Vec<Notification> {
        self.activity.take_events()
    }

    /// Fails when `creator` may not create `name` now (see [`objects::Objects::check_name_free`]).
    /// Asked before memory is allocated, and again by [`ObjectTable::insert`].
    pub(crate) fn check_name_free(
        &self,
        name: &ObjectName,
        replace: bool,
        creator: HolderId,
    ) -> Result<(), Error> {
        self.objects.check_name_free(name, replace, creator)
    }

    /// Fails when `name` cannot be sealed as exactly `version` now (see
    /// [`objects::Objects::check_version`]): asked before memory is allocated.
    pub(crate) fn check_version(
        &self,
        name: &ObjectName,
        version: Option<u64>,
    ) -> Result<(), Error> {
        self.objects.check_version(name, version)
    }

    /// Adds an unsealed object; the creator holds one reference. With `replace`, a name whose
    /// object is sealed gets a replacement (see the module doc).
    pub(crate) fn insert(&mut self, new: NewObject) -> Result<ObjectRef, Error> {
        let key = self.objects.insert(new)?;
        self.activity.created();
        Ok(self.objects[key].object_ref())
    }

    /// Seals `name` (creator only); with `id`, only that incarnation of it, so a buffer that
    /// outlived its aborted object cannot seal a newer object of the same name (`NotFound`).
    /// A replacement takes the name over as its next version (or the explicit version it was
    /// created with, which must still be above the present one: else `StaleVersion`, and the
    /// object stays unsealed for its creator to abort); the previous version is unlinked as by
    /// `delete`.
    pub(crate) fn seal(
        &mut self,
        name: &ObjectName,
        holder: HolderId,
        id: Option<ObjectId>,
    ) -> Result<Sealed, Error> {
        let key = self.objects.key_to_finish(name, holder)?;
        let e = &self.objects[key];
        if id.is_some_and(|id| id != e.id) {
            return Err(Error::NotFound(name.to_string()));
        }
        if e.sealed {
            return Err(Error::AlreadySealed(name.to_string()));
        }
        if e.creator != holder {
            return Err(Error::NotCreator(name.to_string()));
        }
        let wanted = e.wanted_version;
        if e.replacing {
            self.objects.check_version(name, wanted)?;
        }
        let mut freed = None;
        let mut kind = NotificationKind::Sealed;
        let mut version = wanted.unwrap_or(1);
        if e.replacing {
            if let Some(old) = self.objects.named(name) {
                if !self.objects[old].sealed {
                    // The previous version went and a plain create took the name since.
                    return Err(Error::AlreadyExists(format!(
                        "{name} (deleted and being created again since this replace began)"
                    )));
                }
                version = wanted.unwrap_or(self.objects[old].version + 1);
                kind = NotificationKind::Replaced;
                freed = self.unlink(old);
            }
            self.objects.take_name(key);
        }
        let e = &mut self.objects[key];
        e.sealed = true;
        e.version = version;
        e.last_access = SystemTime::now();
        let published = matches!(e.block, Block::Lent(_));
        self.activity
            .sealed(e.size, kind == NotificationKind::Replaced, published);
        self.activity.record(kind, e);
        self.publication.publish(e);
        Ok(Sealed {
            version,
            done: self.wake_waiters(name, key),
            freed,
        })
    }

    /// Fills the waiting gets' slots that `key` (just sealed as `name`) answers, one reference
    /// per slot: the gets that completed.
    fn wake_waiters(&mut self, name: &ObjectName, key: usize) -> Vec<CompletedGet> {
        let version = self.objects[key].version;
        let mut done = Vec::new();
        for fill in self.waiting.sealed(name, version) {
            for slot in fill.slots {
                let r = self.take_ref(key, fill.holder);
                done.extend(self.waiting.fill(fill.waiter, slot, r));
            }
        }
        done
    }

    /// Aborts an unsealed object (creator only): its name is free at once. Its memory is
    /// returned now, with the creator's reference, unless `keep_while_held`: then it goes with
    /// the creator's release, like a deleted object's (the embedded engine, whose creator may
    /// still hold a writable buffer of it: freed now, that buffer would write into whatever
    /// object gets the memory next).
    pub(crate) fn abort(
        &mut self,
        name: &ObjectName,
        holder: HolderId,
        keep_while_held: bool,
    ) -> Result<Option<Freed>, Error> {
        let key = self.objects.key_to_finish(name, holder)?;
        let e = &self.objects[key];
        if e.sealed {
            return Err(Error::AlreadySealed(name.to_string()));
        }
        if e.creator != holder {
            return Err(Error::NotCreator(name.to_string()));
        }
        if keep_while_held {
            self.objects.unname(key);
            return Ok(None);
        }
        self.objects.drop_refs_to(key, holder);
        Ok(Some(self.remove(key)))
    }

    /// One more reference of `holder` to `key`: out of the LRU while referenced.
    fn take_ref(&mut self, key: usize, holder: HolderId) -> ObjectRef {
        self.objects.add_ref(key, holder);
        let e = &mut self.objects[key];
        let (device, reserved) = (e.block.device(), e.block.reserved());
        self.lru.leave(&mut e.lru, device, reserved);
        e.object_ref()
    }

    /// A reference to `name` if it is sealed now, as a version above `newer_than`.
    pub(crate) fn get_now(
        &mut self,
        name: &ObjectName,
        newer_than: u64,
        holder: HolderId,
    ) -> Option<ObjectRef> {
        let key = self.objects.named(name)?;
        let e = &self.objects[key];
        // A spilled object comes back first (a spilling one is still in memory: taken).
        if !e.sealed || e.version <= newer_than || e.residency.is_away() {
            return None;
        }
        Some(self.take_ref(key, holder))
    }

    /// Gets every name; when some are missing and `wait` is set, registers a waiter whose
    /// results go to `reply` (as soon as all are sealed, or at timeout through `expire_waiter`).
    /// `newer_than`: per name, the version it must be above (empty: any sealed version).
    /// A name whose object is spilled is waited for until its restore ends, `wait` or not
    /// (a timeout ends only the wait for missing names).
    pub(crate) fn begin_get(
        &mut self,
        holder: HolderId,
        names: Vec<ObjectName>,
        newer_than: Vec<u64>,
        wait: bool,
        reply: GetReply,
    ) -> Result<StartedGet, (GetResults, GetReply)> {
        let mut newer_than = newer_than;
        newer_than.resize(names.len(), 0);
        let results: GetResults = names
            .iter()
            .zip(&newer_than)
            .map(|(n, &v)| self.get_now(n, v, holder))
            .collect();
        let mut restores = Vec::new();
        let restoring: Vec<bool> = names
            .iter()
            .zip(&newer_than)
            .zip(&results)
            .map(|((n, &v), r)| {
                let away = r.is_none().then(|| self.away(n, v)).flatten();
                if let Some((key, true)) = away {
                    let id = self.objects[key].id;
                    if !restores.contains(&id) {
                        restores.push(id);
                    }
                }
                away.is_some()
            })
            .collect();
        let away = restoring.iter().any(|&r| r);
        if results.iter().all(Option::is_some) || !(wait || away) {
            return Err((results, reply));
        }
        let waiter = self
            .waiting
            .wait(holder, names, newer_than, results, restoring, !wait, reply);
        Ok(StartedGet { waiter, restores })
    }

    /// A waiting get reached its timeout: its partial results, or `None` if it completed
    /// already or still waits for a restore (it then ends with that restore).
    pub(crate) fn expire_waiter(&mut self, waiter: WaiterId) -> Option<CompletedGet> {
        self.waiting.expire(waiter)
    }

    /// Gets that ended because a spilled object they waited for went (see `finished`).
    pub(crate) fn take_finished_gets(&mut self) -> Vec<CompletedGet> {
        std::mem::take(&mut self.finished)
    }

    /// Drops one reference of `holder` to object `id`. Returns the memory to free when that was
    /// the last reference of a deleted, ephemeral or unsealed object.
    pub(crate) fn release(
        &mut self,
        id: ObjectId,
        holder: HolderId,
    ) -> Result<Option<Freed>, Error> {
        let key = self.objects.drop_ref(id, holder)?;
        Ok(self.after_release(key))
    }

    /// After references to `key` were dropped: at the last, the object goes (deleted, unsealed
    /// or ephemeral ones) or becomes evictable.
    fn after_release(&mut self, key: usize) -> Option<Freed> {
        let e = &self.objects[key];
        if e.refcount > 0 {
            return None;
        }
        if !e.is_kept_unreferenced() {
            if e.named && e.sealed {
                self.activity.record(NotificationKind::Deleted, e);
            }
            return self.free_or_park(key);
        }
        // A spilling entry's write decides what becomes of it ([`residency`]).
        if !e.listing.is_parked() && e.residency == Residency::Resident {
            self.enter_lru(key);
        }
        None
    }

    fn enter_lru(&mut self, key: usize) {
        let e = &mut self.objects[key];
        let (device, reserved) = (e.block.device(), e.block.reserved());
        self.lru.enter(key, &mut e.lru, device, reserved);
    }

    /// Takes the entry out of the LRU until no hold table names it (it is unpublished).
    fn park(&mut self, key: usize) {
        let e = &mut self.objects[key];
        let (device, reserved) = (e.block.device(), e.block.reserved());
        self.lru.leave(&mut e.lru, device, reserved);
        self.publication.park(key, &mut e.listing);
    }

    /// The entry's memory goes now, or, while a hold table still names it, once none does.
    fn free_or_park(&mut self, key: usize) -> Option<Freed> {
        self.publication.unpublish(&mut self.objects[key].listing);
        if self.publication.is_held(&self.objects[key].listing) {
            self.park(key);
            return None;
        }
        Some(self.remove(key))
    }

    /// Removes the entry from every part: its memory is the caller's to free.
    fn remove(&mut self, key: usize) -> Freed {
        let e = &mut self.objects[key];
        let (device, reserved) = (e.block.device(), e.block.reserved());
        self.publication.forget(key, &mut e.listing);
        self.lru.leave(&mut e.lru, device, reserved);
        let e = self.objects.remove(key);
        Freed {
            id: e.id,
            block: e.block,
            name: e.name,
            size: e.size,
        }
    }

    /// Looks again at the parked entries: those no hold table names any more are freed
    /// (deleted ones) or published again and back in the LRU (ones whose eviction a hold
    /// prevented). Run when memory is short, when a client goes, and on the table actor's
    /// timer while any entry is parked.
    pub(crate) fn collect_parked(&mut self) -> Vec<Freed> {
        let mut freed = Vec::new();
        for key in self.publication.unpark_unheld(&mut self.objects) {
            let e = &mut self.objects[key];
            if e.refcount > 0 {
                self.publication.publish(e);
            } else if e.is_kept_unreferenced() {
                self.publication.publish(e);
                self.enter_lru(key);
            } else {
                freed.push(self.remove(key));
            }
        }
        freed
    }

    /// Entries waiting for clients' holds to go.
    pub(crate) fn parked(&self) -> usize {
        self.publication.parked()
    }

    /// Deletes `name`: the name is free at once; the memory is returned now if nobody holds the
    /// object, else when its last holder releases it.
    pub(crate) fn delete(&mut self, name: &ObjectName) -> Result<Option<Freed>, Error> {
        let key = self.objects.named_key(name)?;
        if !self.objects[key].sealed {
            return Err(Error::NotSealed(name.to_string()));
        }
        self.activity
            .record(NotificationKind::Deleted, &self.objects[key]);
        self.activity.deleted(self.objects[key].size);
        Ok(self.unlink(key))
    }

    /// Takes the name from the sealed object `key` (deleted, or replaced by a newer version):
    /// its memory now if nobody holds it, else with its last holder.
    fn unlink(&mut self, key: usize) -> Option<Freed> {
        if self.objects[key].residency.is_away() {
            // Gets waiting for its restore now wait for the name like for any missing one.
            let name = self.objects[key].name.clone();
            let ended = self.waiting.restore_ended(&name, None);
            self.finished.extend(ended);
        }
        self.publication.unpublish(&mut self.objects[key].listing);
        let unreferenced = self.objects[key].refcount == 0;
        if unreferenced && !self.publication.is_held(&self.objects[key].listing) {
            return Some(self.remove(key));
        }
        self.objects.unname(key);
        if unreferenced {
            // Held through a hold table only: gone once no table names it.
            self.park(key);
        }
        None
    }

    /// Releases everything `holder` holds (its connection went away): references dropped,
    /// unsealed objects it created aborted, its waiting gets cancelled.
    pub(crate) fn release_holder(&mut self, holder: HolderId) -> Vec<Freed> {
        let mut freed = Vec::new();
        // Its hold table goes first: a dead client's holds pin nothing.
        if self.publication.detach(holder) {
            freed.extend(self.collect_parked());
        }
        for waiter in self.waiting.of_holder(holder) {
            // The partial results' references belong to the holder and are dropped below.
            self.waiting.finish(waiter);
        }
        for key in self.objects.drop_holder(holder) {
            freed.extend(self.after_release(key));
        }
        freed
    }

    /// True when `name` is sealed and present.
    pub(crate) fn contains(&self, name: &ObjectName) -> bool {
        self.objects.contains(name)
    }

    /// Checks the table's internal invariants: every part's, and the LRU membership rule
    /// (tests and debug builds).
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        self.objects.check()?;
        let mut evictable = 0;
        for (_, e) in self.objects.iter() {
            let resident = e.residency == Residency::Resident;
            let should_be_evictable =
                e.sealed && e.named && e.refcount == 0 && !e.listing.is_parked() && resident;
            if should_be_evictable != e.lru.is_evictable() {
                return Err(format!("{:?}: LRU membership wrong", e.name));
            }
            evictable += usize::from(should_be_evictable);
            if (e.residency == Residency::Spilled) != matches!(e.block, Block::Spilled(_)) {
                return Err(format!(
                    "{:?}: spilled but with memory, or the reverse",
                    e.name
                ));
            }
            if !resident && (!e.sealed || self.publication.is_published(&e.listing)) {
                return Err(format!("{:?}: away from memory but published", e.name));
            }
        }
        if evictable != self.lru.len() {
            return Err(format!(
                "{} entries in the LRU, {evictable} evictable",
                self.lru.len()
            ));
        }
        self.lru.check(|key| {
            self.objects
                .get(key)
                .map(|e| (e.lru, e.block.device(), e.block.reserved()))
        })?;
        self.waiting.check()?;
        self.publication.check(&self.objects)
    }

    /// Number of entries (named or waiting for their last holder).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.objects.len()
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.objects.len() == 0
    }
}
