//! The object table: names, life cycle, per-holder reference counts and the LRU of evictable
//! objects. Plain synchronous data structure (the table actor wraps it), so every rule of the
//! object life cycle is unit-testable without a runtime.
//!
//! Life cycle: `insert` (unsealed, creator holds one reference) → `seal` (immutable, visible)
//! → references come and go through `get`/`release` → sealed objects with no reference sit in
//! the LRU and may be evicted → `delete` unlinks the name at once and frees the memory when the
//! last holder releases. An unsealed object lives only while its creator holds it: the creator's
//! release (or disconnect) aborts it.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::SystemTime;

use slab::Slab;
use tokio::sync::oneshot;
use vovp_gpu::DeviceBlock;

use crate::allocator::HostBlock;
use crate::types::*;
use crate::Error;

/// The memory behind one object, returned to its allocator when the object goes.
#[derive(Clone, Copy, Debug)]
pub enum Block {
    Host(HostBlock),
    Cuda(DeviceBlock),
}

impl Block {
    pub fn location(&self) -> Location {
        match self {
            Block::Host(h) => Location::Host {
                segment: h.segment,
                offset: h.offset,
            },
            Block::Cuda(d) => Location::Cuda(*d),
        }
    }

    pub fn pool(&self) -> Pool {
        match self {
            Block::Host(_) => Pool::Host,
            Block::Cuda(d) => Pool::Cuda(d.device),
        }
    }

    /// Bytes the object counts against its pool's capacity (what evicting it frees).
    pub fn reserved(&self) -> u64 {
        match self {
            Block::Host(h) => h.charged,
            Block::Cuda(d) => d.size,
        }
    }
}

/// A memory pool with its own capacity and its own LRU: host memory, or one GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Pool {
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
    /// Position in its pool's LRU while evictable (sealed, named, unreferenced).
    lru_tick: Option<u64>,
    last_access: SystemTime,
}

impl Entry {
    fn object_ref(&self) -> ObjectRef {
        ObjectRef {
            id: self.id,
            name: self.name.clone(),
            size: self.size,
            metadata: self.metadata.clone(),
            location: self.block.location(),
        }
    }
}

/// Results of a batched get, in request order (`None`: not sealed in time).
pub type GetResults = Vec<Option<ObjectRef>>;

pub type WaiterId = u64;

struct PendingGet {
    holder: HolderId,
    names: Vec<ObjectName>,
    results: GetResults,
    remaining: usize,
    reply: oneshot::Sender<GetResults>,
}

/// A waiting get that is now complete: the actor sends its results.
pub struct CompletedGet {
    pub holder: HolderId,
    pub results: GetResults,
    pub reply: oneshot::Sender<GetResults>,
}

/// How a get started.
pub enum GetStart {
    /// Every name was sealed already (or the caller would not wait).
    Done(GetResults),
    /// Some names are missing; the results come through the receiver given at start.
    Waiting(WaiterId),
}

/// An object that left the table and whose memory must go back to its allocator.
#[derive(Debug)]
pub struct Freed {
    pub block: Block,
    pub name: ObjectName,
    pub size: u64,
}

#[derive(Default)]
pub struct ObjectTable {
    objects: Slab<Entry>,
    by_name: HashMap<ObjectName, usize>,
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
}

impl ObjectTable {
    pub fn new() -> Self {
        Self::default()
    }

