//! What the table tells the outside about itself: counters (creates, seals, replaces,
//! deletes, gets by message, lends, publishes, evictions), the notifications subscribers get
//! (sealed, replaced, deleted, evicted: recorded only while someone subscribes), and the
//! read-only views of the objects: `info`, `list`, list pages, STATS, and who holds what
//! (for the metrics). The views count holds through hold tables as references, so a client's
//! get without a message shows up as one.
//!
//! Invariants: the counters only grow; events are recorded only while `recording`, in the
//! order the table made the changes.

use std::collections::{HashMap, HashSet};

use vovp_types::{
    HolderId, HolderUsage, Notification, NotificationKind, ObjectInfo, StoreActivity, StoreStats,
};

use super::objects::Entry;
use super::waiting::GetResults;
use super::ObjectTable;

/// What the table did: counters, and the notification log while someone subscribes.
#[derive(Default)]
pub(super) struct Activity {
    creates: u64,
    evicted_objects: u64,
    evicted_bytes: u64,
    /// Seals, replaces, deletes, gets by message, publishes (the shared-directory gets are the
    /// hold tables', added up by [`crate::shared_regions`]; lends the lend ledger's).
    counts: StoreActivity,
    /// Record changes in `events` (someone subscribes).
    recording: bool,
    events: Vec<Notification>,
}

impl Activity {
    pub(super) fn created(&mut self) {
        self.creates += 1;
    }

    pub(super) fn evicted(&mut self, bytes: u64) {
        self.evicted_objects += 1;
        self.evicted_bytes += bytes;
    }

    /// An object of `bytes` sealed; `replace`: as a name's next version; `published`: from a
    /// lend.
    pub(super) fn sealed(&mut self, bytes: u64, replace: bool, published: bool) {
        self.counts.seals.add(bytes);
        if replace {
            self.counts.replaces.add(bytes);
        }
        if published {
            self.counts.publishes.add(bytes);
        }
    }

    pub(super) fn deleted(&mut self, bytes: u64) {
        self.counts.deletes.add(bytes);
    }

    /// A get by message answered: each name found is a hit, each left empty a miss.
    pub(super) fn answered_get(&mut self, results: &GetResults) {
        for r in results {
            match r {
                Some(r) => self.counts.socket_hits.add(r.size),
                None => self.counts.socket_misses += 1,
            }
        }
    }

    /// Records `kind` of change to `e`, while recording.
    pub(super) fn record(&mut self, kind: NotificationKind, e: &Entry) {
        if self.recording {
            self.events.push(Notification {
                kind,
                name: e.name.clone(),
                size: e.size,
                metadata: e.metadata.clone(),
                version: e.version,
            });
        }
    }

    pub(super) fn set_recording(&mut self, on: bool) {
        self.recording = on;
    }

    pub(super) fn recording(&self) -> bool {
        self.recording
    }

    pub(super) fn take_events(&mut self) -> Vec<Notification> {
        std::mem::take(&mut self.events)
    }
}

/// `holds`: [`super::publication::Publication::hold_counts`]; an object's reference count
/// includes them.
fn info(e: &Entry, holds: &HashMap<u64, u32>) -> ObjectInfo {
    ObjectInfo {
        id: e.id,
        name: e.name.clone(),
        size: e.size,
        device: e.block.location().device(),
        sealed: e.sealed,
        ephemeral: e.ephemeral,
        refcount: e.refcount + e.listing.holds(holds),
        last_access: e.last_access,
        metadata: e.metadata.clone(),
        version: e.version,
        spilled: e.residency.is_away(),
    }
}

impl ObjectTable {
    /// Every named object, by name.
    pub(crate) fn list(&self) -> Vec<ObjectInfo> {
        let holds = self.publication.hold_counts();
        let mut v: Vec<ObjectInfo> = self
            .objects
            .named_keys()
            .map(|k| info(&self.objects[k], &holds))
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
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
        let holds = self.publication.hold_counts();
        let mut page = Vec::new();
        let mut bytes = 0usize;
        let end = self.objects.key_bound();
        let mut key = usize::try_from(start).unwrap_or(usize::MAX);
        while key < end {
            if page.len() >= limit || bytes >= max_bytes {
                return (page, Some(key as u64));
            }
            if let Some(e) = self.objects.get(key).filter(|e| e.named) {
                let info = info(e, &holds);
                bytes = bytes.saturating_add(entry_bytes(&info));
                page.push(info);
            }
            key += 1;
        }
        (page, None)
    }

    /// What the table did, ever (lends are left to the lend ledger); the shared-directory gets
    /// summed over the hold tables (`&mut`: the sum remembers each table's last count).
    pub(crate) fn activity(&mut self) -> StoreActivity {
        let mut a = self.activity.counts;
        a.shared_gets = self.publication.shared_gets();
        a
    }

    /// Counts a get by message answered with `results` (the table actor, as it sends them).
    pub(crate) fn count_get(&mut self, results: &GetResults) {
        self.activity.answered_get(results);
    }

