//! The wire protocol (PROTOCOL.md is its specification): frame header, field encoding, request
//! and response types, status codes. Shared by the daemon and the Rust client.

use vovp::{Device, Location, ObjectInfo, ObjectRef, StoreStats};
use vovp::{DeviceBlock, ObjectName};

pub const VERSION: u8 = 1;
pub const HEADER_LEN: usize = 16;
/// Bytes of a frame after its length field, besides the payload.
const LENGTH_OVERHEAD: u32 = 12;
pub const MAX_PAYLOAD: usize = 64 << 20;
/// Largest PUT payload (bigger objects: CREATE, write the mapping, SEAL): the store's limit.
pub const MAX_INLINE: u32 = vovp::MAX_INLINE_PUT as u32;
pub const FLAG_NO_REPLY: u16 = 1;
/// Most names one GET may ask for. A waiting GET keeps every name, a result slot and a waiter
/// entry per name (~250 bytes each), so this bounds what one request can pin in the daemon
/// (~4 MiB) whatever the frame size.
pub const MAX_GET_NAMES: usize = 16 * 1024;
/// Entries of one LIST page when the request does not say (and the most it may ask for).
pub const LIST_PAGE_ENTRIES: u32 = 4096;
pub const MAX_LIST_PAGE_ENTRIES: u32 = 64 * 1024;
/// A LIST page stops growing past this many bytes, so every reply stays far below the frame
/// limit whatever the names and metadata.
pub const LIST_PAGE_BYTES: usize = 8 << 20;
/// `next` of the last LIST page.
pub const LIST_END: u64 = u64::MAX;
pub const REPLY_BIT: u8 = 0x80;
pub const CREATE_EPHEMERAL: u32 = 1;
pub const PUT_KEEP_REFERENCE: u32 = 2;

pub mod op {
    pub const HELLO: u8 = 0x01;
    pub const CREATE: u8 = 0x02;
    pub const SEAL: u8 = 0x03;
    pub const ABORT: u8 = 0x04;
    pub const PUT: u8 = 0x05;
    pub const GET: u8 = 0x06;
    pub const RELEASE: u8 = 0x07;
    pub const CONTAINS: u8 = 0x08;
    pub const DELETE: u8 = 0x09;
    pub const LIST: u8 = 0x0A;
    pub const EVICT: u8 = 0x0B;
    pub const STATS: u8 = 0x0C;
    pub const SUBSCRIBE: u8 = 0x0D;
    pub const NOTIFY: u8 = 0x0E;
    pub const SEGMENT: u8 = 0x0F;
}

/// Reply status codes.
pub mod status {
    pub const OK: u8 = 0;
    pub const NOT_FOUND: u8 = 1;
    pub const ALREADY_EXISTS: u8 = 2;
    pub const OUT_OF_MEMORY: u8 = 3;
    pub const NOT_SEALED: u8 = 4;
    pub const ALREADY_SEALED: u8 = 5;
    pub const NOT_CREATOR: u8 = 6;
    pub const INVALID_NAME: u8 = 7;
    pub const METADATA_TOO_LARGE: u8 = 8;
    pub const NOT_HELD: u8 = 9;
    pub const GPU_UNAVAILABLE: u8 = 10;
    pub const GPU_ERROR: u8 = 11;
    pub const MALFORMED: u8 = 12;
    pub const UNSUPPORTED_VERSION: u8 = 13;
    pub const UNKNOWN_OPCODE: u8 = 14;
    pub const TOO_LARGE: u8 = 15;
    pub const SHUTTING_DOWN: u8 = 16;
    pub const INTERNAL: u8 = 17;
    pub const PROTOCOL_STATE: u8 = 18;
    pub const TOO_MANY_OBJECTS: u8 = 19;
    pub const TOO_MANY_CONNECTIONS: u8 = 20;
}