    fn key_of(&self, id: ObjectId) -> Option<usize> {
        let key = (id.get() & 0xFFFF_FFFF) as usize;
        match self.objects.get(key) {
            Some(e) if e.id == id => Some(key),
            _ => None,
        }
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
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
            });
        }
    }

    /// Notifications recorded since the last call.
    pub fn take_events(&mut self) -> Vec<Notification> {
        std::mem::take(&mut self.events)
    }

    /// Fails when `name` is taken (sealed or not). Deleted-but-referenced objects do not count.
    pub fn check_name_free(&self, name: &ObjectName) -> Result<(), Error> {
        if self.by_name.contains_key(name) {
            return Err(Error::AlreadyExists(name.to_string()));
        }
        Ok(())
    }

    /// Adds an unsealed object in `block`; the creator holds one reference.
    pub fn insert(
        &mut self,
        name: ObjectName,
        size: u64,
        metadata: Arc<[u8]>,
        block: Block,
        ephemeral: bool,
        creator: HolderId,
    ) -> Result<ObjectRef, Error> {
        self.check_name_free(&name)?;
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
            named: true,
            creator,
            refcount: 1,
            lru_tick: None,
            last_access: SystemTime::now(),
        });
        let r = e.object_ref();
        self.by_name.insert(name, key);
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

    /// Seals `name` (creator only); with `id`, only that incarnation of it, so a buffer that
    /// outlived its aborted object cannot seal a newer object of the same name (`NotFound`).
    /// Returns the gets that were waiting for it and are now complete.
    pub fn seal(
        &mut self,
        name: &ObjectName,
        holder: HolderId,
        id: Option<ObjectId>,
    ) -> Result<Vec<CompletedGet>, Error> {
        let key = self.named_key(name)?;
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
        e.sealed = true;
        e.last_access = SystemTime::now();
        self.record(NotificationKind::Sealed, key);
        Ok(self.wake_waiters(name, key))
    }

    fn wake_waiters(&mut self, name: &ObjectName, key: usize) -> Vec<CompletedGet> {
        let Some(waiting) = self.waiters.remove(name) else {
            return Vec::new();
        };
        let mut done = Vec::new();
        for waiter in waiting {
            let Some(p) = self.pending.get(&waiter) else {
                continue;
            };
            let holder = p.holder;
            let slots: Vec<usize> = (0..p.names.len())
                .filter(|&i| p.results[i].is_none() && &p.names[i] == name)
                .collect();
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
        done
    }

    /// Aborts an unsealed object (creator only): its name is free at once. Its memory is
    /// returned now, with the creator's reference, unless `keep_while_held`: then it goes with
    /// the creator's release, like a deleted object's (the embedded engine, whose creator may
    /// still hold a writable buffer of it: freed now, that buffer would write into whatever
    /// object gets the memory next).
    pub fn abort(
        &mut self,
        name: &ObjectName,
        holder: HolderId,
        keep_while_held: bool,
    ) -> Result<Option<Freed>, Error> {
        let key = self.named_key(name)?;
        let e = &mut self.objects[key];
        if e.sealed {
            return Err(Error::AlreadySealed(name.to_string()));
        }
        if e.creator != holder {
            return Err(Error::NotCreator(name.to_string()));
        }
        if keep_while_held {
            e.named = false;
            self.by_name.remove(name);
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

    /// A reference to `name` if it is sealed now.
    pub fn get_now(&mut self, name: &ObjectName, holder: HolderId) -> Option<ObjectRef> {
        let key = *self.by_name.get(name)?;
        if !self.objects[key].sealed {
            return None;
        }
        Some(self.take_ref(key, holder))
    }

    /// Gets every name; when some are missing and `wait` is set, registers a waiter whose
    /// results go to `reply` (as soon as all are sealed, or at timeout through `finish_waiter`).
    pub fn begin_get(
        &mut self,
        holder: HolderId,
        names: Vec<ObjectName>,
        wait: bool,
        reply: oneshot::Sender<GetResults>,
    ) -> Result<WaiterId, (GetResults, oneshot::Sender<GetResults>)> {
        let results: GetResults = names.iter().map(|n| self.get_now(n, holder)).collect();
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
                results,
                remaining,
                reply,
            },
        );
        Ok(waiter)
    }

    /// Ends a waiting get (timeout): its partial results, or `None` if it completed already.
    pub fn finish_waiter(&mut self, waiter: WaiterId) -> Option<CompletedGet> {
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
    pub fn release(&mut self, id: ObjectId, holder: HolderId) -> Result<Option<Freed>, Error> {
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
            return Some(self.remove(key));
        }
        let pool = e.block.pool();
        let reserved = e.block.reserved();
        let tick = self.next_tick();
        self.objects[key].lru_tick = Some(tick);
        self.lru.entry(pool).or_default().insert(tick, key);
        *self.evictable.entry(pool).or_insert(0) += reserved;
        None
    }

    fn remove(&mut self, key: usize) -> Freed {
        let e = self.objects.remove(key);
        if e.named {
            self.by_name.remove(&e.name);
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
    pub fn delete(&mut self, name: &ObjectName) -> Result<Option<Freed>, Error> {
        let key = self.named_key(name)?;
        if !self.objects[key].sealed {
            return Err(Error::NotSealed(name.to_string()));
        }
        self.record(NotificationKind::Deleted, key);
        if self.objects[key].refcount == 0 {
            return Ok(Some(self.remove(key)));
        }
        let e = &mut self.objects[key];
        e.named = false;
        let n = e.name.clone();
        self.by_name.remove(&n);
        Ok(None)
    }

    /// Releases everything `holder` holds (its connection went away): references dropped,
    /// unsealed objects it created aborted, its waiting gets cancelled.
    pub fn release_holder(&mut self, holder: HolderId) -> Vec<Freed> {
        let mut freed = Vec::new();
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
    pub fn evictable_objects(&self, pool: Pool) -> usize {
        self.lru.get(&pool).map_or(0, BTreeMap::len)
    }

    /// Bytes that eviction could free in `pool` now.
    pub fn evictable_bytes(&self, pool: Pool) -> u64 {
        self.evictable.get(&pool).copied().unwrap_or(0)
    }

    /// Evicts least-recently-used unreferenced sealed objects of `pool` until at least `bytes`
    /// are freed or none is left.
    pub fn evict(&mut self, pool: Pool, bytes: u64) -> Vec<Freed> {
        let mut freed = Vec::new();
        let mut total = 0;
        while total < bytes {
            let Some((_, key)) = self.lru.get_mut(&pool).and_then(|l| l.pop_first()) else {
                break;
            };
            let e = &mut self.objects[key];
            let reserved = e.block.reserved();
            e.lru_tick = None;
            if let Some(b) = self.evictable.get_mut(&pool) {
                *b -= reserved;
            }
            self.record(NotificationKind::Evicted, key);
            let f = self.remove(key);
            total += reserved;
            self.evicted_objects += 1;
            self.evicted_bytes += f.block.reserved();
            freed.push(f);
        }
        freed
    }

    /// True when `name` is sealed and present.
    pub fn contains(&self, name: &ObjectName) -> bool {
        self.by_name
            .get(name)
            .is_some_and(|&k| self.objects[k].sealed)
    }

    pub fn list(&self) -> Vec<ObjectInfo> {
        let mut v: Vec<ObjectInfo> = self.by_name.values().map(|&k| self.info(k)).collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    fn info(&self, key: usize) -> ObjectInfo {
        let e = &self.objects[key];
        ObjectInfo {
            id: e.id,
            name: e.name.clone(),
            size: e.size,
            device: e.block.location().device(),
            sealed: e.sealed,
            ephemeral: e.ephemeral,
            refcount: e.refcount,
            last_access: e.last_access,
            metadata: e.metadata.clone(),
        }
    }

    /// One page of named objects in table order, from cursor `start`: at most `limit` entries
    /// and (after the first) at most `max_bytes` of `entry_bytes`. Returns the page and the
    /// cursor of the next one (`None` after the last). The cost is that of the page, not of the
    /// table, and objects created or removed between pages may or may not be seen (no
    /// snapshot), but every object present throughout is listed exactly once.
    pub fn list_page(
        &self,
        start: u64,
        limit: usize,
        max_bytes: usize,
        entry_bytes: impl Fn(&ObjectInfo) -> usize,
    ) -> (Vec<ObjectInfo>, Option<u64>) {
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
                    let info = self.info(key);
                    bytes = bytes.saturating_add(entry_bytes(&info));
                    page.push(info);
                }
            }
            key += 1;
        }
        (page, None)
    }

    /// Counters (capacity and used bytes are the allocator's and are filled by the caller).
    pub fn stats(&self) -> StoreStats {
        let mut s = StoreStats {
            objects: self.by_name.len() as u64,
            pending_delete: (self.objects.len() - self.by_name.len()) as u64,
            holders: self.holders.len() as u64,
            creates: self.creates,
            evicted_objects: self.evicted_objects,
            evicted_bytes: self.evicted_bytes,
            ..Default::default()
        };
        for (_, e) in &self.objects {
            s.references += e.refcount as u64;
            if e.named {
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
    pub fn check_invariants(&self) -> Result<(), String> {
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
            let should_be_evictable = e.sealed && e.named && e.refcount == 0;
            if should_be_evictable != e.lru_tick.is_some() {
                return Err(format!("{:?}: LRU membership wrong", e.name));
            }
            if e.named && self.by_name.get(&e.name) != Some(&k) {
                return Err(format!("{:?}: name index wrong", e.name));
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
    pub fn len(&self) -> usize {
        self.objects.len()
    }

    pub fn is_empty(&self) -> bool {
        self.objects.is_empty()
    }
}
