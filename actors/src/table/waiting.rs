//! The get queue: gets that wait for names not sealed yet (or not in a new enough version), by
//! name. A waiting get holds, slot by slot, the references it got so far; a seal fills the
//! slots waiting for its name and version, and the get completes when none is left (or at its
//! timeout, with what it has). The queue keeps results and wake-up lists; the table takes the
//! references it fills them with.
//!
//! A slot may wait for a *restore* (its name's object is spilled, [`super::residency`]): the
//! restore fills it like a seal, a timeout does not end the wait for it (the get is then
//! *expired*: it completes as soon as no slot waits for a restore), and a restore that fails
//! fails the get ([`GetQueue::restore_ended`]). A get that does not wait for missing names is
//! expired from the start.
//!
//! Invariants: every pending get has `remaining` empty slots (> 0: a complete one leaves the
//! queue), and an expired one has an empty slot waiting for a restore; only empty slots wait
//! for a restore; every empty slot's name lists the get among its waiters (a name may also
//! list gets that finished since: they are skipped and dropped at its next seal).

use std::collections::HashMap;

use tokio::sync::oneshot;
use vovp_types::{Error, HolderId, ObjectName, ObjectRef};

/// Results of a batched get, in request order (`None`: not sealed in time).
pub(crate) type GetResults = Vec<Option<ObjectRef>>;

/// Where a get's outcome goes: its results, or the error that failed it (a spilled object it
/// asked for could not be restored).
pub(crate) type GetReply = oneshot::Sender<Result<GetResults, Error>>;

pub(crate) type WaiterId = u64;

/// A waiting get that is now complete: the actor sends its results, or, with `error`, releases
/// them and sends the error.
pub(crate) struct CompletedGet {
    pub holder: HolderId,
    pub results: GetResults,
    pub error: Option<Error>,
    pub reply: GetReply,
}

struct PendingGet {
    holder: HolderId,
    names: Vec<ObjectName>,
    /// Per name: found once its version is above this (0: any sealed version).
    newer_than: Vec<u64>,
    results: GetResults,
    remaining: usize,
    /// Per slot: waits for its object's restore.
    restoring: Vec<bool>,
    /// Its timeout passed (or it never waited for missing names): it completes once no slot
    /// waits for a restore.
    expired: bool,
    reply: GetReply,
}

impl PendingGet {
    fn complete(self, error: Option<Error>) -> CompletedGet {
        CompletedGet {
            holder: self.holder,
            results: self.results,
            error,
            reply: self.reply,
        }
    }

    fn restores_left(&self) -> usize {
        self.restoring.iter().filter(|&&r| r).count()
    }

    fn is_complete(&self) -> bool {
        self.remaining == 0 || (self.expired && self.restores_left() == 0)
    }
}

/// What a seal of a name hands to the table: per waiting get, the slots the new version fills.
pub(super) struct Fill {
    pub waiter: WaiterId,
    pub holder: HolderId,
    pub slots: Vec<usize>,
}

/// The waiting gets.
#[derive(Default)]
pub(super) struct GetQueue {
    /// Per name, the gets waiting for it (in the order they began).
    by_name: HashMap<ObjectName, Vec<WaiterId>>,
    pending: HashMap<WaiterId, PendingGet>,
    last_waiter: WaiterId,
}

