//! Residency: whether an entry's bytes are in memory, on disk (spilled), or on their way
//! between the two, and the table's side of each move. The disk side (files, IO, bounds) is
//! [`crate::spill`]'s; this module only keeps every other rule of the table true while an
//! object is away:
//!
//! - *spilling*: chosen by eviction ([`super::eviction`]), unpublished and out of the LRU; its
//!   block still holds the bytes, so a get takes a reference as usual. At the write's end
//!   ([`ObjectTable::end_spill`]) it goes to disk only if still unreferenced and named;
//!   otherwise it stays in memory (published again) and the file is dropped, or, when the
//!   write failed, it is evicted as it would have been without spilling;
//! - *spilled*: its block is a [`Block::Spilled`] (no memory); a get does not find it now but
//!   waits for its restore (a slot of the get marked restoring, [`super::waiting`]), even a get
//!   that does not wait for missing names;
//! - *restoring*: a new block is being filled ([`ObjectTable::begin_restore`]); at the read's
//!   end ([`ObjectTable::end_restore`]) it is resident again, published, and every get waiting
//!   for it gets its reference (one read for them all), or, when the file was damaged, it is
//!   gone and those gets fail with the error naming it.
//!
//! Invariants (checked in [`ObjectTable::check_invariants`]): only resident entries are in the
//! LRU or published; an entry's block is `Spilled` exactly when it is spilled; spilling and
//! restoring entries are sealed and named (one removed meanwhile leaves the table; its block
//! waits for the IO in the actor).

use std::sync::Arc;

use vovp_types::{Device, Error, NotificationKind, ObjectId, ObjectName};

use super::{CompletedGet, Freed, ObjectTable};
use crate::block::{Block, SpilledBlock};

/// Where an entry's bytes are.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Residency {
    #[default]
    Resident,
    /// Being written to disk; the block still holds the bytes.
    Spilling,
    /// On disk only.
    Spilled,
    /// Being read back into a new block.
    Restoring,
}

impl Residency {
    /// On disk only, or not back yet: what LIST shows as spilled.
    pub(crate) fn is_away(self) -> bool {
        matches!(self, Residency::Spilled | Residency::Restoring)
    }
}

/// A victim eviction chose to spill: what its file must say, and the block to read it from.
#[derive(Debug)]
pub(crate) struct Spilling {
    pub id: ObjectId,
    pub name: ObjectName,
    pub version: u64,
    pub size: u64,
    pub block: Block,
}

/// How a spill ended, for the table actor.
#[derive(Debug)]
pub(crate) enum SpillEnd {
    /// On disk only now: this block (its old memory) goes back to its allocator.
    Spilled(Block),
    /// Used meanwhile: it stays in memory (its file, whole, may stay too: the object is
    /// sealed, unchanged).
    Kept,
    /// The write failed: evicted instead, as without spilling.
    Evicted(Freed),
    /// It left the table while its file was written (the file goes).
    Gone,
}

/// A restore to start: the object's identity, which its file must match.
#[derive(Debug)]
pub(crate) struct Restoring {
    pub name: ObjectName,
    pub version: u64,
}

/// How a restore ended, for the table actor.
pub(crate) enum RestoreEnd {
    /// Back in memory: the gets that waited for it, answered.
    Restored(Vec<CompletedGet>),
    /// The file was damaged: the object is gone (its new block with it) and the gets that
    /// waited for it fail.
    Lost(Freed, Vec<CompletedGet>),
    /// It left the table while being read (its block waits for the read in the actor).
    Gone,
}

impl ObjectTable {
    /// Whether eviction may spill the entry `key` rather than drop it: a host object (sealed,
    /// named, unreferenced: it is a victim).
    pub(super) fn spillable(&self, key: usize) -> bool {
        let e = &self.objects[key];
        e.block.device() == Device::Cpu && e.residency == Residency::Resident && !e.ephemeral
    }

    /// The victim `key` (unpublished, out of the LRU) starts spilling.
    pub(super) fn begin_spill(&mut self, key: usize) -> Spilling {
        let e = &mut self.objects[key];
        let (device, reserved) = (e.block.device(), e.block.reserved());
        self.lru.leave(&mut e.lru, device, reserved);
        e.residency = Residency::Spilling;
        Spilling {
            id: e.id,
            name: e.name.clone(),
            version: e.version,
            size: e.size,
            block: e.block,
        }
    }

    /// The victim `key` (unpublished) whose file from an earlier spill is whole: on disk only
    /// now, with no IO. Its block, to free.
    pub(super) fn drop_to_disk(&mut self, key: usize) -> Block {
        let e = &mut self.objects[key];
        let (device, reserved) = (e.block.device(), e.block.reserved());
        self.lru.leave(&mut e.lru, device, reserved);
        e.residency = Residency::Spilled;
        let id = e.id.get();
        std::mem::replace(&mut e.block, Block::Spilled(SpilledBlock { id }))
    }