/// Errors of this crate: the wire and the socket.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("malformed frame: {0}")]
    Malformed(String),
    #[error("frame of {0} bytes is over the limit")]
    FrameTooLarge(u64),
    #[error("GET of {0} names; at most {MAX_GET_NAMES} per request")]
    TooManyNames(usize),
    #[error("unsupported protocol version {0} (this build speaks {VERSION})")]
    UnsupportedVersion(u8),
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("invalid object name: {0}")]
    InvalidName(String),
    #[error("{0}")]
    Setup(String),
}

impl From<TransportError> for vovp::Error {
    fn from(e: TransportError) -> Self {
        match e {
            TransportError::Io(e) => vovp::Error::Connection(e.to_string()),
            other => vovp::Error::Protocol(other.to_string()),
        }
    }
}

/// A parsed frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub version: u8,
    pub opcode: u8,
    pub flags: u16,
    pub request_id: u64,
    pub payload_len: usize,
}

impl Header {
    /// Parses the header at the start of `buf`; `Ok(None)` when fewer than 16 bytes are there.
    /// A bad length or version is fatal for the connection (the stream cannot resync).
    pub fn parse(buf: &[u8]) -> Result<Option<Header>, TransportError> {
        if buf.len() < HEADER_LEN {
            return Ok(None);
        }
        let length = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]);
        if length < LENGTH_OVERHEAD {
            return Err(TransportError::Malformed(format!(
                "length field {length} is below the header size"
            )));
        }
        if length as u64 > LENGTH_OVERHEAD as u64 + MAX_PAYLOAD as u64 {
            return Err(TransportError::FrameTooLarge(length as u64));
        }
        if buf[4] != VERSION {
            return Err(TransportError::UnsupportedVersion(buf[4]));
        }
        Ok(Some(Header {
            version: buf[4],
            opcode: buf[5],
            flags: u16::from_le_bytes([buf[6], buf[7]]),
            request_id: u64::from_le_bytes(buf[8..16].try_into().expect("8 bytes")),
            payload_len: (length - LENGTH_OVERHEAD) as usize,
        }))
    }

    pub fn frame_len(&self) -> usize {
        HEADER_LEN + self.payload_len
    }
}

/// Appends one frame to a buffer; the length is patched in on `finish`.
pub struct FrameWriter<'a> {
    buf: &'a mut Vec<u8>,
    start: usize,
}

impl<'a> FrameWriter<'a> {
    pub fn begin(buf: &'a mut Vec<u8>, opcode: u8, flags: u16, request_id: u64) -> Self {
        let start = buf.len();
        buf.extend_from_slice(&[0; 4]);
        buf.push(VERSION);
        buf.push(opcode);
        buf.extend_from_slice(&flags.to_le_bytes());
        buf.extend_from_slice(&request_id.to_le_bytes());
        FrameWriter { buf, start }
    }
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn i64(&mut self, v: i64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// A `str`: names and messages (cut at 65535 bytes on a char boundary).
    pub fn str(&mut self, s: &str) -> &mut Self {
        let mut end = s.len().min(u16::MAX as usize);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.u16(end as u16);
        self.buf.extend_from_slice(&s.as_bytes()[..end]);
        self
    }
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.u32(b.len() as u32);
        self.buf.extend_from_slice(b);
        self
    }
    pub fn raw(&mut self, b: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(b);
        self
    }
    pub fn location(&mut self, l: &Location) -> &mut Self {
        match l {
            Location::Host { segment, offset } => {
                self.u8(1).u32(*segment).u64(*offset);
            }
            Location::Cuda(b) => {
                self.u8(2).u32(b.device).u32(b.pool).u64(b.offset);
                self.raw(&b.ipc_handle);
            }
        }
        self
    }
    pub fn object(&mut self, r: &ObjectRef) -> &mut Self {
        self.u64(r.id.get())
            .u64(r.size)
            .location(&r.location)
            .bytes(&r.metadata)
    }
    pub fn finish(self) {
        let len = (self.buf.len() - self.start - 4) as u32;
        self.buf[self.start..self.start + 4].copy_from_slice(&len.to_le_bytes());
    }
}

