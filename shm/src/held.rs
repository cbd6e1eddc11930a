//! Views got through the hold table, with no message: the one shared-read path of the embedded
//! engine and the socket clients. A get of a sealed host object is a directory lookup, a hold
//! recorded in the table and a re-validation ([`SharedReader::hold`]); the view's release
//! clears the hold. Anything this path cannot serve (a name not published, an entry being
//! rewritten, a full hold table, a segment not mapped here, a range outside it) answers `None`
//! and the caller asks the store, with the same semantics.

use std::any::Any;
use std::sync::Arc;

use vovp_types::{
    Error, Location, Mapped, ObjectId, ObjectName, ObjectRef, ObjectSink, ObjectView,
};

use crate::{to_usize, SharedReader, Snapshot};

/// What keeps a holder (a client connection, an embedded session) alive: the store honours a
/// hold table only while its holder lives (it drops the whole table when the holder goes), so a
/// view that outlives the handle it came from must keep the holder, as a view got through the
/// store does through its release path.
pub type Holder = Arc<dyn Any + Send + Sync>;

/// A view of `name` through `reader`'s directory, or `None` when the store must answer.
/// `segment` maps a segment id to the mapping of the whole segment here.
///
/// # Safety
/// Every [`Mapped`] `segment` returns must describe a live mapping of that whole segment of
/// the store `reader` reads (the ranges of published objects are then checked against `len`).
pub unsafe fn held_view(
    reader: &Arc<SharedReader>,
    name: &str,
    segment: impl FnOnce(u32) -> Option<Mapped>,
    holder: &Holder,
) -> Option<ObjectView> {
    let hold = reader.hold(name)?;
    let (slot, snapshot) = (hold.slot, hold.snapshot);
    let made = segment(snapshot.segment).and_then(|map| {
        let s = &snapshot;
        if s.offset.checked_add(s.size)? > map.len
            || s.meta_offset.checked_add(s.meta_len)? > map.len
        {
            return None;
        }
        // SAFETY: inside the mapping (checked above), in the held object's block (written at
        // create, immutable since its seal, pinned by the hold).
        let (data, metadata) = unsafe {
            (
                map.ptr.add(to_usize(s.offset)).cast_const(),
                std::slice::from_raw_parts(
                    map.ptr.add(to_usize(s.meta_offset)),
                    to_usize(s.meta_len),
                ),
            )
        };
        let obj = published_ref(name, s, metadata)?;
        let sink = Arc::new(HoldSink {
            reader: reader.clone(),
            slot,
            snapshot,
            _holder: holder.clone(),
        });
        // SAFETY: the object's bytes in a live mapping kept by `map.owner`, immutable (sealed).
        Some(unsafe { ObjectView::from_raw(obj, data, map.owner, sink) })
    });
    if made.is_none() {
        let _ = reader.release(slot, snapshot);
    }
    made
}

/// The object a directory entry describes, for a reader holding it: `metadata` is what it read
/// at the entry's `meta_offset` (the store wrote it there at create). `None` for a name that is
/// not one.
fn published_ref(name: &str, s: &Snapshot, metadata: &[u8]) -> Option<ObjectRef> {
    Some(ObjectRef {
        id: ObjectId::from_raw(s.object_id),
        name: ObjectName::new(name).ok()?,
        size: s.size,
        metadata: Arc::from(metadata),
        location: Location::Host {
            segment: s.segment,
            offset: s.offset,
        },
        version: s.version,
    })
}

/// A view's release for an object got through the hold table: clear its slot, no message.
struct HoldSink {
    reader: Arc<SharedReader>,
    slot: usize,
    snapshot: Snapshot,
    _holder: Holder,
}

impl ObjectSink for HoldSink {
    fn release(&self, _id: ObjectId) {
        // Only a hold this process made gets here, once; `release` refuses to clear a slot that
        // names anything else.
        let _ = self.reader.release(self.slot, self.snapshot);
    }

    fn seal(&self, obj: &ObjectRef) -> Result<u64, Error> {
        Err(Error::AlreadySealed(obj.name.to_string()))
    }
}

/// One get, the shared directory first: the one get route of the embedded engine and both
/// clients. [`DirectoryPart::look`] looks each name up once (a view per name the directory
/// serves, no message); the names left go to the store in one request
/// ([`DirectoryPart::rest`]), whose answers [`DirectoryPart::fill`] merges back in order. The
/// store is never asked about a name the directory served, and the directory is never asked
/// twice: a caller that must not block while holding something (the Python core holds the GIL
/// for the lookups only) takes the two halves apart.
#[derive(Debug)]
pub struct DirectoryPart<'n> {
    names: &'n [&'n str],
    views: Vec<Option<ObjectView>>,
    /// Positions of the names the directory did not serve, in order.
    missing: Vec<usize>,
}

