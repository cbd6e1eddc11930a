//! Gets without a message: the store's shared directory (mapped read-only) and this
//! connection's hold table ([`vovp_shm::SharedReader`]). A get of a sealed host object is a
//! directory lookup, a hold recorded in the table and a re-validation; its release clears the
//! hold. Anything the fast path cannot serve (a name not published, an entry being rewritten,
//! a full hold table, a segment not mapped here) goes over the socket, with the same semantics.

use std::any::Any;
use std::fs::File;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use vovp::{Error, ObjectId, ObjectRef, ObjectSink};
use vovp_shm::{Hold, SharedReader, Snapshot};

/// Maps the two fds of a SHARED reply (directory first, then the hold table).
pub(crate) fn map(fds: Vec<OwnedFd>) -> Result<SharedReader, Error> {
    let [directory, holds]: [OwnedFd; 2] = fds.try_into().map_err(|fds: Vec<OwnedFd>| {
        Error::Protocol(format!("SHARED reply carried {} fds, not 2", fds.len()))
    })?;
    SharedReader::open(&File::from(directory), &File::from(holds))
        .map_err(|e| Error::Memory(format!("shared directory: {e}")))
}

/// The object a hold pins, as a reference a view can be made of; `None` when it lies outside
/// its segment's mapping (`base`, `map_len`): a directory this client cannot trust.
///
/// # Safety
/// `base` must be the start of a live mapping of the hold's segment, `map_len` bytes long.
pub(crate) unsafe fn object_ref(
    name: &str,
    hold: &Hold,
    base: *const u8,
    map_len: u64,
) -> Option<ObjectRef> {
    let s = &hold.snapshot;
    if s.offset.checked_add(s.size)? > map_len || s.meta_offset.checked_add(s.meta_len)? > map_len {
        return None;
    }
    // SAFETY: inside the mapping (checked above), in the held object's block (immutable since
    // its seal, pinned by the hold).
    let metadata = unsafe {
        std::slice::from_raw_parts(base.add(s.meta_offset as usize), s.meta_len as usize)
    };
    ObjectRef::published(name, s, metadata)
}

/// A view's release for an object got through the hold table: clear its slot, no message.
pub(crate) struct HoldSink {
    pub(crate) shared: Arc<SharedReader>,
    pub(crate) slot: usize,
    pub(crate) snapshot: Snapshot,
    /// The client's connection, kept open while the view lives: the store honours a hold
    /// table only while its connection is open (it drops the whole table when the client
    /// goes), so a view that outlives its client handle must keep the connection, as a view
    /// got over the socket does through its release path.
    pub(crate) _connection: Connection,
}

/// What keeps a client's connection open (its shared inner state).
pub(crate) type Connection = Arc<dyn Any + Send + Sync>;

impl ObjectSink for HoldSink {
    fn release(&self, _id: ObjectId) {
        // Only a hold this client made gets here, once; `release` refuses to clear a slot
        // that names anything else.
        let _ = self.shared.release(self.slot, self.snapshot);
    }

    fn seal(&self, obj: &ObjectRef) -> Result<(), Error> {
        Err(Error::AlreadySealed(obj.name.to_string()))
    }
}
