//! The object table: names, life cycle, per-holder reference counts and the LRU of evictable
//! objects. Plain synchronous data structure (the table actor wraps it), so every rule of the
//! object life cycle is unit-testable without a runtime.
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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::SystemTime;

use slab::Slab;
use tokio::sync::oneshot;
use vovp_types::DeviceBlock;

use crate::allocator::HostBlock;
use crate::shared::{Published, Shared, SharedFds};
use vovp_types::Error;
use vovp_types::*;

/// The memory behind one object, returned to its allocator when the object goes.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Block {
    Host(HostBlock),
    Cuda(DeviceBlock),
    /// Part of a block lent to a client (LEND), which wrote the object there itself: freeing
    /// it gives the lend back one object, and the lend's block goes when its last object does.
    Lent(LentBlock),
}

/// Where an object published from a lend lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LentBlock {
    pub lend: u64,
    pub segment: u32,
    pub offset: u64,
    /// Data padded to 64 bytes plus metadata, rounded to 64: what it occupies of the lend.
    pub charged: u64,
}

impl Block {
    pub(crate) fn location(&self) -> Location {
        match self {
            Block::Host(h) => Location::Host {
                segment: h.segment,
                offset: h.offset,
            },
            Block::Cuda(d) => Location::Cuda(*d),
            Block::Lent(l) => Location::Host {
                segment: l.segment,
                offset: l.offset,
            },
        }
    }

    pub(crate) fn pool(&self) -> Pool {
        match self {
            Block::Host(_) | Block::Lent(_) => Pool::Host,
            Block::Cuda(d) => Pool::Cuda(d.device),
        }
    }

    /// Bytes the object counts against its pool's capacity (what evicting it frees).
    pub(crate) fn reserved(&self) -> u64 {
        match self {
            Block::Host(h) => h.charged,
            Block::Cuda(d) => d.size,
            Block::Lent(l) => l.charged,
        }
    }
}

/// A memory pool with its own capacity and its own LRU: host memory, or one GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Pool {
    Host,
    Cuda(u32),
}

impl From<Device> for Pool {
    fn from(d: Device) -> Self {
        match d {
            Device::Cpu => Pool::Host,
            Device::Cuda(n) => Pool::Cuda(n),
        }
    }
}

struct Entry {
    id: ObjectId,
    name: ObjectName,
    size: u64,
    metadata: Arc<[u8]>,
    block: Block,
    sealed: bool,
    ephemeral: bool,
    /// False once deleted: the name is free again, the memory waits for the last holder.
    named: bool,
    creator: HolderId,
    refcount: u32,
    /// Position in its pool's LRU while evictable (sealed, named, unreferenced, not parked).
    lru_tick: Option<u64>,
    last_access: SystemTime,
    /// Where it is in the shared directory, while published.
    published: Option<Published>,
    /// The generation of its last publication (0: never published): what clients' hold
    /// tables name it by, and so what must be unheld before its memory goes.
    shm_generation: u64,
    /// Out of the LRU and the directory because a hold table still named it when the table
    /// was about to free or evict it; [`ObjectTable::collect_parked`] looks again.
    parked: bool,
    /// Its name's version: given at seal (0 before).
    version: u64,
    /// An unsealed replacement (in `replacements`, not `by_name`): the name is another
    /// object's until this one's seal.
    replacing: bool,
}

impl Entry {
    fn object_ref(&self) -> ObjectRef {
        ObjectRef {
            id: self.id,
            name: self.name.clone(),
            size: self.size,
            metadata: self.metadata.clone(),
            location: self.block.location(),
            version: self.version,
        }
    }
}

/// Results of a batched get, in request order (`None`: not sealed in time).
pub(crate) type GetResults = Vec<Option<ObjectRef>>;

pub(crate) type WaiterId = u64;

struct PendingGet {
    holder: HolderId,
    names: Vec<ObjectName>,
    /// Per name: found once its version is above this (0: any sealed version).
    newer_than: Vec<u64>,
    results: GetResults,
    remaining: usize,
    reply: oneshot::Sender<GetResults>,
}

/// A waiting get that is now complete: the actor sends its results.
pub(crate) struct CompletedGet {
    pub holder: HolderId,
    pub results: GetResults,
    pub reply: oneshot::Sender<GetResults>,
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
    pub block: Block,
    /// Which object it was: the tests check it, logs print it (`Debug`).
    #[allow(dead_code)]
    pub name: ObjectName,
    #[allow(dead_code)]
    pub size: u64,
}

#[derive(Default)]
pub(crate) struct ObjectTable {
    objects: Slab<Entry>,
    by_name: HashMap<ObjectName, usize>,
    /// Unsealed replacements, by name and creator.
    replacements: HashMap<(ObjectName, HolderId), usize>,
    holders: HashMap<HolderId, HashMap<usize, u32>>,
    lru: BTreeMap<Pool, BTreeMap<u64, usize>>,
    evictable: HashMap<Pool, u64>,
    tick: u64,
    incarnation: u32,
    waiters: HashMap<ObjectName, Vec<WaiterId>>,
    pending: HashMap<WaiterId, PendingGet>,
    next_waiter: WaiterId,
    creates: u64,
    evicted_objects: u64,
    evicted_bytes: u64,
    /// When set, changes are recorded in `events` for subscribers.
    pub record_events: bool,
    events: Vec<Notification>,
    /// The shared directory and the clients' hold tables, when the store publishes.
    shared: Option<Shared>,
    /// Keys of parked entries.
    parked: HashSet<usize>,
}

impl ObjectTable {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// A table that publishes its sealed host objects in `shared` (clients then get them
    /// without a message while their hold tables pin them).
    pub(crate) fn with_shared(shared: Shared) -> Self {
        ObjectTable {
            shared: Some(shared),
            ..Self::default()
        }
    }

    /// Gives `holder` its hold table and the directory to map (`None`: not publishing).
    pub(crate) fn attach_shared(&mut self, holder: HolderId) -> Option<Result<SharedFds, Error>> {
        Some(self.shared.as_mut()?.attach(holder))
    }

    /// Whether `holder` has a hold table and takes part in the lend handshake there: only such
    /// a client can be lent memory, because a lend is taken back through it.
    pub(crate) fn takes_part_in_lends(&self, holder: HolderId) -> bool {
        self.shared
            .as_ref()
            .is_some_and(|s| s.takes_part_in_lends(holder))
    }

    /// Takes `holder`'s lend `lend` back if no put of it writes into the lend: `true` when it
    /// may be retired now.
    pub(crate) fn revoke_lend(&self, holder: HolderId, lend: u64) -> bool {
        self.shared
            .as_ref()
            .is_some_and(|s| s.revoke_lend(holder, lend))
    }

    /// `holder` asked for a new lend: no revocation mark stands in its way.
    pub(crate) fn clear_lend_revocation(&self, holder: HolderId) {
        if let Some(s) = self.shared.as_ref() {
            s.clear_lend_revocation(holder);
        }
    }