    /// The write of `id`'s file ended (`written`: the file is whole).
    pub(crate) fn end_spill(&mut self, id: ObjectId, written: bool) -> SpillEnd {
        let Some(key) = self.objects.key_of(id) else {
            return SpillEnd::Gone;
        };
        let e = &mut self.objects[key];
        if e.residency != Residency::Spilling {
            return SpillEnd::Gone;
        }
        e.residency = Residency::Resident;
        let unused = e.refcount == 0 && e.named && !e.listing.is_parked();
        if unused && written {
            e.residency = Residency::Spilled;
            let block =
                std::mem::replace(&mut e.block, Block::Spilled(SpilledBlock { id: id.get() }));
            return SpillEnd::Spilled(block);
        }
        if unused {
            self.activity
                .record(NotificationKind::Evicted, &self.objects[key]);
            let f = self.remove(key);
            self.activity.evicted(f.block.reserved());
            return SpillEnd::Evicted(f);
        }
        // Referenced since (a get answered from memory): back to what it was.
        self.publication.publish(e);
        SpillEnd::Kept
    }

    /// Whether `name` is away (spilled or restoring) as a version above `newer_than`: its key,
    /// and whether a restore must still be started (it is spilled, not restoring).
    pub(super) fn away(&self, name: &ObjectName, newer_than: u64) -> Option<(usize, bool)> {
        let key = self.objects.named(name)?;
        let e = &self.objects[key];
        (e.sealed && e.version > newer_than && e.residency.is_away())
            .then_some((key, e.residency == Residency::Spilled))
    }

    /// The spilled object `id` starts coming back into `block` (allocated for it): what its
    /// file must say. `None` when it is not spilled any more (deleted, or restored by
    /// another get): the caller frees the block.
    pub(crate) fn begin_restore(&mut self, id: ObjectId, block: Block) -> Option<Restoring> {
        let key = self.objects.key_of(id)?;
        let e = &mut self.objects[key];
        if e.residency != Residency::Spilled {
            return None;
        }
        e.residency = Residency::Restoring;
        e.block = block;
        Some(Restoring {
            name: e.name.clone(),
            version: e.version,
        })
    }

    /// The data size and metadata of `id` while it is spilled (a restore may start).
    pub(crate) fn spilled_object(&self, id: ObjectId) -> Option<(u64, Arc<[u8]>)> {
        let e = self.objects.get(self.objects.key_of(id)?)?;
        (e.residency == Residency::Spilled).then(|| (e.size, e.metadata.clone()))
    }

    /// A restore of `id` could not even start (no memory): the gets waiting for it fail with
    /// `error`; the object stays spilled.
    pub(crate) fn restore_refused(&mut self, id: ObjectId, error: Error) -> Vec<CompletedGet> {
        let Some(key) = self.objects.key_of(id) else {
            return Vec::new();
        };
        let name = self.objects[key].name.clone();
        self.waiting.restore_ended(&name, Some(error))
    }