/// Reads fields from a payload; every read is bounds-checked.
pub struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(b: &'a [u8]) -> Self {
        Reader { b }
    }
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], TransportError> {
        if self.b.len() < n {
            return Err(TransportError::Malformed(format!(
                "payload ends inside {what} ({} of {n} bytes)",
                self.b.len()
            )));
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }
    pub fn u8(&mut self) -> Result<u8, TransportError> {
        Ok(self.take(1, "a u8")?[0])
    }
    pub fn u16(&mut self) -> Result<u16, TransportError> {
        Ok(u16::from_le_bytes(
            self.take(2, "a u16")?.try_into().expect("2"),
        ))
    }
    pub fn u32(&mut self) -> Result<u32, TransportError> {
        Ok(u32::from_le_bytes(
            self.take(4, "a u32")?.try_into().expect("4"),
        ))
    }
    pub fn u64(&mut self) -> Result<u64, TransportError> {
        Ok(u64::from_le_bytes(
            self.take(8, "a u64")?.try_into().expect("8"),
        ))
    }
    pub fn i64(&mut self) -> Result<i64, TransportError> {
        Ok(i64::from_le_bytes(
            self.take(8, "an i64")?.try_into().expect("8"),
        ))
    }
    pub fn str(&mut self) -> Result<&'a str, TransportError> {
        let n = self.u16()? as usize;
        std::str::from_utf8(self.take(n, "a string")?)
            .map_err(|_| TransportError::Malformed("string is not UTF-8".into()))
    }
    /// An object name: a `str` whose bytes must be UTF-8 (else INVALID_NAME, not MALFORMED).
    pub fn name(&mut self) -> Result<&'a str, TransportError> {
        let n = self.u16()? as usize;
        std::str::from_utf8(self.take(n, "a name")?)
            .map_err(|_| TransportError::InvalidName("name is not UTF-8".into()))
    }
    pub fn bytes(&mut self) -> Result<&'a [u8], TransportError> {
        let n = self.u32()? as usize;
        self.take(n, "a byte string")
    }
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.b)
    }
    /// A count of items each at least `min_item` bytes: refuses counts the payload cannot hold,
    /// so a forged count cannot make us reserve huge vectors.
    pub fn count(&mut self, min_item: usize) -> Result<usize, TransportError> {
        let n = self.u32()? as usize;
        if n.saturating_mul(min_item) > self.b.len() {
            return Err(TransportError::Malformed(format!(
                "count {n} exceeds the payload"
            )));
        }
        Ok(n)
    }
    pub fn location(&mut self) -> Result<Location, TransportError> {
        match self.u8()? {
            1 => Ok(Location::Host {
                segment: self.u32()?,
                offset: self.u64()?,
            }),
            2 => {
                let device = self.u32()?;
                let pool = self.u32()?;
                let offset = self.u64()?;
                let mut ipc_handle = [0u8; 64];
                ipc_handle.copy_from_slice(self.take(64, "an IPC handle")?);
                Ok(Location::Cuda(DeviceBlock {
                    device,
                    pool,
                    ipc_handle,
                    offset,
                    size: 0,
                }))
            }
            k => Err(TransportError::Malformed(format!("location kind {k}"))),
        }
    }
    pub fn object(&mut self, name: &str) -> Result<ObjectRef, TransportError> {
        let id = self.u64()?;
        let size = self.u64()?;
        let mut location = self.location()?;
        if let Location::Cuda(b) = &mut location {
            b.size = size;
        }
        let metadata = self.bytes()?.into();
        Ok(ObjectRef {
            id: vovp::ObjectId::from_raw(id),
            name: object_name(name)?,
            size,
            metadata,
            location,
        })
    }
    pub fn finish(self) -> Result<(), TransportError> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(TransportError::Malformed(format!(
                "{} unexpected bytes after the fields",
                self.b.len()
            )))
        }
    }
}

fn object_name(name: &str) -> Result<ObjectName, TransportError> {
    ObjectName::new(name).map_err(|e| TransportError::Malformed(e.to_string()))
}