    /// (holder, pipelined puts it says it sent) of every client with a hold table and a
    /// nonzero count ([`crate::pipelined`]).
    pub(crate) fn puts_sent(&self) -> Vec<(HolderId, u64)> {
        self.shared
            .as_ref()
            .map(Shared::puts_sent)
            .unwrap_or_default()
    }

    /// The directory's read-only fd, when publishing.
    pub(crate) fn shared_directory(&self) -> Option<&std::fs::File> {
        self.shared.as_ref().map(Shared::directory_fd)
    }

    fn key_of(&self, id: ObjectId) -> Option<usize> {
        let key = (id.get() & 0xFFFF_FFFF) as usize;
        match self.objects.get(key) {
            Some(e) if e.id == id => Some(key),
            _ => None,
        }
    }

    /// LRU positions are monotonic nanoseconds (kept unique), so the access stamps clients
    /// leave in their hold tables fold into the same order.
    fn next_tick(&mut self) -> u64 {
        self.tick = (self.tick + 1).max(vovp_shm::now_stamp());
        self.tick
    }

    fn record(&mut self, kind: NotificationKind, key: usize) {
        if self.record_events {
            let e = &self.objects[key];
            self.events.push(Notification {
                kind,
                name: e.name.clone(),
                size: e.size,
                metadata: e.metadata.clone(),
                version: e.version,
            });
        }
    }

    /// Notifications recorded since the last call.
    pub(crate) fn take_events(&mut self) -> Vec<Notification> {
        std::mem::take(&mut self.events)
    }

