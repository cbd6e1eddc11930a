//! The embedded engine's gets without a message: each session maps the store's shared
//! directory and a hold table of its own, as a socket client does, and reads through the same
//! code ([`vovp_shm::held`]), so a get of a sealed host object is a few reads of shared memory
//! instead of an ask of the table actor. Names the directory cannot serve go to the actor, with
//! the same semantics.

use std::sync::Arc;

use vovp_shm::held::{held_view, Holder};
use vovp_shm::SharedReader;

use crate::{Mapped, ObjectView, Segment};

/// A view of `name` through `reader`, if the directory has it in one of `segments` (the
/// engine's own: embedded objects live in segment 0). `session` is the holder the hold is made
/// for, kept alive by the view.
pub(crate) fn view(
    reader: &Arc<SharedReader>,
    segments: &[Arc<Segment>],
    name: &str,
    session: &Holder,
) -> Option<ObjectView> {
    let segment = |id: u32| {
        let seg = segments.get(id as usize).filter(|seg| seg.id() == id)?;
        let base = seg.ptr(0, 0)?;
        Some(Mapped::host(base, seg.len(), seg.clone()))
    };
    // SAFETY: the engine's segments, mapped whole for as long as `owner` lives.
    unsafe { held_view(reader, name, segment, session) }
}