/// DLPack device codes on the wire.
pub fn device_code(d: Device) -> (u8, u32) {
    match d {
        Device::Cpu => (1, 0),
        Device::Cuda(n) => (2, n),
    }
}

pub fn device_from_code(t: u8, id: u32) -> Result<Device, TransportError> {
    match t {
        1 => Ok(Device::Cpu),
        2 => Ok(Device::Cuda(id)),
        other => Err(TransportError::Malformed(format!("device type {other}"))),
    }
}

/// A decoded request (daemon side).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Hello {
        pid: u32,
    },
    Create {
        name: String,
        size: u64,
        flags: u32,
        device: Device,
        metadata: Vec<u8>,
    },
    Seal {
        name: String,
    },
    Abort {
        name: String,
    },
    Put {
        name: String,
        flags: u32,
        metadata: Vec<u8>,
        data: Vec<u8>,
    },
    Get {
        timeout_ms: i64,
        names: Vec<String>,
    },
    Release {
        ids: Vec<u64>,
    },
    Contains {
        name: String,
    },
    Delete {
        name: String,
    },
    /// One page of the object list, from cursor `start` (0: the beginning).
    List {
        start: u64,
        limit: u32,
    },
    Evict {
        bytes: u64,
    },
    Stats,
    Subscribe,
    /// The fd of a segment this client does not have mapped yet.
    Segment {
        id: u32,
    },
}

impl Request {
    /// Decodes the payload of a request frame. `Err((status, message))` for a bad one.
    pub fn decode(opcode: u8, payload: &[u8]) -> Result<Request, (u8, String)> {
        let mut r = Reader::new(payload);
        let malformed = |e: TransportError| (status::MALFORMED, e.to_string());
        let req = (|| -> Result<Request, TransportError> {
            Ok(match opcode {
                op::HELLO => Request::Hello { pid: r.u32()? },
                op::CREATE => Request::Create {
                    name: r.name()?.to_owned(),
                    size: r.u64()?,
                    flags: r.u32()?,
                    device: {
                        let t = r.u8()?;
                        device_from_code(t, r.u32()?)?
                    },
                    metadata: r.bytes()?.to_vec(),
                },
                op::SEAL => Request::Seal {
                    name: r.name()?.to_owned(),
                },
                op::ABORT => Request::Abort {
                    name: r.name()?.to_owned(),
                },
                op::PUT => {
                    let name = r.name()?.to_owned();
                    let flags = r.u32()?;
                    let metadata = r.bytes()?.to_vec();
                    let size = r.u64()?;
                    let data = r.rest();
                    if data.len() as u64 != size {
                        return Err(TransportError::Malformed(format!(
                            "PUT announces {size} data bytes but carries {}",
                            data.len()
                        )));
                    }
                    Request::Put {
                        name,
                        flags,
                        metadata,
                        data: data.to_vec(),
                    }
                }
                op::GET => {
                    let timeout_ms = r.i64()?;
                    let n = r.count(2)?;
                    if n > MAX_GET_NAMES {
                        return Err(TransportError::TooManyNames(n));
                    }
                    let names = (0..n)
                        .map(|_| r.name().map(str::to_owned))
                        .collect::<Result<_, _>>()?;
                    Request::Get { timeout_ms, names }
                }
                op::RELEASE => {
                    let n = r.count(8)?;
                    let ids = (0..n).map(|_| r.u64()).collect::<Result<_, _>>()?;
                    Request::Release { ids }
                }
                op::CONTAINS => Request::Contains {
                    name: r.name()?.to_owned(),
                },
                op::DELETE => Request::Delete {
                    name: r.name()?.to_owned(),
                },
                // An empty payload (protocol 1's first form) is the first page.
                op::LIST if payload.is_empty() => Request::List {
                    start: 0,
                    limit: LIST_PAGE_ENTRIES,
                },
                op::LIST => {
                    let start = r.u64()?;
                    let limit = match r.u32()? {
                        0 => LIST_PAGE_ENTRIES,
                        n => n.min(MAX_LIST_PAGE_ENTRIES),
                    };
                    Request::List { start, limit }
                }
                op::EVICT => Request::Evict { bytes: r.u64()? },
                op::STATS => Request::Stats,
                op::SUBSCRIBE => Request::Subscribe,
                op::SEGMENT => Request::Segment { id: r.u32()? },
                _ => return Err(TransportError::Setup(String::new())),
            })
        })();
        match req {
            Err(TransportError::Setup(_)) => Err((
                status::UNKNOWN_OPCODE,
                format!("unknown opcode {opcode:#04x}"),
            )),
            Err(TransportError::InvalidName(why)) => Err((status::INVALID_NAME, why)),
            Err(e @ TransportError::TooManyNames(_)) => Err((status::TOO_LARGE, e.to_string())),
            Err(e) => Err(malformed(e)),
            Ok(req) => {
                r.finish().map_err(malformed)?;
                Ok(req)
            }
        }
    }
}