impl GetQueue {
    /// Queues a get whose `results` (found so far, one per name) have empty slots; `newer_than`
    /// has one version per name, `restoring` says which slots wait for a restore, `expired`
    /// that the get waits for nothing else.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn wait(
        &mut self,
        holder: HolderId,
        names: Vec<ObjectName>,
        newer_than: Vec<u64>,
        results: GetResults,
        restoring: Vec<bool>,
        expired: bool,
        reply: GetReply,
    ) -> WaiterId {
        self.last_waiter += 1;
        let waiter = self.last_waiter;
        for (n, r) in names.iter().zip(&results) {
            if r.is_none() {
                let w = self.by_name.entry(n.clone()).or_default();
                if w.last() != Some(&waiter) {
                    w.push(waiter);
                }
            }
        }
        let remaining = results.iter().filter(|r| r.is_none()).count();
        debug_assert!(remaining > 0, "a complete get waits for nothing");
        self.pending.insert(
            waiter,
            PendingGet {
                holder,
                names,
                newer_than,
                results,
                remaining,
                restoring,
                expired,
                reply,
            },
        );
        waiter
    }

    /// `name` was sealed as `version`: the slots that version fills, per waiting get (in the
    /// order the gets began). Gets that wait for a later version stay on the name's list.
    pub(super) fn sealed(&mut self, name: &ObjectName, version: u64) -> Vec<Fill> {
        let Some(waiting) = self.by_name.remove(name) else {
            return Vec::new();
        };
        let mut fills = Vec::new();
        let mut still = Vec::new();
        for waiter in waiting {
            let Some(p) = self.pending.get(&waiter) else {
                continue;
            };
            let wanted = |i: &usize| p.results[*i].is_none() && &p.names[*i] == name;
            let slots: Vec<usize> = (0..p.names.len())
                .filter(wanted)
                .filter(|&i| version > p.newer_than[i])
                .collect();
            // Waiting for a version newer than this one: still waiting.
            if (0..p.names.len())
                .filter(wanted)
                .any(|i| version <= p.newer_than[i])
            {
                still.push(waiter);
            }
            if !slots.is_empty() {
                fills.push(Fill {
                    waiter,
                    holder: p.holder,
                    slots,
                });
            }
        }
        if !still.is_empty() {
            self.by_name.insert(name.clone(), still);
        }
        fills
    }

    /// Puts `r` into a slot of `waiter` (one of a [`Fill`]'s): the get, when that was its last
    /// empty slot.
    pub(super) fn fill(
        &mut self,
        waiter: WaiterId,
        slot: usize,
        r: ObjectRef,
    ) -> Option<CompletedGet> {
        let p = self.pending.get_mut(&waiter)?;
        debug_assert!(p.results[slot].is_none(), "a slot filled twice");
        p.results[slot] = Some(r);
        p.restoring[slot] = false;
        p.remaining -= 1;
        if !p.is_complete() {
            return None;
        }
        self.finish(waiter)
    }

    /// A waiting get reached its timeout: it ends now with what it has, unless a slot waits
    /// for a restore (it then ends when none does). `None` when it does not end now.
    pub(super) fn expire(&mut self, waiter: WaiterId) -> Option<CompletedGet> {
        let p = self.pending.get_mut(&waiter)?;
        p.expired = true;
        if p.restores_left() > 0 {
            return None;
        }
        self.finish(waiter)
    }

    /// The restore of `name`'s object ended without filling the slots waiting for it: it
    /// failed (`error`: those gets fail with it), or the object lost its name (those slots
    /// wait for the name as any missing one; expired gets end). The gets that ended.
    pub(super) fn restore_ended(
        &mut self,
        name: &ObjectName,
        error: Option<Error>,
    ) -> Vec<CompletedGet> {
        let waiting = self.by_name.get(name).cloned().unwrap_or_default();
        let mut ended = Vec::new();
        for waiter in waiting {
            let Some(p) = self.pending.get_mut(&waiter) else {
                continue;
            };
            let mut touched = false;
            for i in 0..p.names.len() {
                if p.restoring[i] && &p.names[i] == name {
                    p.restoring[i] = false;
                    touched = true;
                }
            }
            if !touched {
                continue;
            }
            if let Some(e) = &error {
                ended.extend(self.finish_with(waiter, Some(e.clone())));
            } else if p.is_complete() {
                ended.extend(self.finish(waiter));
            }
        }
        ended
    }

    /// Ends a waiting get (complete, or its holder went): its partial results, or `None` if
    /// it completed already.
    pub(super) fn finish(&mut self, waiter: WaiterId) -> Option<CompletedGet> {
        self.finish_with(waiter, None)
    }

    fn finish_with(&mut self, waiter: WaiterId, error: Option<Error>) -> Option<CompletedGet> {
        let p = self.pending.remove(&waiter)?;
        for n in &p.names {
            if let Some(w) = self.by_name.get_mut(n) {
                w.retain(|x| *x != waiter);
                if w.is_empty() {
                    self.by_name.remove(n);
                }
            }
        }
        Some(p.complete(error))
    }

    /// The gets `holder` waits in.
    pub(super) fn of_holder(&self, holder: HolderId) -> Vec<WaiterId> {
        self.pending
            .iter()
            .filter(|(_, p)| p.holder == holder)
            .map(|(w, _)| *w)
            .collect()
    }

    /// Gets waiting now.
    pub(super) fn len(&self) -> usize {
        self.pending.len()
    }

    /// The invariants in the module doc.
    pub(super) fn check(&self) -> Result<(), String> {
        for (waiter, p) in &self.pending {
            let empty = p.results.iter().filter(|r| r.is_none()).count();
            if empty != p.remaining || empty == 0 {
                return Err(format!(
                    "get {waiter}: {empty} empty slots, {}",
                    p.remaining
                ));
            }
            if p.restoring
                .iter()
                .zip(&p.results)
                .any(|(&w, r)| w && r.is_some())
                || (p.expired && p.restores_left() == 0)
            {
                return Err(format!("get {waiter}: restore slots wrong"));
            }
            let listed = |n: &ObjectName| self.by_name.get(n).is_some_and(|w| w.contains(waiter));
            if p.names
                .iter()
                .zip(&p.results)
                .any(|(n, r)| r.is_none() && !listed(n))
            {
                return Err(format!(
                    "get {waiter}: a name it waits for does not list it"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::test_support::{insert, n, ok, put, refcount, replace, A, B};
    use crate::table::ObjectTable;
    use vovp_types::{Location, ObjectId};

    fn found(name: &str, version: u64) -> ObjectRef {
        ObjectRef {
            id: ObjectId::from_raw(version),
            name: n(name),
            size: 0,
            metadata: std::sync::Arc::from(&[][..]),
            location: Location::Host {
                segment: 0,
                offset: 0,
            },
            version,
        }
    }

    fn wait(q: &mut GetQueue, holder: HolderId, names: &[&str], newer: &[u64]) -> WaiterId {
        let (tx, _rx) = oneshot::channel();
        let names: Vec<_> = names.iter().map(|s| n(s)).collect();
        let results = vec![None; names.len()];
        let restoring = vec![false; names.len()];
        q.wait(holder, names, newer.to_vec(), results, restoring, false, tx)
    }

    #[test]
    fn a_seal_fills_every_slot_of_its_name_and_the_last_fill_completes() {
        let mut q = GetQueue::default();
        let w = wait(&mut q, B, &["a", "b", "a"], &[0, 0, 0]);
        let other = wait(&mut q, A, &["a"], &[0]);
        q.check().unwrap();
        let fills = q.sealed(&n("a"), 1);
        let filled: Vec<_> = fills.iter().map(|f| (f.waiter, f.slots.clone())).collect();
        assert_eq!(filled, [(w, vec![0, 2]), (other, vec![0])]);
        assert!(q.fill(w, 0, found("a", 1)).is_none());
        assert!(q.fill(w, 2, found("a", 1)).is_none());
        assert_eq!(q.fill(other, 0, found("a", 1)).unwrap().holder, A);
        q.check().unwrap();
        // Sealed again: nobody waits for "a" any more.
        assert!(q.sealed(&n("a"), 2).is_empty());
        let fills = q.sealed(&n("b"), 1);
        assert_eq!(fills.len(), 1);
        let done = q.fill(w, fills[0].slots[0], found("b", 1)).unwrap();
        assert_eq!(done.results.iter().flatten().count(), 3);
        assert_eq!(q.len(), 0);
        q.check().unwrap();
    }

    #[test]
    fn a_get_newer_than_a_version_skips_versions_up_to_it() {
        let mut q = GetQueue::default();
        let w = wait(&mut q, B, &["w"], &[2]);
        assert!(q.sealed(&n("w"), 2).is_empty());
        q.check().unwrap();
        let fills = q.sealed(&n("w"), 3);
        assert_eq!(fills[0].slots, [0]);
        assert!(q.fill(w, 0, found("w", 3)).is_some());
    }

    #[test]
    fn a_finished_get_takes_its_partial_results_and_is_forgotten_by_its_names() {
        let mut q = GetQueue::default();
        let (tx, _rx) = oneshot::channel();
        let w = q.wait(
            B,
            vec![n("x"), n("y")],
            vec![0, 0],
            vec![Some(found("x", 1)), None],
            vec![false, false],
            false,
            tx,
        );
        assert_eq!(q.of_holder(B), [w]);
        assert!(q.of_holder(A).is_empty());
        let done = q.finish(w).unwrap();
        assert!(done.results[0].is_some() && done.results[1].is_none());
        assert!(q.finish(w).is_none(), "once");
        assert!(q.sealed(&n("y"), 1).is_empty());
        assert_eq!(q.len(), 0);
        q.check().unwrap();
    }

    // The queue with the table: seals take the references, timeouts and versions.

    #[test]
    fn a_waiting_get_completes_when_the_last_name_is_sealed() {
        let mut t = ObjectTable::new();
        put(&mut t, "ready", 8);
        let (tx, mut rx) = oneshot::channel();
        let names = vec![n("ready"), n("later"), n("later")];
        let waiter = t
            .begin_get(B, names, Vec::new(), true, tx)
            .ok()
            .unwrap()
            .waiter;
        // "ready" is already held by the waiting get.
        assert_eq!(refcount(&t, "ready"), 1);
        assert!(rx.try_recv().is_err());

        let r = insert(&mut t, "later", 8, false);
        ok(&t);
        let done = t.seal(&n("later"), A, None).unwrap().done;
        assert_eq!(done.len(), 1);
        let d = done.into_iter().next().unwrap();
        assert_eq!(d.holder, B);
        d.reply.send(Ok(d.results)).unwrap();
        let results = rx.try_recv().unwrap().unwrap();
        let ids: Vec<_> = results
            .iter()
            .map(|r| r.as_ref().unwrap().name.as_str())
            .collect();
        assert_eq!(ids, ["ready", "later", "later"]);
        // One reference per slot, both to the same object.
        assert_eq!(refcount(&t, "later"), 3);
        t.release(r.id, A).unwrap();
        // Finished: a late timeout finds nothing.
        assert!(t.expire_waiter(waiter).is_none());
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
            .unwrap()
            .waiter;
        let done = t.expire_waiter(waiter).unwrap();
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
    fn a_get_newer_than_waits_for_the_next_version() {
        let mut t = ObjectTable::new();
        put(&mut t, "w", 64);
        let (tx, mut rx) = oneshot::channel();
        let waiter = t
            .begin_get(B, vec![n("w")], vec![1], true, tx)
            .ok()
            .unwrap()
            .waiter;
        assert_eq!(t.stats().waiting_gets, 1);
        let r = replace(&mut t, "w", 64, A).unwrap();
        let sealed = t.seal(&n("w"), A, Some(r.id)).unwrap();
        assert_eq!(sealed.done.len(), 1);
        let got = sealed.done.into_iter().next().unwrap().results;
        assert_eq!(got[0].as_ref().map(|o| o.version), Some(2));
        assert!(t.expire_waiter(waiter).is_none());
        assert!(rx.try_recv().is_err());
        // Waiting for a version beyond the next one keeps waiting through it.
        let (tx, _rx) = oneshot::channel();
        let waiter = t
            .begin_get(B, vec![n("w")], vec![3], true, tx)
            .ok()
            .unwrap()
            .waiter;
        let r = replace(&mut t, "w", 64, A).unwrap();
        assert!(t.seal(&n("w"), A, Some(r.id)).unwrap().done.is_empty());
        assert_eq!(t.stats().waiting_gets, 1);
        let r = replace(&mut t, "w", 64, A).unwrap();
        let done = t.seal(&n("w"), A, Some(r.id)).unwrap().done;
        assert_eq!(done[0].results[0].as_ref().map(|o| o.version), Some(4));
        assert!(t.expire_waiter(waiter).is_none());
        ok(&t);
    }
}