    /// Every holder that holds something now: its references (socket ones and hold-table
    /// holds, as STATS counts them) and the data bytes of the distinct objects it holds.
    pub(crate) fn holder_usage(&self) -> Vec<HolderUsage> {
        // Per holder, the entries it holds and its references.
        let mut held: HashMap<HolderId, (HashSet<usize>, u64)> = HashMap::new();
        for (holder, refs) in self.objects.references() {
            let (keys, n) = held.entry(holder).or_default();
            for (&key, &count) in refs {
                keys.insert(key);
                *n += u64::from(count);
            }
        }
        let holds = self.publication.holds_by_holder();
        if !holds.is_empty() {
            let by_generation: HashMap<u64, usize> = self
                .objects
                .iter()
                .filter(|(_, e)| e.listing.generation() != 0)
                .map(|(key, e)| (e.listing.generation(), key))
                .collect();
            for (holder, generations) in holds {
                let (keys, n) = held.entry(holder).or_default();
                for g in generations {
                    // A hold of a publication whose entry is gone pins nothing (it is stale).
                    if let Some(&key) = by_generation.get(&g) {
                        keys.insert(key);
                        *n += 1;
                    }
                }
            }
        }
        held.into_iter()
            .filter(|(_, (_, n))| *n > 0)
            .map(|(holder, (keys, references))| HolderUsage {
                holder,
                references,
                bytes: keys.iter().map(|&k| self.objects[k].size).sum(),
            })
            .collect()
    }

    /// Counters (capacity and used bytes are the allocator's and are filled by the caller).
    pub(crate) fn stats(&self) -> StoreStats {
        let holds = self.publication.hold_counts();
        let holding = self.publication.holders_holding();
        let holders = self.objects.holders().count()
            + holding
                .iter()
                .filter(|h| !self.objects.is_holder(h))
                .count();
        let named = self.objects.named_or_replacing();
        let st = &self.activity;
        let mut s = StoreStats {
            objects: named as u64,
            pending_delete: (self.objects.len() - named) as u64,
            holders: holders as u64,
            creates: st.creates,
            evicted_objects: st.evicted_objects,
            evicted_bytes: st.evicted_bytes,
            waiting_gets: self.waiting.len() as u64,
            ..Default::default()
        };
        for (_, e) in self.objects.iter() {
            let shared = u64::from(e.listing.holds(&holds));
            s.shared_holds += shared;
            s.references += u64::from(e.refcount) + shared;
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::test_support::{insert, n, ok, put, replace, A, B};

    #[test]
    fn events_are_recorded_only_while_recording() {
        let mut t = ObjectTable::new();
        put(&mut t, "quiet", 8);
        assert!(t.take_events().is_empty());
        t.set_recording(true);
        put(&mut t, "loud", 8);
        let events = t.take_events();
        assert_eq!(events.len(), 1);
        assert_eq!(
            (events[0].kind, events[0].name.as_str()),
            (NotificationKind::Sealed, "loud")
        );
        assert!(t.take_events().is_empty(), "taken once");
    }

    #[test]
    fn counters_count_creates_and_evictions() {
        let mut t = ObjectTable::new();
        put(&mut t, "a", 100);
        put(&mut t, "b", 50);
        let held = t.get_now(&n("b"), 0, B).unwrap();
        let s = t.stats();
        assert_eq!(
            (s.creates, s.objects, s.sealed, s.references, s.holders),
            (2, 2, 2, 1, 1)
        );
        t.evict(crate::table::test_support::GPU0, u64::MAX);
        let s = t.stats();
        assert_eq!((s.evicted_objects, s.evicted_bytes, s.objects), (1, 100, 1));
        t.release(held.id, B).unwrap();
        ok(&t);
    }

    #[test]
    fn activity_counts_seals_replaces_deletes_and_gets_with_bytes() {
        let mut t = ObjectTable::new();
        put(&mut t, "a", 100);
        put(&mut t, "b", 50);
        let r = replace(&mut t, "a", 30, B).unwrap();
        t.seal(&n("a"), B, Some(r.id)).unwrap();
        t.release(r.id, B).unwrap();
        t.delete(&n("b")).unwrap();
        let got = vec![t.get_now(&n("a"), 0, B), t.get_now(&n("gone"), 0, B)];
        t.count_get(&got);
        let a = t.activity();
        let counted = |c: vovp_types::Counted| (c.count, c.bytes);
        assert_eq!(counted(a.seals), (3, 180));
        assert_eq!(counted(a.replaces), (1, 30));
        assert_eq!(counted(a.deletes), (1, 50));
        assert_eq!((counted(a.socket_hits), a.socket_misses), ((1, 30), 1));
        assert_eq!((a.publishes, a.shared_gets), Default::default());
        t.release(got[0].as_ref().unwrap().id, B).unwrap();
        ok(&t);
    }

    #[test]
    fn holder_usage_counts_references_and_distinct_bytes() {
        let mut t = ObjectTable::new();
        put(&mut t, "a", 100);
        put(&mut t, "b", 50);
        // B holds "a" twice and "b" once; A holds the unsealed "c" it creates.
        let held: Vec<_> = ["a", "a", "b"]
            .iter()
            .map(|name| t.get_now(&n(name), 0, B).unwrap())
            .collect();
        insert(&mut t, "c", 7, false);
        let mut usage = t.holder_usage();
        usage.sort_by_key(|u| u.holder);
        let rows: Vec<_> = usage
            .iter()
            .map(|u| (u.holder, u.references, u.bytes))
            .collect();
        assert_eq!(rows, [(A, 1, 7), (B, 3, 150)]);
        for r in held {
            t.release(r.id, B).unwrap();
        }
        t.release_holder(A);
        assert!(t.holder_usage().is_empty());
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
}