/// A reply body (daemon side encodes, client side decodes by the opcode it asked).
#[derive(Debug, kameo::Reply)]
pub enum Response {
    Empty,
    Hello {
        capacity: u64,
        max_inline: u32,
        segments: Vec<(u32, u64)>,
    },
    Object(ObjectRef),
    Objects(Vec<Option<ObjectRef>>),
    Bool(bool),
    Count(u64),
    /// One LIST page and the cursor of the next ([`LIST_END`] after the last).
    List {
        entries: Vec<ObjectInfo>,
        next: u64,
    },
    Stats {
        stats: StoreStats,
        connections: u64,
    },
    Subscribed(tokio::sync::mpsc::Receiver<vovp::Notification>),
    /// A segment to map: its size, and whether this client may write it (its fd, read-write or
    /// read-only to match, rides on the reply as SCM_RIGHTS).
    Segment {
        segment: std::sync::Arc<vovp::Segment>,
        writable: bool,
    },
    /// The client side's view of a SEGMENT reply (the fd is received separately).
    SegmentInfo {
        size: u64,
        writable: bool,
    },
    Failure {
        status: u8,
        message: String,
        oom: Option<(u64, u64)>,
    },
    /// Nothing is written back (RELEASE with NO_REPLY).
    NoReply,
}

impl Response {
    pub fn error(status: u8, message: impl Into<String>) -> Self {
        Response::Failure {
            status,
            message: message.into(),
            oom: None,
        }
    }

    /// Appends the reply frame for request `opcode`/`request_id`.
    pub fn encode(&self, opcode: u8, request_id: u64, buf: &mut Vec<u8>) {
        if matches!(self, Response::NoReply) {
            return;
        }
        let mut w = FrameWriter::begin(buf, opcode | REPLY_BIT, 0, request_id);
        match self {
            Response::Failure {
                status,
                message,
                oom,
            } => {
                w.u8(*status).str(message);
                if let Some((requested, available)) = oom {
                    w.u64(*requested).u64(*available);
                }
            }
            other => {
                w.u8(status::OK);
                match other {
                    Response::Hello {
                        capacity,
                        max_inline,
                        segments,
                    } => {
                        w.u16(VERSION as u16).u64(*capacity).u32(*max_inline);
                        w.u32(segments.len() as u32);
                        for (id, size) in segments {
                            w.u32(*id).u64(*size);
                        }
                    }
                    Response::Object(r) => {
                        w.object(r);
                    }
                    Response::Objects(v) => {
                        w.u32(v.len() as u32);
                        for o in v {
                            match o {
                                None => {
                                    w.u8(0);
                                }
                                Some(r) => {
                                    w.u8(1).object(r);
                                }
                            }
                        }
                    }
                    Response::Bool(b) => {
                        w.u8(*b as u8);
                    }
                    Response::Count(n) => {
                        w.u64(*n);
                    }
                    Response::List { entries, next } => {
                        w.u32(entries.len() as u32);
                        for i in entries {
                            let (t, id) = device_code(i.device);
                            let ms = i
                                .last_access
                                .duration_since(std::time::UNIX_EPOCH)
                                .map(|d| d.as_millis() as u64)
                                .unwrap_or(0);
                            w.str(i.name.as_str())
                                .u64(i.id.get())
                                .u64(i.size)
                                .u8(t)
                                .u32(id);
                            w.u8(i.sealed as u8)
                                .u8(i.ephemeral as u8)
                                .u32(i.refcount)
                                .u64(ms);
                            w.bytes(&i.metadata);
                        }
                        w.u64(*next);
                    }
                    Response::Stats {
                        stats: s,
                        connections,
                    } => {
                        for v in [
                            s.capacity,
                            s.used_bytes,
                            s.objects,
                            s.sealed,
                            s.unsealed,
                            s.pending_delete,
                            s.references,
                            s.holders,
                            s.creates,
                            s.evicted_objects,
                            s.evicted_bytes,
                            *connections,
                        ] {
                            w.u64(v);
                        }
                    }
                    Response::Segment { segment, writable } => {
                        w.u64(segment.len()).u8(*writable as u8);
                    }
                    Response::SegmentInfo { size, writable } => {
                        w.u64(*size).u8(*writable as u8);
                    }
                    Response::Empty | Response::Subscribed(_) => {}
                    Response::Failure { .. } | Response::NoReply => unreachable!("handled above"),
                }
            }
        }
        w.finish();
    }
}

