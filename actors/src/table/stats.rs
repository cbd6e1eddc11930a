//! What the table tells the outside about itself: counters (creates, evictions), the
//! notifications subscribers get (sealed, replaced, deleted, evicted: recorded only while
//! someone subscribes), and the read-only views of the objects: `info`, `list`, list pages,
//! STATS. The views count holds through hold tables as references, so a client's get without
//! a message shows up as one.
//!
//! Invariants: the counters only grow; events are recorded only while `recording`, in the
//! order the table made the changes.

use std::collections::HashMap;

use vovp_types::{Notification, NotificationKind, ObjectInfo, StoreStats};

use super::objects::Entry;
use super::ObjectTable;

/// What the table did: counters, and the notification log while someone subscribes.
#[derive(Default)]
pub(super) struct Activity {
    creates: u64,
    evicted_objects: u64,
    evicted_bytes: u64,
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
    use crate::table::test_support::{n, ok, put, B};

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
