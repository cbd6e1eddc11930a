//! Views got through the hold table, with no message: the one shared-read path of the embedded
//! engine and the socket clients. A get of a sealed host object is a directory lookup, a hold
//! recorded in the table and a re-validation ([`SharedReader::hold`]); the view's release
//! clears the hold. Anything this path cannot serve (a name not published, an entry being
//! rewritten, a full hold table, a segment not mapped here, a range outside it) answers `None`
//! and the caller asks the store, with the same semantics.

use std::any::Any;
use std::sync::Arc;

use vovp_types::{Error, Location, ObjectId, ObjectName, ObjectRef, ObjectSink, ObjectView};

use crate::{to_usize, SharedReader, Snapshot};

/// A host segment as mapped in this process.
#[derive(Debug)]
pub struct SegmentMap {
    /// Start of the mapping of the whole segment.
    pub base: *const u8,
    /// Bytes mapped from `base`.
    pub len: u64,
    /// Keeps the mapping alive (views hold it).
    pub owner: Arc<dyn Any + Send + Sync>,
}

/// What keeps a holder (a client connection, an embedded session) alive: the store honours a
/// hold table only while its holder lives (it drops the whole table when the holder goes), so a
/// view that outlives the handle it came from must keep the holder, as a view got through the
/// store does through its release path.
pub type Holder = Arc<dyn Any + Send + Sync>;

/// A view of `name` through `reader`'s directory, or `None` when the store must answer.
/// `segment` maps a segment id to its mapping here.
///
/// # Safety
/// Every [`SegmentMap`] `segment` returns must describe a live mapping of that segment of the
/// store `reader` reads (the ranges of published objects are then checked against `len`).
pub unsafe fn held_view(
    reader: &Arc<SharedReader>,
    name: &str,
    segment: impl FnOnce(u32) -> Option<SegmentMap>,
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
                map.base.add(to_usize(s.offset)),
                std::slice::from_raw_parts(
                    map.base.add(to_usize(s.meta_offset)),
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

/// The part of a get the shared directory serves: a view per name `view` finds (no message),
/// and the positions of the names left for one request to the store ([`fill_in`] merges its
/// results back).
pub fn held_part(
    names: &[&str],
    mut view: impl FnMut(&str) -> Option<ObjectView>,
) -> (Vec<Option<ObjectView>>, Vec<usize>) {
    let views: Vec<_> = names.iter().map(|n| view(n)).collect();
    let missing = (0..names.len()).filter(|&i| views[i].is_none()).collect();
    (views, missing)
}

/// A whole get: the names the directory serves (`view`), then one request to the store for the
/// rest (`ask`, not called when nothing is left), merged back in order. On an error the views
/// got so far drop, releasing their holds.
pub fn get_held_first(
    names: &[&str],
    view: impl FnMut(&str) -> Option<ObjectView>,
    ask: impl FnOnce(&[&str]) -> Result<Vec<Option<ObjectView>>, Error>,
) -> Result<Vec<Option<ObjectView>>, Error> {
    let (mut views, missing) = held_part(names, view);
    if missing.is_empty() {
        return Ok(views);
    }
    let rest: Vec<&str> = missing.iter().map(|&i| names[i]).collect();
    let got = ask(&rest)?;
    fill_in(&mut views, missing, got);
    Ok(views)
}

/// Puts the views of the names the fast path missed (at `missing`, in order) into `views`.
pub fn fill_in(
    views: &mut [Option<ObjectView>],
    missing: Vec<usize>,
    got: Vec<Option<ObjectView>>,
) {
    for (i, v) in missing.into_iter().zip(got) {
        views[i] = v;
    }
}