/// Bytes one LIST entry takes on the wire (see `Response::List`'s encoding).
pub fn list_entry_bytes(i: &ObjectInfo) -> usize {
    2 + i.name.as_str().len() + 8 + 8 + 1 + 4 + 1 + 1 + 4 + 8 + 4 + i.metadata.len()
}

/// Maps a store error to its status code and message.
pub fn error_response(e: &vovp::Error) -> Response {
    use vovp::Error as E;
    let code = match e {
        E::NotFound(_) => status::NOT_FOUND,
        E::AlreadyExists(_) => status::ALREADY_EXISTS,
        E::OutOfMemory {
            requested,
            available,
        } => {
            return Response::Failure {
                status: status::OUT_OF_MEMORY,
                message: e.to_string(),
                oom: Some((*requested, *available)),
            }
        }
        E::TooManyObjects { .. } => status::TOO_MANY_OBJECTS,
        E::NotSealed(_) => status::NOT_SEALED,
        E::AlreadySealed(_) => status::ALREADY_SEALED,
        E::NotCreator(_) => status::NOT_CREATOR,
        E::InvalidName(_) => status::INVALID_NAME,
        E::MetadataTooLarge { .. } => status::METADATA_TOO_LARGE,
        E::NotHeld(_) => status::NOT_HELD,
        E::GpuUnavailable(_) => status::GPU_UNAVAILABLE,
        E::Gpu(_) => status::GPU_ERROR,
        E::ShuttingDown => status::SHUTTING_DOWN,
        E::TooLarge(_) => status::TOO_LARGE,
        E::Protocol(_) | E::Tensor(_) | E::Config(_) => status::MALFORMED,
        E::Memory(_) | E::Connection(_) | E::Internal(_) => status::INTERNAL,
    };
    Response::error(code, e.to_string())
}

