//! The store's nouns: ids, names, where an object lives, what a create asks for and what a
//! get, a list, the stats and a notification hand back. Plain data, shared by the store, the
//! wire protocol and every client.

use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

use crate::{Error, MAX_METADATA_LEN, MAX_NAME_LEN};

/// [`Error::MetadataTooLarge`] past [`MAX_METADATA_LEN`]: the store's check, which a client
/// that does not wait for the store's answer makes itself.
pub fn check_metadata(metadata: &[u8]) -> Result<(), Error> {
    if metadata.len() > MAX_METADATA_LEN {
        return Err(Error::MetadataTooLarge {
            len: metadata.len(),
            max: MAX_METADATA_LEN,
        });
    }
    Ok(())
}
/// Every object's data starts on this boundary (cache line; enough for any dtype and AVX-512).
pub const ALIGNMENT: u64 = 64;

/// Who holds references: one per client connection or embedded session. Handed out by the
/// engine only (`EngineHandle::session`), never taken from a client.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HolderId(u64);

impl HolderId {
    /// The engine's counter of holders is the only source of these.
    pub const fn from_raw(raw: u64) -> Self {
        HolderId(raw)
    }

    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for HolderId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// A unique id per object incarnation (a name reused after delete gets a new id). Travels on
/// the wire as its raw `u64` (GET and CREATE replies, RELEASE requests).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectId(u64);

impl ObjectId {
    /// An id as a client sent it back; the table checks it against its incarnation.
    pub const fn from_raw(raw: u64) -> Self {
        ObjectId(raw)
    }

    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for ObjectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// An object's name: non-empty UTF-8, at most [`MAX_NAME_LEN`] bytes. Cheap to clone.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectName(Arc<str>);

impl ObjectName {
    pub fn new(name: &str) -> Result<Self, Error> {
        if name.is_empty() {
            return Err(Error::InvalidName("empty name".into()));
        }
        if name.len() > MAX_NAME_LEN {
            return Err(Error::InvalidName(format!(
                "{} bytes long; at most {MAX_NAME_LEN}",
                name.len()
            )));
        }
        Ok(ObjectName(Arc::from(name)))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ObjectName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for ObjectName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A block inside a device pool: what a client needs to open it through CUDA IPC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceBlock {
    pub device: u32,
    /// Which pooled allocation of that device (clients cache one IPC mapping per pool).
    pub pool: u32,
    /// The pool's `CUipcMemHandle` (64 opaque bytes).
    pub ipc_handle: [u8; 64],
    /// Byte offset of the block in the pool; a multiple of the pool's block alignment (256).
    pub offset: u64,
    pub size: u64,
}

/// Where an object's bytes live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    Cuda(u32),
}

/// The exact place of an object's data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Location {
    /// `offset` bytes into host segment `segment`.
    Host { segment: u32, offset: u64 },
    /// Inside a pooled device allocation shared through CUDA IPC.
    Cuda(DeviceBlock),
}

impl Location {
    pub fn device(&self) -> Device {
        match self {
            Location::Host { .. } => Device::Cpu,
            Location::Cuda(b) => Device::Cuda(b.device),
        }
    }
}

/// What a create asks for: the put options' first three (ephemeral, device, replace; a
/// create keeps its reference and waits for its answer whatever the other two say). One
/// struct for both, so that an option is spelt once from the caller to the wire.
pub type CreateOptions = crate::PutOptions;

/// What a create or a get hands back: enough to address the bytes and to release the reference.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectRef {
    pub id: ObjectId,
    pub name: ObjectName,
    pub size: u64,
    pub metadata: Arc<[u8]>,
    pub location: Location,
    /// The name's version this object is (1 for a name's first object, one more for each
    /// replace); 0 while it is not sealed yet (a version is given at seal).
    pub version: u64,
}

/// A part of a client's own arena lent to it (LEND): the client writes objects into it itself
/// and makes each one a sealed object with one PUBLISH, so a put costs no CREATE round trip.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lend {
    /// Names the lend in PUBLISH.
    pub id: u64,
    pub segment: u32,
    /// Where the lent range starts in the segment (64-byte aligned), and its length.
    pub offset: u64,
    pub size: u64,
    /// The largest block (data padded to 64 bytes, then the metadata) a lend is made for;
    /// bigger objects go through CREATE.
    pub max_object: u64,
}

/// One row of `list`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectInfo {
    pub id: ObjectId,
    pub name: ObjectName,
    pub size: u64,
    pub device: Device,
    pub sealed: bool,
    pub ephemeral: bool,
    pub refcount: u32,
    pub last_access: SystemTime,
    pub metadata: Arc<[u8]>,
    /// See [`ObjectRef::version`].
    pub version: u64,
    /// On disk only (spilled, or being read back): its memory went to other objects, and the
    /// next get restores it.
    pub spilled: bool,
}

/// Counters of the whole store.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Host bytes the store may use.
    pub capacity: u64,
    /// Host bytes handed out by the allocator (object sizes rounded up to [`ALIGNMENT`]).
    pub used_bytes: u64,
    /// Objects with a name (sealed or not).
    pub objects: u64,
    pub sealed: u64,
    pub unsealed: u64,
    /// Deleted objects whose memory waits for their last holder.
    pub pending_delete: u64,
    /// Sum of all reference counts.
    pub references: u64,
    /// Holders (connections, sessions) that hold at least one reference.
    pub holders: u64,
    /// References held through clients' hold tables (gets without a message); also counted
    /// in `references`.
    pub shared_holds: u64,
    /// GETs waiting for a name to be sealed (each counted once, however many names it waits
    /// for): what a test, or an operator, checks to know a waiter is in place.
    pub waiting_gets: u64,
    /// Misses (a GET or CONTAINS of a missing name) that first waited for other clients'
    /// pipelined puts to be applied, ever: how a test tells "no wait" without a clock.
    pub put_barriers: u64,
    /// Connections whose client shut down its sending side (`shutdown(SHUT_WR)`), which the
    /// daemon keeps, with their references, until the client closes: the daemon has read
    /// their end. Always 0 in an embedded engine.
    pub half_closed: u64,
    pub creates: u64,
    pub evicted_objects: u64,
    pub evicted_bytes: u64,
    /// Objects on disk only now (spilled, `--spill-dir`), and their data bytes.
    pub spilled_objects: u64,
    pub spilled_bytes: u64,
    /// Objects written to disk to make room, ever, and their data bytes.
    pub spills: u64,
    pub spill_bytes: u64,
    /// Spilled objects read back into memory by a get, ever, and their data bytes.
    pub restores: u64,
    pub restore_bytes: u64,
    /// Objects evicted although spilling was on: `--spill-max` reached, the disk full, or a
    /// write failed.
    pub spill_failures: u64,
    /// Restores that found the spill file damaged, truncated or gone (the object is lost and
    /// the get raised `SpillDamaged`).
    pub restore_failures: u64,
}

/// A change pushed to subscribers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    pub kind: NotificationKind,
    pub name: ObjectName,
    pub size: u64,
    pub metadata: Arc<[u8]>,
    /// The object's version: the sealed or replacing one's; the gone one's for deleted and
    /// evicted.
    pub version: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotificationKind {
    Sealed = 1,
    Deleted = 2,
    Evicted = 3,
    /// A new version of a name was sealed in place of the previous one (a replace).
    Replaced = 4,
}
