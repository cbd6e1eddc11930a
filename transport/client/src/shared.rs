//! Gets without a message: the store's shared directory (mapped read-only) and this
//! connection's hold table (vovp-shm). A get of a sealed host object is a directory lookup, a
//! hold recorded in the table and a re-validation; its release clears the hold. Anything the
//! fast path cannot serve (a name not published, an entry being rewritten, a full hold table,
//! a segment not mapped here) goes over the socket instead, with the same semantics.

use std::fs::File;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

use vovp::{Error, Location, ObjectId, ObjectName, ObjectRef, ObjectSink};
use vovp_shm::{DirectoryMap, Get, Hold, HoldMap, Snapshot};

/// One connection's directory and hold table.
pub(crate) struct SharedReads {
    directory: DirectoryMap,
    holds: Mutex<HoldMap>,
}

impl SharedReads {
    /// Maps the two fds of a SHARED reply (directory first, then the hold table).
    pub(crate) fn map(fds: Vec<OwnedFd>) -> Result<Self, Error> {
        let [directory, holds]: [OwnedFd; 2] = fds.try_into().map_err(|fds: Vec<OwnedFd>| {
            Error::Protocol(format!("SHARED reply carried {} fds, not 2", fds.len()))
        })?;
        let map_err = |e: vovp_shm::ShmError| Error::Memory(format!("shared directory: {e}"));
        Ok(SharedReads {
            directory: DirectoryMap::open(&File::from(directory)).map_err(map_err)?,
            holds: Mutex::new(HoldMap::open(&File::from(holds)).map_err(map_err)?),
        })
    }

    /// A validated hold on `name`, or `None` when the socket must answer.
    pub(crate) fn hold(&self, name: &str) -> Option<Hold> {
        let mut holds = self.holds.lock().ok()?;
        let dir = self.directory.reader();
        let stamp = vovp_shm::now_stamp();
        match holds.with_holds(|h| h.get(&dir, name.as_bytes(), stamp)) {
            Ok(Get::Held(hold)) => Some(hold),
            // Missing, Busy, or a full table: the socket path serves it.
            Ok(_) | Err(_) => None,
        }
    }

    /// Clears a hold (the object may be freed from now on).
    pub(crate) fn release(&self, slot: usize, snapshot: Snapshot) {
        if let Ok(mut holds) = self.holds.lock() {
            // Only a hold this client made gets here, once; a mismatch would be our bug and
            // must not clear someone else's slot, which `release` checks.
            let _ = holds.with_holds(|h| h.release(Hold { slot, snapshot }));
        }
    }
}

/// Reads `len` bytes at `offset` of a mapping `base..base + map_len`, or `None` out of range.
///
/// # Safety
/// `base` must be the start of a live mapping at least `map_len` bytes long.
unsafe fn copy_range(base: *const u8, map_len: u64, offset: u64, len: u64) -> Option<Vec<u8>> {
    if offset.checked_add(len)? > map_len {
        return None;
    }
    // SAFETY: inside the mapping (checked above); the range is the held object's metadata.
    Some(unsafe { std::slice::from_raw_parts(base.add(offset as usize), len as usize) }.to_vec())
}

/// The object a hold pins, as a reference a view can be made of; `None` when it lies outside
/// `segment`'s mapping (`base`, `map_len`) — a directory this build cannot trust.
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
    s.offset.checked_add(s.size).filter(|&e| e <= map_len)?;
    // SAFETY: the caller's contract.
    let metadata = unsafe { copy_range(base, map_len, s.meta_offset, s.meta_len)? };
    Some(ObjectRef {
        id: ObjectId::from_raw(s.object_id),
        name: ObjectName::new(name).ok()?,
        size: s.size,
        metadata: Arc::from(metadata),
        location: Location::Host {
            segment: s.segment,
            offset: s.offset,
        },
    })
}

/// A view's release for an object got through the hold table: clear its slot, no message.
pub(crate) struct HoldSink {
    pub(crate) shared: Arc<SharedReads>,
    pub(crate) slot: usize,
    pub(crate) snapshot: Snapshot,
}

impl ObjectSink for HoldSink {
    fn release(&self, _id: ObjectId) {
        self.shared.release(self.slot, self.snapshot);
    }

    fn seal(&self, obj: &ObjectRef) -> Result<(), Error> {
        Err(Error::AlreadySealed(obj.name.to_string()))
    }
}