/// The client-side view of an error reply.
pub fn error_from_reply(status: u8, message: String, oom: Option<(u64, u64)>) -> vovp::Error {
    use vovp::Error as E;
    // Messages from the daemon are full sentences; keep them, the variant carries the meaning.
    match status {
        status::NOT_FOUND => E::NotFound(message),
        status::ALREADY_EXISTS => E::AlreadyExists(message),
        status::OUT_OF_MEMORY => {
            let (requested, available) = oom.unwrap_or((0, 0));
            E::OutOfMemory {
                requested,
                available,
            }
        }
        status::TOO_MANY_OBJECTS => E::TooManyObjects {
            limit: vovp::MAX_OBJECTS,
        },
        status::NOT_SEALED => E::NotSealed(message),
        status::ALREADY_SEALED => E::AlreadySealed(message),
        status::NOT_CREATOR => E::NotCreator(message),
        status::INVALID_NAME => E::InvalidName(message),
        status::METADATA_TOO_LARGE => E::MetadataTooLarge {
            len: 0,
            max: vovp::MAX_METADATA_LEN,
        },
        status::NOT_HELD => E::NotHeld(0),
        status::GPU_UNAVAILABLE => E::GpuUnavailable(message),
        status::GPU_ERROR => E::Gpu(message),
        status::SHUTTING_DOWN => E::ShuttingDown,
        status::TOO_LARGE => E::TooLarge(message),
        status::INTERNAL => E::Internal(message),
        status::TOO_MANY_CONNECTIONS => E::Connection(message),
        _ => E::Protocol(format!("status {status}: {message}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_reject_bad_lengths_and_versions() {
        let mut buf = Vec::new();
        FrameWriter::begin(&mut buf, op::STATS, 0, 42).finish();
        let h = Header::parse(&buf).unwrap().unwrap();
        assert_eq!((h.opcode, h.request_id, h.payload_len), (op::STATS, 42, 0));
        assert!(Header::parse(&buf[..10]).unwrap().is_none());
        let mut bad = buf.clone();
        bad[4] = 9;
        assert!(matches!(
            Header::parse(&bad),
            Err(TransportError::UnsupportedVersion(9))
        ));
        let mut huge = buf.clone();
        huge[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            Header::parse(&huge),
            Err(TransportError::FrameTooLarge(_))
        ));
        let mut tiny = buf;
        tiny[..4].copy_from_slice(&3u32.to_le_bytes());
        assert!(Header::parse(&tiny).is_err());
    }

    #[test]
    fn truncated_and_forged_payloads_are_malformed() {
        assert_eq!(
            Request::decode(op::SEAL, &[5, 0, b'a']).unwrap_err().0,
            status::MALFORMED
        );
        // A count of 4 billion names in 8 bytes.
        let mut p = 0i64.to_le_bytes().to_vec();
        p.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            Request::decode(op::GET, &p).unwrap_err().0,
            status::MALFORMED
        );
        assert_eq!(
            Request::decode(0x77, &[]).unwrap_err().0,
            status::UNKNOWN_OPCODE
        );
        assert_eq!(
            Request::decode(op::STATS, &[1]).unwrap_err().0,
            status::MALFORMED
        );
    }

    /// Regression (D3): a GET of millions of 1-byte names is refused before anything is built.
    #[test]
    fn get_names_are_bounded() {
        let n = MAX_GET_NAMES + 1;
        let mut p = 0i64.to_le_bytes().to_vec();
        p.extend_from_slice(&(n as u32).to_le_bytes());
        for _ in 0..n {
            p.extend_from_slice(&[1, 0, b'x']);
        }
        let (code, message) = Request::decode(op::GET, &p).unwrap_err();
        assert_eq!(code, status::TOO_LARGE, "{message}");
        assert!(message.contains("16384"), "{message}");
        p.truncate(12);
        p[8..12].copy_from_slice(&(MAX_GET_NAMES as u32).to_le_bytes());
        for _ in 0..MAX_GET_NAMES {
            p.extend_from_slice(&[1, 0, b'x']);
        }
        assert!(
            matches!(Request::decode(op::GET, &p), Ok(Request::Get { names, .. }) if names.len() == MAX_GET_NAMES)
        );
    }

    #[test]
    fn list_requests_page() {
        assert_eq!(
            Request::decode(op::LIST, &[]).unwrap(),
            Request::List {
                start: 0,
                limit: LIST_PAGE_ENTRIES
            }
        );
        let mut p = 77u64.to_le_bytes().to_vec();
        p.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            Request::decode(op::LIST, &p).unwrap(),
            Request::List {
                start: 77,
                limit: MAX_LIST_PAGE_ENTRIES
            }
        );
    }
}