    /// The read of `id`'s file ended: `Ok` the block holds its bytes, checked (and its
    /// metadata), or what was wrong with the file (the gets fail with
    /// [`Error::SpillDamaged`] naming the object).
    pub(crate) fn end_restore(&mut self, id: ObjectId, result: Result<(), String>) -> RestoreEnd {
        let Some(key) = self.objects.key_of(id) else {
            return RestoreEnd::Gone;
        };
        if self.objects[key].residency != Residency::Restoring {
            return RestoreEnd::Gone;
        }
        let name = self.objects[key].name.clone();
        match result {
            Ok(()) => {
                let e = &mut self.objects[key];
                e.residency = Residency::Resident;
                self.publication.publish(e);
                let done = self.wake_waiters(&name, key);
                if self.objects[key].refcount == 0 && !self.objects[key].listing.is_parked() {
                    self.enter_lru(key);
                }
                RestoreEnd::Restored(done)
            }
            Err(reason) => {
                let error = Error::SpillDamaged(format!("{name:?}: {reason}"));
                tracing::warn!("spilled object {name:?} is lost: {reason}");
                self.activity
                    .record(NotificationKind::Evicted, &self.objects[key]);
                let freed = self.remove(key);
                let done = self.waiting.restore_ended(&name, Some(error));
                RestoreEnd::Lost(freed, done)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::test_support::{host_block, n, ok, put_host as put, B};
    use tokio::sync::oneshot;

    /// Spills every evictable object of the test device (the test tables' blocks count as
    /// `GPU0`'s), as a spilling store would.
    fn spill_all(t: &mut ObjectTable) -> Vec<Spilling> {
        let room = t.evict_with(
            Device::Cpu,
            u64::MAX,
            Some(&mut |_| crate::table::SpillChoice::Write),
        );
        assert!(room.freed.is_empty());
        room.spilling
    }

    fn get(
        t: &mut ObjectTable,
        name: &str,
        wait: bool,
    ) -> (
        Result<(), GetNow>,
        oneshot::Receiver<Result<crate::table::GetResults, Error>>,
    ) {
        let (tx, rx) = oneshot::channel();
        let r = match t.begin_get(B, vec![n(name)], vec![], wait, tx) {
            Ok(started) => Err(GetNow::Waiting(started.restores)),
            Err((results, reply)) => {
                let _ = reply.send(Ok(results));
                Ok(())
            }
        };
        (r, rx)
    }

    #[derive(Debug, PartialEq)]
    enum GetNow {
        Waiting(Vec<ObjectId>),
    }

    #[test]
    fn a_spilled_object_is_listed_and_a_get_waits_for_its_one_restore() {
        let mut t = ObjectTable::new();
        put(&mut t, "a", 100);
        let s = spill_all(&mut t);
        assert_eq!(s.len(), 1);
        let id = s[0].id;
        // The write lands: the old block goes back, the object is on disk only.
        assert!(matches!(t.end_spill(id, true), SpillEnd::Spilled(_)));
        let listed = t.list();
        assert!(listed[0].spilled && t.contains(&n("a")));
        ok(&t);
        // Two gets, even one that does not wait: one restore to start.
        let (first, mut rx1) = get(&mut t, "a", false);
        assert_eq!(first, Err(GetNow::Waiting(vec![id])));
        let (second, mut rx2) = get(&mut t, "a", true);
        assert_eq!(second, Err(GetNow::Waiting(vec![id])));
        let block = host_block(1 << 20, 100);
        let r = t.begin_restore(id, block).unwrap();
        assert_eq!((r.name.as_str(), r.version), ("a", 1));
        assert!(t.begin_restore(id, block).is_none(), "one read");
        assert!(rx1.try_recv().is_err());
        let RestoreEnd::Restored(done) = t.end_restore(id, Ok(())) else {
            panic!("restored")
        };
        assert_eq!(done.len(), 2);
        assert!(!t.list()[0].spilled);
        for d in done {
            assert!(d.error.is_none() && d.results[0].is_some());
            let _ = d.reply.send(Ok(d.results));
        }
        let got = rx1.try_recv().unwrap().unwrap();
        assert_eq!(got[0].as_ref().unwrap().id, id);
        assert!(rx2.try_recv().unwrap().is_ok());
        for _ in 0..2 {
            t.release(id, B).unwrap();
        }
        ok(&t);
    }

    #[test]
    fn a_damaged_file_fails_the_gets_and_the_object_is_gone() {
        let mut t = ObjectTable::new();
        put(&mut t, "a", 100);
        let id = spill_all(&mut t)[0].id;
        t.end_spill(id, true);
        let (_, _rx) = get(&mut t, "a", false);
        t.begin_restore(id, host_block(1 << 20, 100));
        let err = Error::SpillDamaged("\"a\": checksum".into());
        let RestoreEnd::Lost(freed, done) = t.end_restore(id, Err("checksum".into())) else {
            panic!("lost")
        };
        assert_eq!(freed.name.as_str(), "a");
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].error, Some(err));
        assert!(!t.contains(&n("a")));
        ok(&t);
    }

    #[test]
    fn a_get_during_the_write_keeps_the_object_and_a_failed_write_evicts_it() {
        let mut t = ObjectTable::new();
        put(&mut t, "a", 100);
        put(&mut t, "b", 100);
        let s = spill_all(&mut t);
        let (a, b) = (s[0].id, s[1].id);
        // Answered from memory while its file is written.
        let held = t.get_now(&n("a"), 0, B).unwrap();
        assert_eq!(held.id, a);
        assert!(matches!(t.end_spill(a, true), SpillEnd::Kept));
        // The disk was full: "b" is evicted, as without spilling.
        assert!(matches!(t.end_spill(b, false), SpillEnd::Evicted(_)));
        assert!(!t.contains(&n("b")));
        assert_eq!(t.stats().evicted_objects, 1);
        t.release(a, B).unwrap();
        assert_eq!(t.evictable_objects(Device::Cpu), 1);
        ok(&t);
    }

    #[test]
    fn deleting_a_spilled_object_frees_its_file_and_ends_the_gets_that_waited() {
        let mut t = ObjectTable::new();
        put(&mut t, "a", 100);
        let id = spill_all(&mut t)[0].id;
        t.end_spill(id, true);
        let (_, mut rx) = get(&mut t, "a", false);
        let freed = t.delete(&n("a")).unwrap().unwrap();
        assert!(matches!(freed.block, Block::Spilled(SpilledBlock { id: f }) if f == id.get()));
        let done = t.take_finished_gets();
        assert_eq!(done.len(), 1);
        assert!(done[0].results[0].is_none() && done[0].error.is_none());
        for d in done {
            let _ = d.reply.send(Ok(d.results));
        }
        assert_eq!(rx.try_recv().unwrap().unwrap(), vec![None]);
        assert!(t.begin_restore(id, host_block(1 << 20, 100)).is_none());
        ok(&t);
    }
}
