//! The embedded engine's gets without a message: each session maps the store's shared
//! directory and a hold table of its own, as a socket client does, so a get of a sealed host
//! object is a few reads of shared memory instead of an ask of the table actor. Names the
//! directory cannot serve go to the actor, with the same semantics.

use std::sync::Arc;

use vovp_actors::{ObjectId, ObjectRef};
use vovp_shm::{SharedReader, Snapshot};

use crate::view::{Mapped, ObjectSink, ObjectView};
use crate::{Error, Segment};

/// A view of `name` through `reader`, if the directory has it in one of `segments` (the
/// engine's own: embedded objects live in segment 0). `session` is the session the hold is
/// made for, kept alive by the view: the store honours a hold table only while its holder
/// lives (the session's last drop releases everything it held, its hold table included).
pub(crate) fn view(
    reader: &Arc<SharedReader>,
    segments: &[Arc<Segment>],
    name: &str,
    session: &Arc<dyn ObjectSink>,
) -> Option<ObjectView> {
    let hold = reader.hold(name)?;
    let (slot, snapshot) = (hold.slot, hold.snapshot);
    let made = object_of(segments, name, &snapshot).map(|(r, mapped)| {
        let sink = Arc::new(HoldSink {
            reader: reader.clone(),
            slot,
            snapshot,
            _session: session.clone(),
        });
        ObjectView::from_mapped(r, mapped, sink)
    });
    if made.is_none() {
        let _ = reader.release(slot, snapshot);
    }
    made
}

fn object_of(segments: &[Arc<Segment>], name: &str, s: &Snapshot) -> Option<(ObjectRef, Mapped)> {
    let seg = segments
        .get(s.segment as usize)
        .filter(|seg| seg.id() == s.segment)?;
    let ptr = seg.ptr(s.offset, s.size)?;
    let meta = seg.ptr(s.meta_offset, s.meta_len)?;
    // SAFETY: inside the segment (`ptr` checked the range), in the held object's block,
    // written at create and immutable since its seal; the hold pins it.
    let metadata = unsafe { std::slice::from_raw_parts(meta, s.meta_len as usize) };
    let r = ObjectRef::published(name, s, metadata)?;
    let mapped = Mapped {
        ptr,
        device_ptr: 0,
        owner: seg.clone(),
    };
    Some((r, mapped))
}

/// A view's release for an object got through the hold table: clear its slot, no message.
struct HoldSink {
    reader: Arc<SharedReader>,
    slot: usize,
    snapshot: Snapshot,
    /// The holder, alive while the view is (see [`view`]).
    _session: Arc<dyn ObjectSink>,
}

impl ObjectSink for HoldSink {
    fn release(&self, _id: ObjectId) {
        let _ = self.reader.release(self.slot, self.snapshot);
    }

    fn seal(&self, obj: &ObjectRef) -> Result<(), Error> {
        Err(Error::AlreadySealed(obj.name.to_string()))
    }
}