impl<'n> DirectoryPart<'n> {
    /// Looks every name of `names` up through `view` (a directory lookup and a hold, or `None`
    /// when the store must answer).
    pub fn look(names: &'n [&'n str], mut view: impl FnMut(&str) -> Option<ObjectView>) -> Self {
        let views: Vec<_> = names.iter().map(|n| view(n)).collect();
        let missing = (0..names.len()).filter(|&i| views[i].is_none()).collect();
        DirectoryPart {
            names,
            views,
            missing,
        }
    }

    /// Whether the directory served every name (nothing to ask the store).
    pub fn is_served(&self) -> bool {
        self.missing.is_empty()
    }

    /// The names to ask the store for, in order (empty when [`DirectoryPart::is_served`]).
    pub fn rest(&self) -> Vec<&'n str> {
        self.missing.iter().map(|&i| self.names[i]).collect()
    }

    /// Every name's view: the directory's, and `got` (the store's answers for
    /// [`DirectoryPart::rest`], in order) at the others' places.
    pub fn fill(mut self, got: Vec<Option<ObjectView>>) -> Vec<Option<ObjectView>> {
        for (i, v) in self.missing.into_iter().zip(got) {
            self.views[i] = v;
        }
        self.views
    }

    /// The whole get: `ask` (not called when nothing is left) gets the rest from the store.
    /// On an error the views got so far drop, releasing their holds.
    pub fn then_ask(
        self,
        ask: impl FnOnce(&[&str]) -> Result<Vec<Option<ObjectView>>, Error>,
    ) -> Result<Vec<Option<ObjectView>>, Error> {
        if self.is_served() {
            return Ok(self.views);
        }
        let got = ask(&self.rest())?;
        Ok(self.fill(got))
    }
}

/// `get_newer`'s directory half: the directory's view of a name when it is a version above
/// `newer_than`; an older one is let go at once (its hold cleared), and the store is asked.
pub fn newer(view: Option<ObjectView>, newer_than: u64) -> Option<ObjectView> {
    view.filter(|v| v.version() > newer_than)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    /// Counts what views release (no store behind them).
    #[derive(Default)]
    struct Counted {
        released: AtomicUsize,
        looked: Mutex<Vec<String>>,
    }

    impl ObjectSink for Counted {
        fn release(&self, _id: ObjectId) {
            self.released.fetch_add(1, Ordering::SeqCst);
        }
        fn seal(&self, obj: &ObjectRef) -> Result<u64, Error> {
            Err(Error::AlreadySealed(obj.name.to_string()))
        }
    }

    fn view(sink: &Arc<Counted>, name: &str, version: u64) -> ObjectView {
        let obj = ObjectRef {
            id: ObjectId::from_raw(version),
            name: ObjectName::new(name).unwrap(),
            size: 0,
            metadata: Arc::from(&b""[..]),
            location: Location::Host {
                segment: 0,
                offset: 0,
            },
            version,
        };
        // SAFETY: an empty object, never read.
        unsafe { ObjectView::from_raw(obj, std::ptr::null(), Arc::new(()), sink.clone()) }
    }

    /// A directory holding the names starting with "d", recording every lookup.
    fn directory(sink: &Arc<Counted>) -> impl FnMut(&str) -> Option<ObjectView> + '_ {
        move |n| {
            sink.looked.lock().unwrap().push(n.to_owned());
            n.starts_with('d').then(|| view(sink, n, 1))
        }
    }

    #[test]
    fn the_directory_serves_first_and_the_store_gets_only_the_rest_once() {
        let sink = Arc::new(Counted::default());
        let names = ["d1", "s1", "d2", "s2"];
        let part = DirectoryPart::look(&names, directory(&sink));
        assert!(!part.is_served());
        assert_eq!(part.rest(), ["s1", "s2"]);
        let mut asked = Vec::new();
        let views = part
            .then_ask(|rest| {
                asked.extend(rest.iter().map(|s| s.to_string()));
                Ok(vec![Some(view(&sink, "s1", 2)), None])
            })
            .unwrap();
        let got: Vec<_> = views
            .iter()
            .map(|v| v.as_ref().map(|v| (v.name().to_string(), v.version())))
            .collect();
        assert_eq!(
            got,
            [
                Some(("d1".into(), 1)),
                Some(("s1".into(), 2)),
                Some(("d2".into(), 1)),
                None
            ]
        );
        assert_eq!(asked, ["s1", "s2"]);
        // One lookup per name, none repeated.
        assert_eq!(*sink.looked.lock().unwrap(), names);
    }

    #[test]
    fn a_get_the_directory_serves_whole_asks_nothing() {
        let sink = Arc::new(Counted::default());
        let names = ["d1", "d2"];
        let part = DirectoryPart::look(&names, directory(&sink));
        assert!(part.is_served() && part.rest().is_empty());
        let views = part.then_ask(|_| panic!("asked the store")).unwrap();
        assert!(views.iter().all(Option::is_some));
        assert_eq!(
            DirectoryPart::look(&[], directory(&sink))
                .fill(Vec::new())
                .len(),
            0
        );
    }

    #[test]
    fn a_failed_ask_lets_the_directory_views_go() {
        let sink = Arc::new(Counted::default());
        let names = ["d1", "s1"];
        let part = DirectoryPart::look(&names, directory(&sink));
        let e = part.then_ask(|_| Err(Error::Connection("gone".into())));
        assert!(matches!(e, Err(Error::Connection(_))));
        assert_eq!(sink.released.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn an_older_version_from_the_directory_is_let_go() {
        let sink = Arc::new(Counted::default());
        assert!(newer(Some(view(&sink, "d", 3)), 3).is_none());
        assert_eq!(sink.released.load(Ordering::SeqCst), 1);
        assert_eq!(
            newer(Some(view(&sink, "d", 4)), 3).map(|v| v.version()),
            Some(4)
        );
        assert!(newer(None, 0).is_none());
    }
}