    /// Fails when `creator` may not create `name` now: the name is taken (sealed or not;
    /// deleted-but-referenced objects do not count) and this is no `replace`, or it is being
    /// created (unsealed) by a plain create, or `creator` is writing a replacement of it
    /// already. Asked before memory is allocated, and again by [`ObjectTable::insert`].
    pub(crate) fn check_name_free(
        &self,
        name: &ObjectName,
        replace: bool,
        creator: HolderId,
    ) -> Result<(), Error> {
        let Some(&key) = self.by_name.get(name) else {
            return Ok(());
        };
        if !replace {
            return Err(Error::AlreadyExists(name.to_string()));
        }
        if !self.objects[key].sealed {
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

    /// Adds an unsealed object in `block`; the creator holds one reference. With `replace`,
    /// a name whose object is sealed gets a replacement (see the module doc).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn insert(
        &mut self,
        name: ObjectName,
        size: u64,
        metadata: Arc<[u8]>,
        block: Block,
        ephemeral: bool,
        replace: bool,
        creator: HolderId,
    ) -> Result<ObjectRef, Error> {
        self.check_name_free(&name, replace, creator)?;
        let replacing = self.by_name.contains_key(&name);
        self.incarnation = self.incarnation.wrapping_add(1);
        let entry = self.objects.vacant_entry();
        let key = entry.key();
        let id = ObjectId::from_raw(((self.incarnation as u64) << 32) | key as u64);
        let e = entry.insert(Entry {
            id,
            name: name.clone(),
            size,
            metadata,
            block,
            sealed: false,
            ephemeral,
            named: !replacing,
            creator,
            refcount: 1,
            lru_tick: None,
            last_access: SystemTime::now(),
            published: None,
            shm_generation: 0,
            parked: false,
            version: 0,
            replacing,
        });
        let r = e.object_ref();
        if replacing {
            self.replacements.insert((name, creator), key);
        } else {
            self.by_name.insert(name, key);
        }
        *self
            .holders
            .entry(creator)
            .or_default()
            .entry(key)
            .or_insert(0) += 1;
        self.creates += 1;
        Ok(r)
    }

    fn named_key(&self, name: &ObjectName) -> Result<usize, Error> {
        self.by_name
            .get(name)
            .copied()
            .ok_or_else(|| Error::NotFound(name.to_string()))
    }

    /// The unsealed object `holder` writes under `name`: its replacement of the name if it
    /// writes one, else the name's object.
    fn key_to_finish(&self, name: &ObjectName, holder: HolderId) -> Result<usize, Error> {
        match self.replacements.get(&(name.clone(), holder)) {
            Some(&key) => Ok(key),
            None => self.named_key(name),
        }
    }

    /// Seals `name` (creator only); with `id`, only that incarnation of it, so a buffer that
    /// outlived its aborted object cannot seal a newer object of the same name (`NotFound`).
    /// A replacement takes the name over as its next version; the previous version is
    /// unlinked as by `delete`.
    pub(crate) fn seal(
        &mut self,
        name: &ObjectName,
        holder: HolderId,
        id: Option<ObjectId>,
    ) -> Result<Sealed, Error> {
        let key = self.key_to_finish(name, holder)?;
        let e = &mut self.objects[key];
        if id.is_some_and(|id| id != e.id) {
            return Err(Error::NotFound(name.to_string()));
        }
        if e.sealed {
            return Err(Error::AlreadySealed(name.to_string()));
        }
        if e.creator != holder {
            return Err(Error::NotCreator(name.to_string()));
        }
        let mut freed = None;
        let mut kind = NotificationKind::Sealed;
        let mut version = 1;
        if e.replacing {
            match self.by_name.get(name).copied() {
                Some(old) if !self.objects[old].sealed => {
                    // The previous version went and a plain create took the name since.
                    return Err(Error::AlreadyExists(format!(
                        "{name} (deleted and being created again since this replace began)"
                    )));
                }
                Some(old) => {
                    version = self.objects[old].version + 1;
                    kind = NotificationKind::Replaced;
                    freed = self.unlink(old);
                }
                None => {}
            }
            self.replacements.remove(&(name.clone(), holder));
            self.by_name.insert(name.clone(), key);
        }
        let e = &mut self.objects[key];
        e.replacing = false;
        e.named = true;
        e.sealed = true;
        e.version = version;
        e.last_access = SystemTime::now();
        self.record(kind, key);
        self.publish_key(key);
        Ok(Sealed {
            version,
            done: self.wake_waiters(name, key),
            freed,
        })
    }

    /// Publishes a sealed, named, non-ephemeral host object in the shared directory. Its
    /// metadata must already be in its block, after the data padded to [`ALIGNMENT`] (the
    /// table actor writes it there at create). Unpublished objects are still served over the
    /// socket, so a full directory costs speed only.
    fn publish_key(&mut self, key: usize) {
        let Some(shared) = self.shared.as_mut() else {
            return;
        };
        let e = &mut self.objects[key];
        let Location::Host { segment, offset } = e.block.location() else {
            return;
        };
        if !e.sealed || !e.named || e.ephemeral || e.parked || e.published.is_some() {
            return;
        }
        let Some(meta_offset) = e
            .size
            .checked_next_multiple_of(ALIGNMENT)
            .and_then(|d| offset.checked_add(d))
        else {
            return;
        };
        let published = shared.publish(&vovp_shm::Publish {
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
            e.published = Some(p);
            e.shm_generation = p.generation;
        }
    }

    fn unpublish_key(&mut self, key: usize) {
        if let (Some(shared), Some(p)) = (self.shared.as_mut(), self.objects[key].published.take())
        {
            shared.unpublish(p);
        }
    }

    /// Whether a hold table names the entry's last publication (after it was unpublished).
    fn shared_held(&self, key: usize) -> bool {
        let g = self.objects[key].shm_generation;
        g != 0 && self.shared.as_ref().is_some_and(|s| s.is_held(g))
    }

    /// Every generation held now (fence first: call after unpublishing).
    fn held_generations(&self) -> HashSet<u64> {
        self.shared.as_ref().map(Shared::held).unwrap_or_default()
    }

    /// Takes the entry out of the LRU and the directory until no hold table names it.
    fn park(&mut self, key: usize) {
        let e = &mut self.objects[key];
        e.parked = true;
        let pool = e.block.pool();
        let reserved = e.block.reserved();
        if let Some(t) = e.lru_tick.take() {
            self.unlink_lru(pool, t, reserved);
        }
        self.parked.insert(key);
    }

    /// The entry's memory goes now, or, while a hold table still names it, once none does.
    fn free_or_park(&mut self, key: usize) -> Option<Freed> {
        self.unpublish_key(key);
        if self.shared_held(key) {
            self.park(key);
            return None;
        }
        Some(self.remove(key))
    }

    /// Looks again at the parked entries: those no hold table names any more are freed
    /// (deleted ones) or published again and back in the LRU (ones whose eviction a hold
    /// prevented). Run when memory is short, when a client goes, and on the table actor's
    /// timer while any entry is parked.
    pub(crate) fn collect_parked(&mut self) -> Vec<Freed> {
        if self.parked.is_empty() {
            return Vec::new();
        }
        let held = self.held_generations();
        let ready: Vec<usize> = self
            .parked
            .iter()
            .copied()
            .filter(|&k| !held.contains(&self.objects[k].shm_generation))
            .collect();
        let mut freed = Vec::new();
        for key in ready {
            self.parked.remove(&key);
            let e = &mut self.objects[key];
            e.parked = false;
            if e.refcount > 0 {
                self.publish_key(key);
            } else if e.named && e.sealed && !e.ephemeral {
                self.publish_key(key);
                self.enter_lru(key);
            } else {
                freed.push(self.remove(key));
            }
        }
        freed
    }

    /// Entries waiting for clients' holds to go.
    pub(crate) fn parked(&self) -> usize {
        self.parked.len()
    }

    fn wake_waiters(&mut self, name: &ObjectName, key: usize) -> Vec<CompletedGet> {
        let Some(waiting) = self.waiters.remove(name) else {
            return Vec::new();
        };
        let version = self.objects[key].version;
        let mut done = Vec::new();
        let mut still = Vec::new();
        for waiter in waiting {
            let Some(p) = self.pending.get(&waiter) else {
                continue;
            };
            let holder = p.holder;
            let wanted = |i: usize| p.results[i].is_none() && &p.names[i] == name;
            let slots: Vec<usize> = (0..p.names.len())
                .filter(|&i| wanted(i) && version > p.newer_than[i])
                .collect();
            // Waiting for a version newer than this one: still waiting.
            if (0..p.names.len()).any(|i| wanted(i) && version <= p.newer_than[i]) {
                still.push(waiter);
            }
            for i in slots {
                let r = self.take_ref(key, holder);
                let p = self.pending.get_mut(&waiter).expect("pending get present");
                p.results[i] = Some(r);
                p.remaining -= 1;
            }
            if self.pending[&waiter].remaining == 0 {
                let p = self.pending.remove(&waiter).expect("pending get present");
                done.push(CompletedGet {
                    holder: p.holder,
                    results: p.results,
                    reply: p.reply,
                });
            }
        }
        if !still.is_empty() {
            self.waiters.insert(name.clone(), still);
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
        let key = self.key_to_finish(name, holder)?;
        let e = &mut self.objects[key];
        if e.sealed {
            return Err(Error::AlreadySealed(name.to_string()));
        }
        if e.creator != holder {
            return Err(Error::NotCreator(name.to_string()));
        }
        if keep_while_held {
            if e.replacing {
                e.replacing = false;
                self.replacements.remove(&(name.clone(), holder));
            } else {
                e.named = false;
                self.by_name.remove(name);
            }
            return Ok(None);
        }
        if let Some(held) = self.holders.get_mut(&holder) {
            held.remove(&key);
            if held.is_empty() {
                self.holders.remove(&holder);
            }
        }
        Ok(Some(self.remove(key)))
    }

    fn take_ref(&mut self, key: usize, holder: HolderId) -> ObjectRef {
        let e = &mut self.objects[key];
        e.refcount += 1;
        e.last_access = SystemTime::now();
        let pool = e.block.pool();
        let reserved = e.block.reserved();
        let was_evictable = e.lru_tick.take();
        let r = e.object_ref();
        if let Some(t) = was_evictable {
            self.unlink_lru(pool, t, reserved);
        }
        *self
            .holders
            .entry(holder)
            .or_default()
            .entry(key)
            .or_insert(0) += 1;
        r
    }

    fn unlink_lru(&mut self, pool: Pool, tick: u64, reserved: u64) {
        if let Some(l) = self.lru.get_mut(&pool) {
            l.remove(&tick);
        }
        if let Some(b) = self.evictable.get_mut(&pool) {
            *b -= reserved;
        }
    }

    /// A reference to `name` if it is sealed now, as a version above `newer_than`.
    pub(crate) fn get_now(
        &mut self,
        name: &ObjectName,
        newer_than: u64,
        holder: HolderId,
    ) -> Option<ObjectRef> {
        let key = *self.by_name.get(name)?;
        let e = &self.objects[key];
        if !e.sealed || e.version <= newer_than {
            return None;
        }
        Some(self.take_ref(key, holder))
    }

    /// Gets every name; when some are missing and `wait` is set, registers a waiter whose
    /// results go to `reply` (as soon as all are sealed, or at timeout through `finish_waiter`).
    /// `newer_than`: per name, the version it must be above (empty: any sealed version).
    pub(crate) fn begin_get(
        &mut self,
        holder: HolderId,
        names: Vec<ObjectName>,
        newer_than: Vec<u64>,
        wait: bool,
        reply: oneshot::Sender<GetResults>,
    ) -> Result<WaiterId, (GetResults, oneshot::Sender<GetResults>)> {
        let mut newer_than = newer_than;
        newer_than.resize(names.len(), 0);
        let results: GetResults = names
            .iter()
            .zip(&newer_than)
            .map(|(n, &v)| self.get_now(n, v, holder))
            .collect();
        let remaining = results.iter().filter(|r| r.is_none()).count();
        if remaining == 0 || !wait {
            return Err((results, reply));
        }
        self.next_waiter += 1;
        let waiter = self.next_waiter;
        for (n, r) in names.iter().zip(&results) {
            if r.is_none() {
                let w = self.waiters.entry(n.clone()).or_default();
                if w.last() != Some(&waiter) {
                    w.push(waiter);
                }
            }
        }
        self.pending.insert(
            waiter,
            PendingGet {
                holder,
                names,
                newer_than,
                results,
                remaining,
                reply,
            },
        );
        Ok(waiter)
    }

    /// Ends a waiting get (timeout): its partial results, or `None` if it completed already.
    pub(crate) fn finish_waiter(&mut self, waiter: WaiterId) -> Option<CompletedGet> {
        let p = self.pending.remove(&waiter)?;
        for n in &p.names {
            if let Some(w) = self.waiters.get_mut(n) {
                w.retain(|x| *x != waiter);
                if w.is_empty() {
                    self.waiters.remove(n);
                }
            }
        }
        Some(CompletedGet {
            holder: p.holder,
            results: p.results,
            reply: p.reply,
        })
    }

    /// Drops one reference of `holder` to object `id`. Returns the memory to free when that was
    /// the last reference of a deleted, ephemeral or unsealed object.
    pub(crate) fn release(
        &mut self,
        id: ObjectId,
        holder: HolderId,
    ) -> Result<Option<Freed>, Error> {
        let key = self.key_of(id).ok_or(Error::NotHeld(id.get()))?;
        let held = self
            .holders
            .get_mut(&holder)
            .and_then(|h| h.get_mut(&key))
            .ok_or(Error::NotHeld(id.get()))?;
        *held -= 1;
        if *held == 0 {
            let h = self.holders.get_mut(&holder).expect("holder present");
            h.remove(&key);
            if h.is_empty() {
                self.holders.remove(&holder);
            }
        }
        Ok(self.drop_refs(key, 1))
    }

    fn drop_refs(&mut self, key: usize, count: u32) -> Option<Freed> {
        let e = &mut self.objects[key];
        e.refcount -= count;
        if e.refcount > 0 {
            return None;
        }
        if !e.sealed || !e.named || e.ephemeral {
            if e.named && e.sealed {
                self.record(NotificationKind::Deleted, key);
            }
            return self.free_or_park(key);
        }
        if !e.parked {
            self.enter_lru(key);
        }
        None
    }

    fn enter_lru(&mut self, key: usize) {
        let tick = self.next_tick();
        let e = &mut self.objects[key];
        let pool = e.block.pool();
        let reserved = e.block.reserved();
        e.lru_tick = Some(tick);
        self.lru.entry(pool).or_default().insert(tick, key);
        *self.evictable.entry(pool).or_insert(0) += reserved;
    }

    fn remove(&mut self, key: usize) -> Freed {
        self.unpublish_key(key);
        self.parked.remove(&key);
        let e = self.objects.remove(key);
        if e.named {
            self.by_name.remove(&e.name);
        }
        if e.replacing {
            self.replacements.remove(&(e.name.clone(), e.creator));
        }
        if let Some(t) = e.lru_tick {
            self.unlink_lru(e.block.pool(), t, e.block.reserved());
        }
        Freed {
            block: e.block,
            name: e.name,
            size: e.size,
        }
    }

    /// Deletes `name`: the name is free at once; the memory is returned now if nobody holds the
    /// object, else when its last holder releases it.
    pub(crate) fn delete(&mut self, name: &ObjectName) -> Result<Option<Freed>, Error> {
        let key = self.named_key(name)?;
        if !self.objects[key].sealed {
            return Err(Error::NotSealed(name.to_string()));
        }
        self.record(NotificationKind::Deleted, key);
        Ok(self.unlink(key))
    }

    /// Takes the name from the sealed object `key` (deleted, or replaced by a newer version):
    /// its memory now if nobody holds it, else with its last holder.
    fn unlink(&mut self, key: usize) -> Option<Freed> {
        self.unpublish_key(key);
        if self.objects[key].refcount == 0 && !self.shared_held(key) {
            return Some(self.remove(key));
        }
        let e = &mut self.objects[key];
        e.named = false;
        let n = e.name.clone();
        self.by_name.remove(&n);
        if self.objects[key].refcount == 0 {
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
        if self.shared.as_mut().is_some_and(|s| s.detach(holder)) {
            freed.extend(self.collect_parked());
        }
        let waiting: Vec<WaiterId> = self
            .pending
            .iter()
            .filter(|(_, p)| p.holder == holder)
            .map(|(w, _)| *w)
            .collect();
        for w in waiting {
            // The partial results' references belong to the holder and are dropped below.
            self.finish_waiter(w);
        }
        if let Some(held) = self.holders.remove(&holder) {
            for (key, count) in held {
                freed.extend(self.drop_refs(key, count));
            }
        }
        freed
    }

    /// Objects that eviction could free in `pool` now.
    pub(crate) fn evictable_objects(&self, pool: Pool) -> usize {
        self.lru.get(&pool).map_or(0, BTreeMap::len)
    }

    /// Bytes that eviction could free in `pool` now.
    pub(crate) fn evictable_bytes(&self, pool: Pool) -> u64 {
        self.evictable.get(&pool).copied().unwrap_or(0)
    }

    /// Evicts least-recently-used unreferenced sealed objects of `pool` until at least `bytes`
    /// are freed or none is left.
    ///
    /// Objects a client's hold table names are skipped. Candidates are unpublished, then
    /// checked again (a client may have taken a hold between the first look and the
    /// unpublish): those now held are parked instead of evicted, and the next candidates
    /// tried, so every round either evicts, parks or stops.
    pub(crate) fn evict(&mut self, pool: Pool, bytes: u64) -> Vec<Freed> {
        self.fold_access_stamps();
        let mut held = self.held_generations();
        let mut freed = Vec::new();
        let mut total = 0;
        while total < bytes {
            let need = bytes - total;
            let mut candidates = Vec::new();
            let mut candidate_bytes = 0;
            for &key in self.lru.get(&pool).into_iter().flat_map(|l| l.values()) {
                let e = &self.objects[key];
                if e.shm_generation != 0 && held.contains(&e.shm_generation) {
                    continue;
                }
                candidates.push(key);
                candidate_bytes += e.block.reserved();
                if candidate_bytes >= need {
                    break;
                }
            }
            if candidates.is_empty() {
                break;
            }
            for &key in &candidates {
                self.unpublish_key(key);
            }
            let held_now = self.held_generations();
            for key in candidates {
                let g = self.objects[key].shm_generation;
                if g != 0 && held_now.contains(&g) {
                    self.park(key);
                    held.insert(g);
                    continue;
                }
                let e = &mut self.objects[key];
                let reserved = e.block.reserved();
                if let Some(t) = e.lru_tick.take() {
                    self.unlink_lru(pool, t, reserved);
                }
                self.record(NotificationKind::Evicted, key);
                let f = self.remove(key);
                total += reserved;
                self.evicted_objects += 1;
                self.evicted_bytes += f.block.reserved();
                freed.push(f);
            }
        }
        freed
    }

    /// Moves objects that clients got through their hold tables since they entered the LRU
    /// to where those gets put them (a get without a message leaves only a stamp).
    fn fold_access_stamps(&mut self) {
        let Some(stamps) = self.shared.as_ref().map(Shared::stamps) else {
            return;
        };
        let now = vovp_shm::now_stamp();
        for (object_id, stamp) in stamps {
            let Some(key) = self.key_of(ObjectId::from_raw(object_id)) else {
                continue;
            };
            // A client's stamp is not trusted to lie in the future.
            let stamp = stamp.min(now);
            let e = &self.objects[key];
            let Some(old) = e.lru_tick.filter(|&t| t < stamp) else {
                continue;
            };
            let pool = e.block.pool();
            let Some(l) = self.lru.get_mut(&pool) else {
                continue;
            };
            let mut tick = stamp;
            while l.contains_key(&tick) {
                tick += 1;
            }
            l.remove(&old);
            l.insert(tick, key);
            self.tick = self.tick.max(tick);
            self.objects[key].lru_tick = Some(tick);
        }
    }

    /// True when `name` is sealed and present.
    pub(crate) fn contains(&self, name: &ObjectName) -> bool {
        self.by_name
            .get(name)
            .is_some_and(|&k| self.objects[k].sealed)
    }

    pub(crate) fn list(&self) -> Vec<ObjectInfo> {
        let holds = self.hold_counts();
        let mut v: Vec<ObjectInfo> = self
            .by_name
            .values()
            .map(|&k| self.info(k, &holds))
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// Holds through hold tables, per generation (a snapshot).
    fn hold_counts(&self) -> HashMap<u64, u32> {
        self.shared
            .as_ref()
            .map(|s| s.hold_counts())
            .unwrap_or_default()
    }

    /// `holds`: [`ObjectTable::hold_counts`]; an object's reference count includes them.
    fn info(&self, key: usize, holds: &HashMap<u64, u32>) -> ObjectInfo {
        let e = &self.objects[key];
        let shared = match e.shm_generation {
            0 => 0,
            g => holds.get(&g).copied().unwrap_or(0),
        };
        ObjectInfo {
            id: e.id,
            name: e.name.clone(),
            size: e.size,
            device: e.block.location().device(),
            sealed: e.sealed,
            ephemeral: e.ephemeral,
            refcount: e.refcount + shared,
            last_access: e.last_access,
            metadata: e.metadata.clone(),
            version: e.version,
        }
    }

    /// One page of named objects in table order, from cursor `start`: at most `limit` entries
    /// and (after the first) at most `max_bytes` of `entry_bytes`. Returns the page and the
    /// cursor of the next one (`None` after the last). The cost is that of the page, not of the
    /// table, and objects created or removed between pages may or may not be seen (no
    /// snapshot), but every object present throughout is listed exactly once.
    pub(crate) fn list_page(
        &self,
        start: u64,
        limit: usize,
        max_bytes: usize,
        entry_bytes: impl Fn(&ObjectInfo) -> usize,
    ) -> (Vec<ObjectInfo>, Option<u64>) {
        let holds = self.hold_counts();
        let mut page = Vec::new();
        let mut bytes = 0usize;
        let end = self.objects.capacity();
        let mut key = usize::try_from(start).unwrap_or(usize::MAX);
        while key < end {
            if page.len() >= limit || bytes >= max_bytes {
                return (page, Some(key as u64));
            }
            if let Some(e) = self.objects.get(key) {
                if e.named {
                    let info = self.info(key, &holds);
                    bytes = bytes.saturating_add(entry_bytes(&info));
                    page.push(info);
                }
            }
            key += 1;
        }
        (page, None)
    }

    /// Counters (capacity and used bytes are the allocator's and are filled by the caller).
    pub(crate) fn stats(&self) -> StoreStats {
        let holds = self.hold_counts();
        let holding = self
            .shared
            .as_ref()
            .map(Shared::holders_holding)
            .unwrap_or_default();
        let holders = self.holders.len()
            + holding
                .iter()
                .filter(|h| !self.holders.contains_key(h))
                .count();
        let named = self.by_name.len() + self.replacements.len();
        let mut s = StoreStats {
            objects: named as u64,
            pending_delete: (self.objects.len() - named) as u64,
            holders: holders as u64,
            creates: self.creates,
            evicted_objects: self.evicted_objects,
            evicted_bytes: self.evicted_bytes,
            waiting_gets: self.pending.len() as u64,
            ..Default::default()
        };
        for (_, e) in &self.objects {
            let shared = match e.shm_generation {
                0 => 0,
                g => holds.get(&g).copied().unwrap_or(0) as u64,
            };
            s.shared_holds += shared;
            s.references += e.refcount as u64 + shared;
            if e.named || e.replacing {
                if e.sealed {
                    s.sealed += 1;
                } else {
                    s.unsealed += 1;
                }
            }
        }
        s
    }

    /// Checks the table's internal invariants (tests and debug builds).
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        let mut counted: HashMap<usize, u32> = HashMap::new();
        for held in self.holders.values() {
            for (&k, &c) in held {
                if c == 0 {
                    return Err(format!("zero count kept for key {k}"));
                }
                *counted.entry(k).or_insert(0) += c;
            }
        }
        for (k, e) in &self.objects {
            let c = counted.get(&k).copied().unwrap_or(0);
            if c != e.refcount {
                return Err(format!(
                    "{:?}: refcount {} but holders hold {c}",
                    e.name, e.refcount
                ));
            }
            let should_be_evictable = e.sealed && e.named && e.refcount == 0 && !e.parked;
            if should_be_evictable != e.lru_tick.is_some() {
                return Err(format!("{:?}: LRU membership wrong", e.name));
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
        for (pool, l) in &self.lru {
            let sum: u64 = l.values().map(|&k| self.objects[k].block.reserved()).sum();
            if sum != self.evictable_bytes(*pool) {
                return Err(format!(
                    "{pool:?}: evictable bytes {} != {sum}",
                    self.evictable_bytes(*pool)
                ));
            }
        }
        Ok(())
    }

    /// Number of entries (named or waiting for their last holder).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.objects.len()
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.objects.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: HolderId = HolderId::from_raw(1);
    const B: HolderId = HolderId::from_raw(2);
    const POOL: Pool = Pool::Cuda(0);

    fn n(s: &str) -> ObjectName {
        ObjectName::new(s).unwrap()
    }

    /// A device block: plain data, so the table is tested without any allocator.
    fn block(offset: u64, size: u64) -> Block {
        Block::Cuda(DeviceBlock {
            device: 0,
            pool: 0,
            ipc_handle: [0; 64],
            offset,
            size,
        })
    }

    fn insert(t: &mut ObjectTable, name: &str, size: u64, ephemeral: bool) -> ObjectRef {
        let offset = t.len() as u64 * 4096;
        t.insert(
            n(name),
            size,
            Arc::from(&b"m"[..]),
            block(offset, size),
            ephemeral,
            false,
            A,
        )
        .unwrap()
    }

    /// A sealed object nobody holds (in the LRU).
    fn put(t: &mut ObjectTable, name: &str, size: u64) -> ObjectRef {
        let r = insert(t, name, size, false);
        assert!(t.seal(&n(name), A, Some(r.id)).unwrap().done.is_empty());
        assert!(t.release(r.id, A).unwrap().is_none());
        r
    }

    fn ok(t: &ObjectTable) {
        t.check_invariants().unwrap();
    }

    fn refcount(t: &ObjectTable, name: &str) -> u32 {
        t.list()
            .into_iter()
            .find(|i| i.name.as_str() == name)
            .map(|i| i.refcount)
            .unwrap()
    }

    fn names(freed: &[Freed]) -> Vec<&str> {
        freed.iter().map(|f| f.name.as_str()).collect()
    }

    #[test]
    fn life_cycle_create_seal_get_release() {
        let mut t = ObjectTable::new();
        let r = insert(&mut t, "x", 100, false);
        assert_eq!(r.size, 100);
        ok(&t);
        // Unsealed: invisible to gets and contains, but its name is taken.
        assert!(!t.contains(&n("x")));
        assert!(t.get_now(&n("x"), 0, B).is_none());
        assert_eq!(
            t.check_name_free(&n("x"), false, A),
            Err(Error::AlreadyExists("x".into()))
        );
        let s = t.stats();
        assert_eq!(
            (s.objects, s.unsealed, s.sealed, s.references),
            (1, 1, 0, 1)
        );

        t.seal(&n("x"), A, None).unwrap();
        assert!(t.contains(&n("x")));
        let g = t.get_now(&n("x"), 0, B).unwrap();
        assert_eq!(g.id, r.id);
        assert_eq!(refcount(&t, "x"), 2);
        ok(&t);

        assert!(t.release(r.id, A).unwrap().is_none());
        assert!(t.release(g.id, B).unwrap().is_none());
        // Sealed and unreferenced: kept, and evictable.
        assert!(t.contains(&n("x")));
        assert_eq!(t.evictable_objects(POOL), 1);
        assert_eq!(t.evictable_bytes(POOL), 100);
        let s = t.stats();
        assert_eq!((s.sealed, s.references, s.holders, s.creates), (1, 0, 0, 1));
        ok(&t);
    }

    #[test]
    fn only_the_creator_seals_or_aborts_and_only_once() {
        let mut t = ObjectTable::new();
        let r = insert(&mut t, "x", 8, false);
        assert_eq!(
            t.seal(&n("x"), B, None).err(),
            Some(Error::NotCreator("x".into()))
        );
        assert_eq!(
            t.abort(&n("x"), B, false).err(),
            Some(Error::NotCreator("x".into()))
        );
        // An id of another incarnation is not this object.
        let stale = ObjectId::from_raw(r.id.get() ^ (1 << 40));
        assert_eq!(
            t.seal(&n("x"), A, Some(stale)).err(),
            Some(Error::NotFound("x".into()))
        );
        t.seal(&n("x"), A, Some(r.id)).unwrap();
        assert_eq!(
            t.seal(&n("x"), A, None).err(),
            Some(Error::AlreadySealed("x".into()))
        );
        assert_eq!(
            t.abort(&n("x"), A, false).err(),
            Some(Error::AlreadySealed("x".into()))
        );
        assert_eq!(
            t.seal(&n("nope"), A, None).err(),
            Some(Error::NotFound("nope".into()))
        );
        ok(&t);
    }

    #[test]
    fn abort_frees_now_or_with_the_creators_reference() {
        let mut t = ObjectTable::new();
        insert(&mut t, "now", 8, false);
        let freed = t.abort(&n("now"), A, false).unwrap().unwrap();
        assert_eq!(freed.name.as_str(), "now");
        assert!(t.is_empty());
        ok(&t);

        // keep_while_held: the name is free at once, the memory goes with the release.
        let r = insert(&mut t, "later", 8, false);
        assert!(t.abort(&n("later"), A, true).unwrap().is_none());
        assert!(t.check_name_free(&n("later"), false, A).is_ok());
        assert_eq!(t.len(), 1);
        ok(&t);
        let freed = t.release(r.id, A).unwrap().unwrap();
        assert_eq!(freed.name.as_str(), "later");
        assert!(t.is_empty());
        ok(&t);
    }

    #[test]
    fn releasing_the_creators_reference_of_an_unsealed_object_aborts_it() {
        let mut t = ObjectTable::new();
        let r = insert(&mut t, "x", 8, false);
        let freed = t.release(r.id, A).unwrap().unwrap();
        assert_eq!(freed.name.as_str(), "x");
        assert!(t.check_name_free(&n("x"), false, A).is_ok());
        ok(&t);
    }

    #[test]
    fn references_count_per_holder_and_per_get() {
        let mut t = ObjectTable::new();
        let r = put(&mut t, "x", 64);
        let a1 = t.get_now(&n("x"), 0, A).unwrap();
        let a2 = t.get_now(&n("x"), 0, A).unwrap();
        let b1 = t.get_now(&n("x"), 0, B).unwrap();
        assert_eq!(refcount(&t, "x"), 3);
        assert_eq!(t.stats().holders, 2);
        // Referenced: out of the LRU.
        assert_eq!(t.evictable_objects(POOL), 0);
        assert!(t.evict(POOL, u64::MAX).is_empty());
        ok(&t);

        t.release(a1.id, A).unwrap();
        // B holds one reference; a second release of it is refused and changes nothing.
        t.release(b1.id, B).unwrap();
        assert_eq!(t.release(b1.id, B).err(), Some(Error::NotHeld(r.id.get())));
        assert_eq!(refcount(&t, "x"), 1);
        assert_eq!(t.stats().holders, 1);
        ok(&t);
        t.release(a2.id, A).unwrap();
        assert_eq!(t.release(a2.id, A).err(), Some(Error::NotHeld(r.id.get())));
        assert_eq!(refcount(&t, "x"), 0);
        assert_eq!(t.evictable_objects(POOL), 1);
        // An id that never existed.
        let bogus = ObjectId::from_raw(0xdead_0000_0042);
        assert_eq!(t.release(bogus, A).err(), Some(Error::NotHeld(bogus.get())));
        ok(&t);
    }

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
        assert_eq!(t.evictable_objects(POOL), 3);
        assert_eq!(t.evictable_bytes(POOL), 300);

        // At least one byte: exactly the least recently used object.
        let freed = t.evict(POOL, 1);
        assert_eq!(names(&freed), ["c"]);
        // Other pools are not touched.
        assert!(t.evict(Pool::Cuda(1), u64::MAX).is_empty());
        assert!(t.evict(Pool::Host, u64::MAX).is_empty());
        let freed = t.evict(POOL, 150);
        assert_eq!(names(&freed), ["d", "a"]);
        assert!(t.evict(POOL, u64::MAX).is_empty());
        assert!(t.contains(&n("b")));
        let s = t.stats();
        assert_eq!((s.evicted_objects, s.evicted_bytes), (3, 300));
        assert!(!t.contains(&n("a")) && t.check_name_free(&n("a"), false, A).is_ok());
        ok(&t);
    }

    #[test]
    fn delete_while_held_frees_the_name_now_and_the_memory_at_the_last_release() {
        let mut t = ObjectTable::new();
        t.record_events = true;
        let old = put(&mut t, "x", 64);
        let held = t.get_now(&n("x"), 0, B).unwrap();
        t.take_events();
        assert!(t.delete(&n("x")).unwrap().is_none());
        assert!(!t.contains(&n("x")));
        assert_eq!(t.delete(&n("x")).err(), Some(Error::NotFound("x".into())));
        let s = t.stats();
        assert_eq!((s.objects, s.pending_delete), (0, 1));
        ok(&t);

        // The name is free for a new object with a new id; the old reference still counts.
        let new = put(&mut t, "x", 32);
        assert_ne!(new.id, old.id);
        assert_eq!(t.get_now(&n("x"), 0, A).unwrap().id, new.id);
        ok(&t);
        let freed = t.release(held.id, B).unwrap().unwrap();
        assert_eq!((freed.name.as_str(), freed.size), ("x", 64));
        assert_eq!(t.stats().pending_delete, 0);
        assert!(t.contains(&n("x")));
        // One Deleted notification, at the delete (none at the memory's release).
        let kinds: Vec<_> = t.take_events().iter().map(|e| e.kind).collect();
        assert_eq!(kinds, [NotificationKind::Deleted, NotificationKind::Sealed]);
        ok(&t);

        // Unsealed objects cannot be deleted; unreferenced ones go at once.
        insert(&mut t, "u", 8, false);
        assert_eq!(t.delete(&n("u")).err(), Some(Error::NotSealed("u".into())));
        put(&mut t, "free", 8);
        assert_eq!(t.delete(&n("free")).unwrap().unwrap().name.as_str(), "free");
        ok(&t);
    }

    #[test]
    fn ephemeral_objects_go_at_their_last_release() {
        let mut t = ObjectTable::new();
        t.record_events = true;
        let r = insert(&mut t, "e", 8, true);
        t.seal(&n("e"), A, None).unwrap();
        let other = t.get_now(&n("e"), 0, B).unwrap();
        assert!(t.release(r.id, A).unwrap().is_none());
        // Never in the LRU, even when unreferenced for a moment.
        assert_eq!(t.evictable_objects(POOL), 0);
        t.take_events();
        let freed = t.release(other.id, B).unwrap().unwrap();
        assert_eq!(freed.name.as_str(), "e");
        assert!(!t.contains(&n("e")));
        assert!(t.is_empty());
        let kinds: Vec<_> = t.take_events().iter().map(|e| e.kind).collect();
        assert_eq!(kinds, [NotificationKind::Deleted]);
        ok(&t);
    }

    #[test]
    fn a_waiting_get_completes_when_the_last_name_is_sealed() {
        let mut t = ObjectTable::new();
        put(&mut t, "ready", 8);
        let (tx, mut rx) = oneshot::channel();
        let names = vec![n("ready"), n("later"), n("later")];
        let waiter = t.begin_get(B, names, Vec::new(), true, tx).ok().unwrap();
        // "ready" is already held by the waiting get.
        assert_eq!(refcount(&t, "ready"), 1);
        assert!(rx.try_recv().is_err());

        let r = insert(&mut t, "later", 8, false);
        ok(&t);
        let done = t.seal(&n("later"), A, None).unwrap().done;
        assert_eq!(done.len(), 1);
        let d = done.into_iter().next().unwrap();
        assert_eq!(d.holder, B);
        d.reply.send(d.results).unwrap();
        let results = rx.try_recv().unwrap();
        let ids: Vec<_> = results
            .iter()
            .map(|r| r.as_ref().unwrap().name.as_str())
            .collect();
        assert_eq!(ids, ["ready", "later", "later"]);
        // One reference per slot, both to the same object.
        assert_eq!(refcount(&t, "later"), 3);
        t.release(r.id, A).unwrap();
        // Finished: a late timeout finds nothing.
        assert!(t.finish_waiter(waiter).is_none());
        ok(&t);
    }

    #[test]
    fn a_get_that_times_out_keeps_its_partial_results_and_waits_no_more() {
        let mut t = ObjectTable::new();
        put(&mut t, "a", 8);
        let (tx, _rx) = oneshot::channel();
        let waiter = t
            .begin_get(B, vec![n("a"), n("b")], Vec::new(), true, tx)
            .ok()
            .unwrap();
        let done = t.finish_waiter(waiter).unwrap();
        assert!(done.results[0].is_some() && done.results[1].is_none());
        assert_eq!(refcount(&t, "a"), 1);
        // A seal after the timeout completes nothing and takes no reference for B.
        insert(&mut t, "b", 8, false);
        assert!(t.seal(&n("b"), A, None).unwrap().done.is_empty());
        assert_eq!(refcount(&t, "b"), 1);
        ok(&t);

        // Without waiting, missing names answer None at once.
        let (tx, _rx) = oneshot::channel();
        let (results, _tx) = t
            .begin_get(B, vec![n("zz"), n("a")], Vec::new(), false, tx)
            .unwrap_err();
        assert!(results[0].is_none() && results[1].is_some());
        ok(&t);
    }

    #[test]
    fn releasing_a_holder_drops_everything_it_held() {
        let mut t = ObjectTable::new();
        put(&mut t, "kept", 8);
        let _k1 = t.get_now(&n("kept"), 0, B).unwrap();
        let _k2 = t.get_now(&n("kept"), 0, B).unwrap();
        let _k3 = t.get_now(&n("kept"), 0, A).unwrap();
        // B created an unsealed object and waits for a name nobody has sealed yet.
        t.insert(
            n("draft"),
            8,
            Arc::from(&[][..]),
            block(1 << 20, 8),
            false,
            false,
            B,
        )
        .unwrap();
        let (tx, mut rx) = oneshot::channel();
        t.begin_get(B, vec![n("kept"), n("never")], Vec::new(), true, tx)
            .ok()
            .unwrap();
        assert_eq!(refcount(&t, "kept"), 4);
        ok(&t);

        let freed = t.release_holder(B);
        assert_eq!(names(&freed), ["draft"]);
        assert!(t.check_name_free(&n("draft"), false, A).is_ok());
        assert_eq!(refcount(&t, "kept"), 1);
        assert_eq!(t.stats().holders, 1);
        // The waiting get is gone: its reply is dropped, and a later seal wakes nobody.
        assert!(matches!(
            rx.try_recv(),
            Err(oneshot::error::TryRecvError::Closed)
        ));
        insert(&mut t, "never", 8, false);
        assert!(t.seal(&n("never"), A, None).unwrap().done.is_empty());
        ok(&t);
        // Nothing left to release: a second call is a no-op.
        assert!(t.release_holder(B).is_empty());
        ok(&t);
    }

    #[test]
    fn list_pages_cover_every_object_once() {
        let mut t = ObjectTable::new();
        for i in 0..10 {
            put(&mut t, &format!("o{i}"), 8);
        }
        // A deleted-but-held object is not listed.
        let held = t.get_now(&n("o3"), 0, B).unwrap();
        t.delete(&n("o3")).unwrap();
        let mut seen = Vec::new();
        let mut cursor = Some(0);
        let mut pages = 0;
        while let Some(start) = cursor {
            let (page, next) = t.list_page(start, 3, usize::MAX, |_| 1);
            assert!(page.len() <= 3);
            seen.extend(page.into_iter().map(|i| i.name.to_string()));
            cursor = next;
            pages += 1;
        }
        seen.sort();
        let mut want: Vec<String> = (0..10)
            .filter(|&i| i != 3)
            .map(|i| format!("o{i}"))
            .collect();
        want.sort();
        assert_eq!(seen, want);
        assert!(pages >= 3);
        // The byte bound stops a page after the entry that reaches it (always at least one).
        let (page, next) = t.list_page(0, 100, 1, |_| 10);
        assert_eq!(page.len(), 1);
        assert!(next.is_some());
        t.release(held.id, B).unwrap();
        ok(&t);
    }

    fn replace(
        t: &mut ObjectTable,
        name: &str,
        size: u64,
        by: HolderId,
    ) -> Result<ObjectRef, Error> {
        let offset = (t.len() as u64 + 64) * 4096;
        t.insert(
            n(name),
            size,
            Arc::from(&b"m"[..]),
            block(offset, size),
            false,
            true,
            by,
        )
    }

    #[test]
    fn a_replace_takes_the_name_at_its_seal_and_readers_keep_the_old_version() {
        let mut t = ObjectTable::new();
        t.record_events = true;
        let v1 = put(&mut t, "w", 64);
        let held = t.get_now(&n("w"), 0, B).unwrap();
        assert_eq!(held.version, 1);
        // Without `replace` the name is taken, as before.
        assert_eq!(
            t.check_name_free(&n("w"), false, A).err(),
            Some(Error::AlreadyExists("w".into()))
        );
        let r = replace(&mut t, "w", 128, A).unwrap();
        assert_eq!(r.version, 0);
        ok(&t);
        // Until the seal every get is the old version; the replacement is nowhere by name.
        assert_eq!(t.get_now(&n("w"), 0, B).unwrap().id, v1.id);
        assert_eq!(t.list().len(), 1);
        assert_eq!((t.stats().objects, t.stats().unsealed), (2, 1));
        // One replacement of a name at a time per creator; another creator may write one.
        assert!(replace(&mut t, "w", 8, A).is_err());
        t.take_events();
        let sealed = t.seal(&n("w"), A, Some(r.id)).unwrap();
        assert_eq!(sealed.version, 2);
        // B still holds v1 (twice): nothing is freed, the name is v2's.
        assert!(sealed.freed.is_none());
        let events = t.take_events();
        assert_eq!(events.len(), 1);
        assert_eq!(
            (events[0].kind, events[0].version),
            (NotificationKind::Replaced, 2)
        );
        let now = t.get_now(&n("w"), 0, B).unwrap();
        assert_eq!((now.id, now.version, now.size), (r.id, 2, 128));
        assert!(t.get_now(&n("w"), 2, B).is_none());
        assert_eq!(t.stats().pending_delete, 1);
        ok(&t);
        // v1 goes with its last holder's release (B got it twice).
        assert!(t.release(held.id, B).unwrap().is_none());
        let freed = t.release(v1.id, B).unwrap().expect("v1's memory");
        assert_eq!(freed.size, 64);
        assert_eq!(t.stats().pending_delete, 0);
        ok(&t);
    }

    #[test]
    fn an_unheld_old_version_is_freed_at_the_replacing_seal() {
        let mut t = ObjectTable::new();
        put(&mut t, "w", 64);
        let r = replace(&mut t, "w", 64, A).unwrap();
        let sealed = t.seal(&n("w"), A, None).unwrap();
        assert_eq!(sealed.version, 2);
        assert!(sealed.freed.is_some());
        assert!(t.release(r.id, A).unwrap().is_none());
        assert_eq!(t.len(), 1);
        ok(&t);
        // An aborted replacement leaves the current version in place.
        let r = replace(&mut t, "w", 64, A).unwrap();
        assert!(t.abort(&n("w"), A, false).unwrap().is_some());
        assert_eq!(t.get_now(&n("w"), 0, B).unwrap().version, 2);
        // So does a replacer that goes away before its seal.
        let r2 = replace(&mut t, "w", 64, B).unwrap();
        assert!(r2.id != r.id);
        let freed = t.release_holder(B);
        assert_eq!(freed.len(), 1);
        assert_eq!(t.len(), 1);
        ok(&t);
    }

    #[test]
    fn a_get_newer_than_waits_for_the_next_version() {
        let mut t = ObjectTable::new();
        put(&mut t, "w", 64);
        let (tx, mut rx) = oneshot::channel();
        let waiter = t
            .begin_get(B, vec![n("w")], vec![1], true, tx)
            .ok()
            .unwrap();
        assert_eq!(t.stats().waiting_gets, 1);
        let r = replace(&mut t, "w", 64, A).unwrap();
        let sealed = t.seal(&n("w"), A, Some(r.id)).unwrap();
        assert_eq!(sealed.done.len(), 1);
        let got = sealed.done.into_iter().next().unwrap().results;
        assert_eq!(got[0].as_ref().map(|o| o.version), Some(2));
        assert!(t.finish_waiter(waiter).is_none());
        assert!(rx.try_recv().is_err());
        // Waiting for a version beyond the next one keeps waiting through it.
        let (tx, _rx) = oneshot::channel();
        let waiter = t
            .begin_get(B, vec![n("w")], vec![3], true, tx)
            .ok()
            .unwrap();
        let r = replace(&mut t, "w", 64, A).unwrap();
        assert!(t.seal(&n("w"), A, Some(r.id)).unwrap().done.is_empty());
        assert_eq!(t.stats().waiting_gets, 1);
        let r = replace(&mut t, "w", 64, A).unwrap();
        let done = t.seal(&n("w"), A, Some(r.id)).unwrap().done;
        assert_eq!(done[0].results[0].as_ref().map(|o| o.version), Some(4));
        assert!(t.finish_waiter(waiter).is_none());
        ok(&t);
    }
}
