//! What the client's unit tests build without a daemon: memfd segments mapped as a client maps
//! them, a real shared directory and hold table (the store's side kept, to publish names and
//! take lends back), mappings as a HELLO makes them, objects, a sink that counts releases,
//! and the frames a client wrote.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use vovp_proto::{Header, Request, HEADER_LEN};
use vovp_shm::{DirectoryRegion, HoldRegion, Publish, SharedReader};
use vovp_types::{Error, Location, ObjectId, ObjectName, ObjectRef, ObjectSink};

use crate::mapping::{MappedSegment, Mappings};

/// A memfd of `len` zeroed bytes.
pub(crate) fn memfd(len: u64) -> OwnedFd {
    let fd = rustix::fs::memfd_create("vovp-client-test", rustix::fs::MemfdFlags::CLOEXEC)
        .expect("memfd");
    rustix::fs::ftruncate(&fd, len).expect("ftruncate");
    fd
}

/// One of this client's own arenas, `len` bytes, mapped read-write.
pub(crate) fn own_segment(len: u64) -> Arc<MappedSegment> {
    Arc::new(MappedSegment::map(memfd(len), len, true, true).expect("map"))
}

/// Another client's arena (or the store's segment), mapped read-only.
pub(crate) fn foreign_segment(len: u64) -> Arc<MappedSegment> {
    Arc::new(MappedSegment::map(memfd(len), len, false, false).expect("map"))
}

/// A shared directory and one hold table: the store's sides and this client's reader.
pub(crate) struct Table {
    pub(crate) directory: DirectoryRegion,
    pub(crate) holds: HoldRegion,
    pub(crate) reader: Arc<SharedReader>,
}

impl Table {
    pub(crate) fn new() -> Self {
        let directory = DirectoryRegion::create(64).expect("directory");
        let holds = HoldRegion::create(64, 1).expect("holds");
        let reader = SharedReader::open(directory.read_only_fd(), holds.fd()).expect("reader");
        Table {
            directory,
            holds,
            reader: Arc::new(reader),
        }
    }

    /// Publishes `name` (a host object of 8 bytes in segment 0) as the store would.
    pub(crate) fn publish(&mut self, name: &str) {
        let entry = Publish {
            name: name.as_bytes(),
            object_id: 1,
            segment: 0,
            offset: 0,
            size: 8,
            meta_offset: 64,
            meta_len: 0,
            flags: 0,
            version: 1,
        };
        self.directory.writer().publish(&entry).expect("publish");
    }
}

/// The mappings of a HELLO of a store of `capacity` bytes announcing no segment, with the
/// hold table `shared` when given.
pub(crate) fn mappings(capacity: u64, shared: Option<Arc<SharedReader>>) -> Mappings {
    let mut maps = Mappings::from_hello(capacity, 1 << 20, Vec::new(), Vec::new()).expect("maps");
    maps.shared = shared;
    maps
}

/// An object of `size` bytes at `offset` of host segment `segment`.
pub(crate) fn object(name: &str, segment: u32, offset: u64, size: u64) -> ObjectRef {
    ObjectRef {
        id: ObjectId::from_raw(offset + 1),
        name: ObjectName::new(name).expect("name"),
        size,
        metadata: Arc::from(&b""[..]),
        location: Location::Host { segment, offset },
        version: 1,
    }
}

/// A sink that records what views release.
#[derive(Default)]
pub(crate) struct Counted {
    pub(crate) released: Mutex<Vec<u64>>,
    pub(crate) seals: AtomicUsize,
}

impl Counted {
    pub(crate) fn released(&self) -> Vec<u64> {
        self.released.lock().expect("lock").clone()
    }
}

impl ObjectSink for Counted {
    fn release(&self, id: ObjectId) {
        self.released.lock().expect("lock").push(id.get());
    }

    fn seal(&self, obj: &ObjectRef) -> Result<u64, Error> {
        self.seals.fetch_add(1, Ordering::SeqCst);
        Ok(obj.version + 1)
    }
}

/// The frames in `out`: (opcode, flags, request id, request).
pub(crate) fn frames(out: &[u8]) -> Vec<(u8, u16, u64, Request<'static>)> {
    let mut rest = out;
    let mut v = Vec::new();
    while let Some(h) = Header::parse(rest).expect("header") {
        let req = Request::decode(h.opcode, &rest[HEADER_LEN..h.frame_len()])
            .expect("request")
            .into_owned();
        v.push((h.opcode, h.flags, h.request_id, req));
        rest = &rest[h.frame_len()..];
    }
    assert!(rest.is_empty(), "a partial frame at the end");
    v
}
