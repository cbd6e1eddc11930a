//! The Rust client: [`Client`] (blocking) and [`AsyncClient`] (tokio) speak PROTOCOL.md to a
//! `vovp-engine` and implement the same [`Store`]/[`AsyncStore`] traits as the embedded engine,
//! so a framework switches between them in one line. Got objects are zero-copy views into the
//! segments mapped at connect time; dropping a view releases its reference.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use memmap2::{MmapOptions, MmapRaw};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vovp::{
    parallel_copy, AsyncStore, CreateOptions, Device, Error, Location, ObjectBuffer, ObjectId,
    ObjectInfo, ObjectName, ObjectRef, ObjectSink, ObjectView, Store, StoreStats,
};

use crate::protocol::*;

/// One shared-memory segment mapped into this process: read-only unless it is one of this
/// client's own arenas (the daemon decides, by the fd it hands over).
struct MappedSegment {
    map: MmapRaw,
    writable: bool,
}

impl MappedSegment {
    fn map(fd: std::os::fd::OwnedFd, size: u64, writable: bool) -> Result<Self, Error> {
        let file = File::from(fd);
        let mut opts = MmapOptions::new();
        opts.len(usize::try_from(size).map_err(|_| Error::Protocol("segment size".into()))?);
        let map = if writable {
            opts.map_raw(&file)
        } else {
            opts.map_raw_read_only(&file)
        }
        .map_err(|e| Error::Memory(format!("mapping a segment of {size} bytes: {e}")))?;
        Ok(MappedSegment { map, writable })
    }
}

/// A mapped segment as the client keeps it: the store's segment and the client's own arenas
/// for the connection's life; other clients' arenas only while a view into them lives (the
/// views hold the mapping), so an arena the daemon dropped is unmapped here too.
enum SegmentSlot {
    Kept(Arc<MappedSegment>),
    WhileViewed(std::sync::Weak<MappedSegment>),
}

// SAFETY: the mapping is shared memory addressed through raw pointers only.
unsafe impl Send for MappedSegment {}
unsafe impl Sync for MappedSegment {}

/// A request as the client encodes it (fields borrowed from the caller).
enum Call<'a> {
    Create {
        name: &'a str,
        size: u64,
        options: CreateOptions,
        metadata: &'a [u8],
    },
    Seal(&'a str),
    Abort(&'a str),
    Put {
        name: &'a str,
        flags: u32,
        metadata: &'a [u8],
        data: &'a [u8],
    },
    Get {
        names: &'a [&'a str],
        timeout: Option<Duration>,
    },
    Release(&'a [u64]),
    Contains(&'a str),
    Delete(&'a str),
    /// One LIST page from this cursor.
    List(u64),
    Evict(u64),
    Stats,
}

impl Call<'_> {
    fn opcode(&self) -> u8 {
        match self {
            Call::Create { .. } => op::CREATE,
            Call::Seal(_) => op::SEAL,
            Call::Abort(_) => op::ABORT,
            Call::Put { .. } => op::PUT,
            Call::Get { .. } => op::GET,
            Call::Release(_) => op::RELEASE,
            Call::Contains(_) => op::CONTAINS,
            Call::Delete(_) => op::DELETE,
            Call::List(_) => op::LIST,
            Call::Evict(_) => op::EVICT,
            Call::Stats => op::STATS,
        }
    }

    fn encode(&self, buf: &mut Vec<u8>, flags: u16, request_id: u64) -> Result<(), Error> {
        let mut w = FrameWriter::begin(buf, self.opcode(), flags, request_id);
        let name = |n: &str| -> Result<(), Error> { ObjectName::new(n).map(|_| ()) };
        match self {
            Call::Create {
                name: n,
                size,
                options,
                metadata,
            } => {
                name(n)?;
                let (t, id) = device_code(options.device.unwrap_or(Device::Cpu));
                let flags = if options.ephemeral {
                    CREATE_EPHEMERAL
                } else {
                    0
                };
                w.str(n).u64(*size).u32(flags).u8(t).u32(id).bytes(metadata);
            }
            Call::Seal(n) | Call::Abort(n) | Call::Contains(n) | Call::Delete(n) => {
                name(n)?;
                w.str(n);
            }
            Call::Put {
                name: n,
                flags,
                metadata,
                data,
            } => {
                name(n)?;
                w.str(n)
                    .u32(*flags)
                    .bytes(metadata)
                    .u64(data.len() as u64)
                    .raw(data);
            }
            Call::Get { names, timeout } => {
                for n in names.iter() {
                    name(n)?;
                }
                let ms = match timeout {
                    None => 0,
                    Some(d) if d.as_millis() >= i64::MAX as u128 => -1,
                    Some(d) => d.as_millis().max(1) as i64,
                };
                w.i64(ms).u32(names.len() as u32);
                for n in names.iter() {
                    w.str(n);
                }
            }
            Call::Release(ids) => {
                w.u32(ids.len() as u32);
                for id in ids.iter() {
                    w.u64(*id);
                }
            }
            Call::List(start) => {
                // limit 0: the daemon's page size.
                w.u64(*start).u32(0);
            }
            Call::Stats => {}
            Call::Evict(bytes) => {
                w.u64(*bytes);
            }
        }
        w.finish();
        Ok(())
    }
}

/// Reads a reply's status; an error status (with its message and details) becomes `Err`.
fn read_status(r: &mut Reader<'_>) -> Result<(), Error> {
    let st = r.u8()?;
    if st == status::OK {
        return Ok(());
    }
    let message = r.str()?.to_owned();
    let oom = if st == status::OUT_OF_MEMORY {
        Some((r.u64()?, r.u64()?))
    } else {
        None
    };
    Err(error_from_reply(st, message, oom))
}

/// Decodes a reply payload to `Call` `opcode`; an error status becomes `Err`.
fn decode_reply(opcode: u8, payload: &[u8], names: &[&str]) -> Result<Response, Error> {
    let mut r = Reader::new(payload);
    read_status(&mut r)?;
    let resp = match opcode {
        op::CREATE | op::PUT => Response::Object(r.object(names[0])?),
        op::GET => {
            let n = r.count(1)?;
            if n != names.len() {
                return Err(Error::Protocol(format!(
                    "asked {} names, got {n}",
                    names.len()
                )));
            }
            let mut v = Vec::with_capacity(n);
            for name in names {
                v.push(match r.u8()? {
                    0 => None,
                    _ => Some(r.object(name)?),
                });
            }
            Response::Objects(v)
        }
        op::CONTAINS => Response::Bool(r.u8()? != 0),
        op::EVICT => Response::Count(r.u64()?),
        op::LIST => {
            let n = r.count(1)?;
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                let name = ObjectName::new(r.str()?)?;
                let id = r.u64()?;
                let size = r.u64()?;
                let t = r.u8()?;
                let device = device_from_code(t, r.u32()?)?;
                let sealed = r.u8()? != 0;
                let ephemeral = r.u8()? != 0;
                let refcount = r.u32()?;
                let last_access = UNIX_EPOCH + Duration::from_millis(r.u64()?);
                let metadata = r.bytes()?.into();
                v.push(ObjectInfo {
                    id: ObjectId::from_raw(id),
                    name,
                    size,
                    device,
                    sealed,
                    ephemeral,
                    refcount,
                    last_access,
                    metadata,
                });
            }
            let next = r.u64()?;
            Response::List { entries: v, next }
        }
        op::STATS => {
            let mut f = [0u64; 12];
            for x in f.iter_mut() {
                *x = r.u64()?;
            }
            Response::Stats {
                stats: StoreStats {
                    capacity: f[0],
                    used_bytes: f[1],
                    objects: f[2],
                    sealed: f[3],
                    unsealed: f[4],
                    pending_delete: f[5],
                    references: f[6],
                    holders: f[7],
                    creates: f[8],
                    evicted_objects: f[9],
                    evicted_bytes: f[10],
                },
                connections: f[11],
            }
        }
        _ => Response::Empty,
    };
    r.finish()?;
    Ok(resp)
}

/// Reply decoding without a connection, for the fuzz targets in `fuzz/` only; not API.
/// `names` are the names the request asked for (at least one for CREATE/PUT).
#[doc(hidden)]
pub fn decode_reply_for_fuzzing(
    opcode: u8,
    payload: &[u8],
    names: &[&str],
) -> Result<Response, Error> {
    decode_reply(opcode, payload, names)
}

/// What both clients share: the mapped segments and the releases waiting to be sent.
struct Mappings {
    segments: Mutex<std::collections::HashMap<u32, SegmentSlot>>,
    max_inline: u32,
    capacity: u64,
}

/// Where an object is in this process: (host address or null, device address or 0, owner).
type Located = (*mut u8, u64, Arc<dyn std::any::Any + Send + Sync>);

impl Mappings {
    fn locate(&self, r: &ObjectRef) -> Result<Located, Error> {
        match r.location {
            Location::Host { segment, offset } => {
                let seg = self
                    .segment(segment)
                    .ok_or_else(|| Error::Protocol(format!("unknown segment {segment}")))?;
                let end = offset
                    .checked_add(r.size)
                    .filter(|&e| e <= seg.map.len() as u64);
                if end.is_none() {
                    return Err(Error::Protocol("object outside its segment".into()));
                }
                // SAFETY: in bounds (checked above).
                let ptr = unsafe { seg.map.as_mut_ptr().add(offset as usize) };
                Ok((ptr, 0, seg.clone()))
            }
            // Opened through CUDA IPC once per pool (cached by vovp-gpu), closed with the last view.
            Location::Cuda(block) => {
                let view = vovp_gpu::ipc::open(&block)?;
                Ok((std::ptr::null_mut(), view.ptr(), Arc::new(view)))
            }
        }
    }

    /// The mapping of segment `id`, if this client has it mapped.
    fn segment(&self, id: u32) -> Option<Arc<MappedSegment>> {
        let map = self.segments.lock().ok()?;
        match map.get(&id)? {
            SegmentSlot::Kept(s) => Some(s.clone()),
            SegmentSlot::WhileViewed(w) => w.upgrade(),
        }
    }

    fn insert_segment(&self, id: u32, seg: Arc<MappedSegment>) {
        let slot = if id == 0 || seg.writable {
            SegmentSlot::Kept(seg)
        } else {
            SegmentSlot::WhileViewed(Arc::downgrade(&seg))
        };
        if let Ok(mut map) = self.segments.lock() {
            // Forget mappings whose views are all gone.
            map.retain(|_, s| match s {
                SegmentSlot::Kept(_) => true,
                SegmentSlot::WhileViewed(w) => w.strong_count() > 0,
            });
            map.insert(id, slot);
        }
    }

    /// Host segments among `refs` that are not mapped here.
    fn missing_segments<'r>(&self, refs: impl IntoIterator<Item = &'r ObjectRef>) -> Vec<u32> {
        let mut missing: Vec<u32> = refs
            .into_iter()
            .filter_map(|r| match r.location {
                Location::Host { segment, .. } if self.segment(segment).is_none() => Some(segment),
                _ => None,
            })
            .collect();
        missing.sort_unstable();
        missing.dedup();
        missing
    }

    fn view(&self, r: ObjectRef, sink: Arc<dyn ObjectSink>) -> Result<ObjectView, Error> {
        let (ptr, device_ptr, owner) = self.locate(&r)?;
        if device_ptr != 0 {
            return Ok(ObjectView::from_device(r, device_ptr, owner, sink));
        }
        // SAFETY: a sealed object inside our mapping; `owner` keeps the mapping.
        Ok(unsafe { ObjectView::from_raw(r, ptr, owner, sink) })
    }

    /// PUT flags when `len` bytes go inline (host objects up to `max_inline`: one round trip),
    /// or `None` when the object must be created, written and sealed.
    fn inline_flags(
        &self,
        len: usize,
        options: &CreateOptions,
        keep_reference: bool,
    ) -> Option<u32> {
        if len > (self.max_inline as usize).min(INLINE_PUT_PREFERRED)
            || options.device.is_some_and(|d| d != Device::Cpu)
        {
            return None;
        }
        let mut flags = if keep_reference {
            PUT_KEEP_REFERENCE
        } else {
            0
        };
        if options.ephemeral {
            flags |= CREATE_EPHEMERAL;
        }
        Some(flags)
    }

    /// Views for a GET's results. On a failure every reference is still released (the views
    /// already made drop; the failed one is released explicitly).
    fn views(
        &self,
        objects: Vec<Option<ObjectRef>>,
        sink: Arc<dyn ObjectSink>,
    ) -> Result<Vec<Option<ObjectView>>, Error> {
        let mut views = Vec::with_capacity(objects.len());
        let mut failure = None;
        for o in objects {
            views.push(match o {
                None => None,
                Some(r) => {
                    let id = r.id;
                    match self.view(r, sink.clone()) {
                        Ok(v) => Some(v),
                        Err(e) => {
                            sink.release(id);
                            failure = Some(e);
                            None
                        }
                    }
                }
            });
        }
        failure.map_or(Ok(views), Err)
    }

    fn buffer(&self, r: ObjectRef, sink: Arc<dyn ObjectSink>) -> Result<ObjectBuffer, Error> {
        if let Location::Host { segment, .. } = r.location {
            if !self.segment(segment).is_some_and(|s| s.writable) {
                return Err(Error::Protocol(format!(
                    "{} was placed in segment {segment}, which this client may not write",
                    r.name
                )));
            }
        }
        let (ptr, device_ptr, owner) = self.locate(&r)?;
        if device_ptr != 0 {
            return Ok(ObjectBuffer::from_device(r, device_ptr, owner, sink));
        }
        // SAFETY: a fresh unsealed object of ours inside the mapping.
        Ok(unsafe { ObjectBuffer::from_raw(r, ptr, owner, sink) })
    }
}

/// The frame of a SEGMENT request for segment `id`.
fn segment_request(out: &mut Vec<u8>, request_id: u64, id: u32) {
    let mut w = FrameWriter::begin(out, op::SEGMENT, 0, request_id);
    w.u32(id);
    w.finish();
}

/// Decodes a whole SEGMENT reply frame and maps the fd that came with it.
fn map_segment_reply(
    frame: &[u8],
    request_id: u64,
    fds: Vec<std::os::fd::OwnedFd>,
) -> Result<MappedSegment, Error> {
    let h = Header::parse(frame)?.ok_or_else(|| Error::Protocol("short header".into()))?;
    if h.request_id != request_id {
        return Err(Error::Protocol(format!(
            "reply to request {} while waiting for {request_id}",
            h.request_id
        )));
    }
    let mut r = Reader::new(&frame[HEADER_LEN..h.frame_len()]);
    read_status(&mut r)?;
    let size = r.u64()?;
    let writable = r.u8()? != 0;
    r.finish()?;
    let mut fds = fds.into_iter();
    match (fds.next(), fds.next()) {
        (Some(fd), None) => MappedSegment::map(fd, size, writable),
        _ => Err(Error::Protocol(
            "a SEGMENT reply must carry exactly one fd".into(),
        )),
    }
}

/// With `got` bytes of `frame` received: true (and `frame` cut to it) once a whole frame is
/// there; else `frame` is grown to hold the frame its header announces.
fn frame_complete(frame: &mut Vec<u8>, got: usize) -> Result<bool, Error> {
    if let Some(h) = Header::parse(&frame[..got])? {
        if got >= h.frame_len() {
            frame.truncate(h.frame_len());
            return Ok(true);
        }
        if frame.len() < h.frame_len() {
            frame.resize(h.frame_len(), 0);
        }
    }
    Ok(false)
}

/// Reads one whole reply frame that may carry fds, from a socket in blocking mode.
fn read_frame_with_fds(stream: &UnixStream) -> Result<(Vec<u8>, Vec<std::os::fd::OwnedFd>), Error> {
    let mut frame = vec![0u8; 4096];
    let mut got = 0;
    let mut fds = Vec::new();
    loop {
        if frame_complete(&mut frame, got)? {
            return Ok((frame, fds));
        }
        let n =
            crate::fdpass::recv_with_fds(stream, &mut frame[got..], &mut fds).map_err(conn_err)?;
        if n == 0 {
            return Err(conn_err(std::io::ErrorKind::UnexpectedEof.into()));
        }
        got += n;
    }
}

/// Connects and performs the HELLO handshake (receiving and mapping the segment fds).
fn handshake(path: &Path) -> Result<(UnixStream, Mappings), Error> {
    let mut stream = UnixStream::connect(path)
        .map_err(|e| Error::Connection(format!("cannot connect to {}: {e}", path.display())))?;
    let mut buf = Vec::new();
    let mut w = FrameWriter::begin(&mut buf, op::HELLO, 0, 0);
    w.u32(std::process::id());
    w.finish();
    // A daemon that refuses our uid closes at once: say so, whichever way the close shows up.
    let refused = |e: std::io::Error| {
        Error::Connection(format!(
            "the daemon closed the connection during the handshake ({e}); is this uid allowed \
             (vovp-engine --allow-uid)?"
        ))
    };
    // A daemon that refuses us (too many connections) may have answered and closed before our
    // HELLO went out: read its reply even when the write failed; it says why.
    let sent = stream.write_all(&buf);
    let mut fds = Vec::new();
    let mut reply = vec![0u8; 64 * 1024];
    let mut got = 0;
    let frame_len = loop {
        let n = match crate::fdpass::recv_with_fds(&stream, &mut reply[got..], &mut fds) {
            Ok(n) => n,
            Err(e) => return Err(refused(sent.err().unwrap_or(e))),
        };
        if n == 0 {
            let e = std::io::ErrorKind::UnexpectedEof.into();
            return Err(refused(sent.err().unwrap_or(e)));
        }
        got += n;
        if let Some(h) = Header::parse(&reply[..got])? {
            if got >= h.frame_len() {
                break h.frame_len();
            }
        }
    };
    let mut r = Reader::new(&reply[HEADER_LEN..frame_len]);
    read_status(&mut r)?;
    let _version = r.u16()?;
    let capacity = r.u64()?;
    let max_inline = r.u32()?;
    let n = r.count(12)?;
    if n != fds.len() {
        return Err(Error::Protocol(format!(
            "HELLO announced {n} segments but {} fds came",
            fds.len()
        )));
    }
    let mut segments = std::collections::HashMap::with_capacity(n);
    for fd in fds {
        let id = r.u32()?;
        let size = r.u64()?;
        // The store's own segment: this client may only read it.
        segments.insert(
            id,
            SegmentSlot::Kept(Arc::new(MappedSegment::map(fd, size, false)?)),
        );
    }
    Ok((
        stream,
        Mappings {
            segments: Mutex::new(segments),
            max_inline,
            capacity,
        },
    ))
}

/// Largest put sent inline even when the daemon allows more (see [`vovp::CLIENT_INLINE_PUT`]).
const INLINE_PUT_PREFERRED: usize = vovp::CLIENT_INLINE_PUT;

/// How long a blocking call polls for its reply before sleeping in `read`.
const REPLY_SPIN: Duration = Duration::from_micros(50);

/// Polls (yielding the CPU between polls) until the reply starts to arrive or `REPLY_SPIN`
/// passes. A small request is answered in a few microseconds of daemon work, but waking a
/// sleeping reader on another CPU costs tens of microseconds on virtual machines (measured
/// 45-65 µs here, vovp-bench "machine limits"); polling skips that wake-up. `sched_yield`
/// keeps the poll from starving the daemon when both share a CPU.
fn spin_until_readable(stream: &UnixStream) {
    let start = std::time::Instant::now();
    let mut probe = [0u8; 1];
    while start.elapsed() < REPLY_SPIN {
        match rustix::net::recv(
            stream,
            &mut probe,
            rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT,
        ) {
            Err(rustix::io::Errno::AGAIN) => rustix::thread::sched_yield(),
            _ => return,
        }
    }
}

fn conn_err(e: std::io::Error) -> Error {
    use std::io::ErrorKind as K;
    match e.kind() {
        // What a dead daemon looks like from here ("failed to fill whole buffer" says nothing).
        K::UnexpectedEof | K::BrokenPipe | K::ConnectionReset | K::ConnectionAborted => {
            Error::Connection(format!(
                "the daemon closed the connection (stopped, restarted or killed?): {e}"
            ))
        }
        _ => Error::Connection(e.to_string()),
    }
}

struct Conn {
    stream: UnixStream,
    next_id: u64,
    out: Vec<u8>,
    payload: Vec<u8>,
}

/// Both clients' view of their current connection: its mappings and which connection it is
/// (0 = the first; + 1 on every reconnect). Views remember their generation, so the release of
/// a reference that died with an old daemon is never sent to the new one, where the same object
/// id may name another object.
struct Session {
    maps: RwLock<Arc<Mappings>>,
    generation: AtomicU64,
}

impl Session {
    fn new(maps: Mappings) -> Self {
        Session {
            maps: RwLock::new(Arc::new(maps)),
            generation: AtomicU64::new(0),
        }
    }

    fn maps(&self) -> Arc<Mappings> {
        match self.maps.read() {
            Ok(m) => m.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    fn current(&self) -> (Arc<Mappings>, u64) {
        (self.maps(), self.generation())
    }

    /// Installs a new connection's mappings; returns them with the new generation.
    fn replace(&self, maps: Mappings) -> (Arc<Mappings>, u64) {
        let maps = Arc::new(maps);
        match self.maps.write() {
            Ok(mut m) => *m = maps.clone(),
            Err(poisoned) => *poisoned.into_inner() = maps.clone(),
        }
        (maps, self.generation.fetch_add(1, Ordering::AcqRel) + 1)
    }
}

struct ClientInner {
    conn: Mutex<Conn>,
    /// The current connection's mappings and generation (replaced on reconnect).
    session: Session,
    /// Re-establish the connection (once per call) when the daemon went away.
    reconnect: bool,
    /// Releases from views dropped while another thread was mid-request: sent before the next one.
    deferred_releases: Mutex<Vec<u64>>,
    path: PathBuf,
}

/// How a [`Client`] connects.
#[derive(Clone, Copy, Debug, Default)]
pub struct ClientOptions {
    /// When the daemon has gone away (stopped, killed, restarted), connect again on the next
    /// call and retry it once on the new connection. Objects that died with the old daemon are
    /// simply not found there; views taken before keep their (old, intact) memory until
    /// dropped, and their releases are not sent to the new daemon. Off by default: a dead
    /// daemon is then an `Error::Connection` on every call.
    pub reconnect: bool,
}

/// A view's way back to its client: releases go out only while the connection it came from
/// is still the current one.
struct ViewSink {
    inner: Arc<ClientInner>,
    generation: u64,
}

impl ObjectSink for ViewSink {
    fn release(&self, id: ObjectId) {
        if self.inner.session.generation() == self.generation {
            self.inner.release(id);
        }
    }

    fn seal(&self, obj: &ObjectRef) -> Result<(), Error> {
        if self.inner.session.generation() != self.generation {
            return Err(Error::NotFound(format!(
                "{} (created on a connection to a daemon that has since gone away)",
                obj.name
            )));
        }
        self.inner.seal(obj)
    }
}

impl ClientInner {
    fn take_deferred(&self) -> Vec<u64> {
        self.deferred_releases
            .lock()
            .map(|mut v| std::mem::take(&mut *v))
            .unwrap_or_default()
    }

    fn append_releases(conn: &mut Conn, ids: &[u64]) {
        if ids.is_empty() {
            return;
        }
        conn.next_id += 1;
        let id = conn.next_id;
        let _ = Call::Release(ids).encode(&mut conn.out, FLAG_NO_REPLY, id);
    }

    fn call(&self, call: Call<'_>, names: &[&str]) -> Result<Response, Error> {
        self.call_in_session(call, names).map(|(r, _)| r)
    }

    /// Sends `call` and reads its reply, with the mappings and generation of the connection
    /// that answered (a reply's locations only make sense in those mappings).
    fn call_in_session(
        &self,
        call: Call<'_>,
        names: &[&str],
    ) -> Result<(Response, (Arc<Mappings>, u64)), Error> {
        let mut guard = self
            .conn
            .lock()
            .map_err(|_| Error::Internal("client lock poisoned".into()))?;
        let session = self.session.current();
        match self.exchange(&mut guard, &call, names) {
            Err(Error::Connection(why)) if self.reconnect => {
                tracing::info!("vovp: connection lost ({why}); reconnecting");
                let (stream, maps) = handshake(&self.path)?;
                guard.stream = stream;
                guard.next_id = 0;
                // References held on the old connection died with it.
                self.take_deferred();
                let (maps, generation) = self.session.replace(maps);
                let response = self.exchange(&mut guard, &call, names)?;
                Ok((response, (maps, generation)))
            }
            other => other.map(|r| (r, session)),
        }
    }

    /// Maps the segments of `refs` that are not mapped yet, asking the daemon for their fds
    /// (read-write only for this client's own arenas). The returned mappings keep them alive
    /// until the caller's views hold them. `generation`: the connection the refs came from.
    fn pin_segments<'r>(
        &self,
        maps: &Mappings,
        generation: u64,
        refs: impl IntoIterator<Item = &'r ObjectRef>,
    ) -> Result<Vec<Arc<MappedSegment>>, Error> {
        let mut pins = Vec::new();
        for id in maps.missing_segments(refs) {
            let mut conn = self
                .conn
                .lock()
                .map_err(|_| Error::Internal("client lock poisoned".into()))?;
            if self.session.generation() != generation {
                return Err(Error::Connection(
                    "the daemon went away while mapping an object".into(),
                ));
            }
            let deferred = self.take_deferred();
            conn.out.clear();
            Self::append_releases(&mut conn, &deferred);
            conn.next_id += 1;
            let rid = conn.next_id;
            segment_request(&mut conn.out, rid, id);
            let c = &mut *conn;
            c.stream.write_all(&c.out).map_err(conn_err)?;
            let (frame, fds) = read_frame_with_fds(&c.stream)?;
            let seg = Arc::new(map_segment_reply(&frame, rid, fds)?);
            maps.insert_segment(id, seg.clone());
            pins.push(seg);
        }
        Ok(pins)
    }

    fn exchange(
        &self,
        conn: &mut Conn,
        call: &Call<'_>,
        names: &[&str],
    ) -> Result<Response, Error> {
        let deferred = self.take_deferred();
        conn.out.clear();
        Self::append_releases(conn, &deferred);
        conn.next_id += 1;
        let id = conn.next_id;
        call.encode(&mut conn.out, 0, id)?;
        conn.stream.write_all(&conn.out).map_err(conn_err)?;
        let mut header = [0u8; HEADER_LEN];
        spin_until_readable(&conn.stream);
        conn.stream.read_exact(&mut header).map_err(conn_err)?;
        let h = Header::parse(&header)?.ok_or_else(|| Error::Protocol("short header".into()))?;
        conn.payload.resize(h.payload_len, 0);
        conn.stream
            .read_exact(&mut conn.payload)
            .map_err(conn_err)?;
        if h.request_id != id {
            let why = decode_reply(h.opcode & !REPLY_BIT, &conn.payload, names).err();
            return Err(Error::Protocol(format!(
                "reply to request {} while waiting for {id}{}",
                h.request_id,
                why.map(|e| format!(": {e}")).unwrap_or_default()
            )));
        }
        decode_reply(call.opcode(), &conn.payload, names)
    }
}

impl ObjectSink for ClientInner {
    fn release(&self, id: ObjectId) {
        let id = id.get();
        // Never block in Drop: send now if the connection is free, else queue for the next call.
        match self.conn.try_lock() {
            Ok(mut conn) => {
                conn.out.clear();
                let mut ids = self.take_deferred();
                ids.push(id);
                Self::append_releases(&mut conn, &ids);
                let c = &mut *conn;
                let _ = c.stream.write_all(&c.out);
            }
            Err(_) => {
                if let Ok(mut v) = self.deferred_releases.lock() {
                    v.push(id);
                }
            }
        }
    }

    fn seal(&self, obj: &ObjectRef) -> Result<(), Error> {
        self.call(Call::Seal(obj.name.as_str()), &[]).map(|_| ())
    }
}

/// A blocking connection to a `vovp-engine`. Cheap to clone; thread-safe (one request at a time).
#[derive(Clone)]
pub struct Client {
    inner: Arc<ClientInner>,
}

impl Client {
    pub fn connect(path: impl AsRef<Path>) -> Result<Client, Error> {
        Self::connect_with(path, ClientOptions::default())
    }

    pub fn connect_with(path: impl AsRef<Path>, options: ClientOptions) -> Result<Client, Error> {
        let (stream, maps) = handshake(path.as_ref())?;
        Ok(Client {
            inner: Arc::new(ClientInner {
                conn: Mutex::new(Conn {
                    stream,
                    next_id: 0,
                    out: Vec::new(),
                    payload: Vec::new(),
                }),
                session: Session::new(maps),
                reconnect: options.reconnect,
                deferred_releases: Mutex::new(Vec::new()),
                path: path.as_ref().to_owned(),
            }),
        })
    }

    /// Host bytes the daemon manages.
    pub fn capacity(&self) -> u64 {
        self.inner.session.maps().capacity
    }

    pub fn socket_path(&self) -> &Path {
        &self.inner.path
    }

    /// Number of connections the daemon serves (from STATS).
    pub fn connections(&self) -> Result<u64, Error> {
        Ok(self
            .inner
            .call(Call::Stats, &[])?
            .stats_and_connections()?
            .1)
    }

    /// Where the views of connection `generation` send their releases.
    fn sink(&self, generation: u64) -> Arc<dyn ObjectSink> {
        Arc::new(ViewSink {
            inner: self.inner.clone(),
            generation,
        })
    }

    /// Puts and keeps a reference: the view is the store's copy (zero-copy afterwards).
    pub fn put_and_view(
        &self,
        name: &str,
        data: &[u8],
        metadata: &[u8],
        options: CreateOptions,
    ) -> Result<ObjectView, Error> {
        if let Some(flags) = self
            .inner
            .session
            .maps()
            .inline_flags(data.len(), &options, true)
        {
            let (reply, (maps, generation)) = self.inner.call_in_session(
                Call::Put {
                    name,
                    flags,
                    metadata,
                    data,
                },
                &[name],
            )?;
            let r = reply.object()?;
            let id = r.id;
            let sink = self.sink(generation);
            let _pins = self
                .inner
                .pin_segments(&maps, generation, [&r])
                .inspect_err(|_| sink.release(id))?;
            return maps.view(r, sink.clone()).inspect_err(|_| sink.release(id));
        }
        let mut buf = Store::create(self, name, data.len() as u64, metadata, options)?;
        parallel_copy(buf.as_mut_slice(), data);
        buf.seal()
    }
}

fn unexpected(r: Response) -> Error {
    Error::Protocol(format!("unexpected reply {r:?}"))
}

/// The reply body each call expects; anything else is a protocol error.
impl Response {
    fn object(self) -> Result<ObjectRef, Error> {
        match self {
            Response::Object(r) => Ok(r),
            other => Err(unexpected(other)),
        }
    }
    fn objects(self) -> Result<Vec<Option<ObjectRef>>, Error> {
        match self {
            Response::Objects(v) => Ok(v),
            other => Err(unexpected(other)),
        }
    }
    fn boolean(self) -> Result<bool, Error> {
        match self {
            Response::Bool(b) => Ok(b),
            other => Err(unexpected(other)),
        }
    }
    fn count(self) -> Result<u64, Error> {
        match self {
            Response::Count(n) => Ok(n),
            other => Err(unexpected(other)),
        }
    }
    fn list(self) -> Result<(Vec<ObjectInfo>, u64), Error> {
        match self {
            Response::List { entries, next } => Ok((entries, next)),
            other => Err(unexpected(other)),
        }
    }
    fn stats(self) -> Result<StoreStats, Error> {
        self.stats_and_connections().map(|(s, _)| s)
    }
    fn stats_and_connections(self) -> Result<(StoreStats, u64), Error> {
        match self {
            Response::Stats { stats, connections } => Ok((stats, connections)),
            other => Err(unexpected(other)),
        }
    }
}

impl Store for Client {
    fn create(
        &self,
        name: &str,
        size: u64,
        metadata: &[u8],
        options: CreateOptions,
    ) -> Result<ObjectBuffer, Error> {
        let (reply, (maps, generation)) = self.inner.call_in_session(
            Call::Create {
                name,
                size,
                options,
                metadata,
            },
            &[name],
        )?;
        let r = reply.object()?;
        let id = r.id;
        let sink = self.sink(generation);
        let _pins = self
            .inner
            .pin_segments(&maps, generation, [&r])
            .inspect_err(|_| sink.release(id))?;
        maps.buffer(r, sink.clone())
            .inspect_err(|_| sink.release(id))
    }

    fn seal(&self, name: &str) -> Result<(), Error> {
        self.inner.call(Call::Seal(name), &[]).map(|_| ())
    }

    fn abort(&self, name: &str) -> Result<(), Error> {
        self.inner.call(Call::Abort(name), &[]).map(|_| ())
    }

    fn put(
        &self,
        name: &str,
        data: &[u8],
        metadata: &[u8],
        options: CreateOptions,
    ) -> Result<(), Error> {
        if let Some(flags) = self
            .inner
            .session
            .maps()
            .inline_flags(data.len(), &options, false)
        {
            self.inner.call(
                Call::Put {
                    name,
                    flags,
                    metadata,
                    data,
                },
                &[name],
            )?;
            return Ok(());
        }
        self.put_and_view(name, data, metadata, options).map(drop)
    }

    fn get(
        &self,
        names: &[&str],
        timeout: Option<Duration>,
    ) -> Result<Vec<Option<ObjectView>>, Error> {
        let (reply, (maps, generation)) = self
            .inner
            .call_in_session(Call::Get { names, timeout }, names)?;
        let objects = reply.objects()?;
        let sink = self.sink(generation);
        let _pins = match self
            .inner
            .pin_segments(&maps, generation, objects.iter().flatten())
        {
            Ok(p) => p,
            Err(e) => {
                objects.iter().flatten().for_each(|r| sink.release(r.id));
                return Err(e);
            }
        };
        maps.views(objects, sink)
    }

    fn contains(&self, name: &str) -> Result<bool, Error> {
        self.inner.call(Call::Contains(name), &[])?.boolean()
    }

    fn delete(&self, name: &str) -> Result<(), Error> {
        self.inner.call(Call::Delete(name), &[]).map(|_| ())
    }

    fn list(&self) -> Result<Vec<ObjectInfo>, Error> {
        let mut all = Vec::new();
        let mut start = 0;
        while start != LIST_END {
            let (page, next) = self.inner.call(Call::List(start), &[])?.list()?;
            all.extend(page);
            start = next;
        }
        Ok(all)
    }

    fn evict(&self, bytes: u64) -> Result<u64, Error> {
        self.inner.call(Call::Evict(bytes), &[])?.count()
    }

    fn stats(&self) -> Result<StoreStats, Error> {
        self.inner.call(Call::Stats, &[])?.stats()
    }
}

/// The async client: the same protocol on a tokio `UnixStream`. Blocking-free: releases from
/// dropped views are queued and sent ahead of the next request (or by [`AsyncClient::flush`]).
#[derive(Clone)]
pub struct AsyncClient {
    inner: Arc<AsyncInner>,
}

struct AsyncInner {
    conn: tokio::sync::Mutex<(tokio::net::UnixStream, u64)>,
    /// As in the blocking client: the current connection's mappings and its generation.
    session: Session,
    reconnect: bool,
    path: PathBuf,
    deferred_releases: Mutex<Vec<u64>>,
    /// Seals from `ObjectBuffer::seal` (a blocking call) go through a blocking side connection.
    blocking: Client,
}

impl AsyncInner {
    fn take_deferred(&self) -> Vec<u64> {
        self.deferred_releases
            .lock()
            .map(|mut v| std::mem::take(&mut *v))
            .unwrap_or_default()
    }
}

/// A view's way back to its async client (releases queue for the next request), only while
/// the connection it came from is the current one.
struct AsyncViewSink {
    inner: Arc<AsyncInner>,
    generation: u64,
}

impl ObjectSink for AsyncViewSink {
    fn release(&self, id: ObjectId) {
        let id = id.get();
        if self.inner.session.generation() != self.generation {
            return;
        }
        if let Ok(mut v) = self.inner.deferred_releases.lock() {
            v.push(id);
        }
    }

    fn seal(&self, obj: &ObjectRef) -> Result<(), Error> {
        if self.inner.session.generation() != self.generation {
            return Err(Error::NotFound(format!(
                "{} (created on a connection to a daemon that has since gone away)",
                obj.name
            )));
        }
        Store::seal(&self.inner.blocking, obj.name.as_str())
    }
}

/// Connects and handshakes off the async runtime (the handshake is blocking socket I/O).
async fn async_handshake(path: &Path) -> Result<(tokio::net::UnixStream, Mappings), Error> {
    let path = path.to_owned();
    let (std_stream, maps) = tokio::task::spawn_blocking(move || handshake(&path))
        .await
        .map_err(|e| Error::Internal(e.to_string()))??;
    std_stream.set_nonblocking(true).map_err(conn_err)?;
    let stream = tokio::net::UnixStream::from_std(std_stream).map_err(conn_err)?;
    Ok((stream, maps))
}

impl AsyncClient {
    pub async fn connect(path: impl AsRef<Path>) -> Result<AsyncClient, Error> {
        Self::connect_with(path, ClientOptions::default()).await
    }

    pub async fn connect_with(
        path: impl AsRef<Path>,
        options: ClientOptions,
    ) -> Result<AsyncClient, Error> {
        let path = path.as_ref().to_owned();
        let (stream, maps) = async_handshake(&path).await?;
        let side = path.clone();
        let blocking = tokio::task::spawn_blocking(move || Client::connect_with(&side, options))
            .await
            .map_err(|e| Error::Internal(e.to_string()))??;
        Ok(AsyncClient {
            inner: Arc::new(AsyncInner {
                conn: tokio::sync::Mutex::new((stream, 0)),
                session: Session::new(maps),
                reconnect: options.reconnect,
                path,
                deferred_releases: Mutex::new(Vec::new()),
                blocking,
            }),
        })
    }

    /// Sends queued releases now.
    pub async fn flush(&self) -> Result<(), Error> {
        self.call(Call::Stats, &[]).await.map(|_| ())
    }

    async fn call(&self, call: Call<'_>, names: &[&str]) -> Result<Response, Error> {
        self.call_in_session(call, names).await.map(|(r, _)| r)
    }

    /// As the blocking client's: the reply, with the mappings and generation that answered;
    /// one reconnect and retry when the daemon went away and the client opted in.
    async fn call_in_session(
        &self,
        call: Call<'_>,
        names: &[&str],
    ) -> Result<(Response, (Arc<Mappings>, u64)), Error> {
        let mut guard = self.inner.conn.lock().await;
        let session = self.inner.session.current();
        match Self::exchange(&self.inner, &mut guard, &call, names).await {
            Err(Error::Connection(why)) if self.inner.reconnect => {
                tracing::info!("vovp: connection lost ({why}); reconnecting");
                let (stream, maps) = async_handshake(&self.inner.path).await?;
                *guard = (stream, 0);
                self.inner.take_deferred();
                let (maps, generation) = self.inner.session.replace(maps);
                let response = Self::exchange(&self.inner, &mut guard, &call, names).await?;
                Ok((response, (maps, generation)))
            }
            other => other.map(|r| (r, session)),
        }
    }

    /// As the blocking client's `pin_segments`, on the async connection (the arena of an
    /// object this connection created is only writable from this connection).
    async fn pin_segments<'r>(
        &self,
        maps: &Mappings,
        generation: u64,
        refs: impl IntoIterator<Item = &'r ObjectRef>,
    ) -> Result<Vec<Arc<MappedSegment>>, Error> {
        let mut pins = Vec::new();
        for id in maps.missing_segments(refs) {
            let mut guard = self.inner.conn.lock().await;
            if self.inner.session.generation() != generation {
                return Err(Error::Connection(
                    "the daemon went away while mapping an object".into(),
                ));
            }
            let deferred = self.inner.take_deferred();
            let (stream, next_id) = &mut *guard;
            let mut out = Vec::new();
            if !deferred.is_empty() {
                *next_id += 1;
                Call::Release(&deferred).encode(&mut out, FLAG_NO_REPLY, *next_id)?;
            }
            *next_id += 1;
            let rid = *next_id;
            segment_request(&mut out, rid, id);
            stream.write_all(&out).await.map_err(conn_err)?;
            let stream: &tokio::net::UnixStream = stream;
            let mut frame = vec![0u8; 4096];
            let mut got = 0;
            let mut fds = Vec::new();
            loop {
                if frame_complete(&mut frame, got)? {
                    break;
                }
                stream.readable().await.map_err(conn_err)?;
                match stream.try_io(tokio::io::Interest::READABLE, || {
                    crate::fdpass::recv_with_fds(stream, &mut frame[got..], &mut fds)
                }) {
                    Ok(0) => return Err(conn_err(std::io::ErrorKind::UnexpectedEof.into())),
                    Ok(n) => got += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                    Err(e) => return Err(conn_err(e)),
                }
            }
            let seg = Arc::new(map_segment_reply(&frame, rid, fds)?);
            maps.insert_segment(id, seg.clone());
            pins.push(seg);
        }
        Ok(pins)
    }

    async fn exchange(
        inner: &AsyncInner,
        guard: &mut (tokio::net::UnixStream, u64),
        call: &Call<'_>,
        names: &[&str],
    ) -> Result<Response, Error> {
        let deferred = inner.take_deferred();
        let (stream, next_id) = guard;
        let mut out = Vec::new();
        if !deferred.is_empty() {
            *next_id += 1;
            Call::Release(&deferred).encode(&mut out, FLAG_NO_REPLY, *next_id)?;
        }
        *next_id += 1;
        let id = *next_id;
        call.encode(&mut out, 0, id)?;
        stream.write_all(&out).await.map_err(conn_err)?;
        let mut header = [0u8; HEADER_LEN];
        stream.read_exact(&mut header).await.map_err(conn_err)?;
        let h = Header::parse(&header)?.ok_or_else(|| Error::Protocol("short header".into()))?;
        let mut payload = vec![0u8; h.payload_len];
        stream.read_exact(&mut payload).await.map_err(conn_err)?;
        if h.request_id != id {
            return Err(Error::Protocol(format!(
                "reply to request {} while waiting for {id}",
                h.request_id
            )));
        }
        decode_reply(call.opcode(), &payload, names)
    }

    fn sink(&self, generation: u64) -> Arc<dyn ObjectSink> {
        Arc::new(AsyncViewSink {
            inner: self.inner.clone(),
            generation,
        })
    }
}

impl AsyncStore for AsyncClient {
    async fn create(
        &self,
        name: &str,
        size: u64,
        metadata: &[u8],
        options: CreateOptions,
    ) -> Result<ObjectBuffer, Error> {
        let (reply, (maps, generation)) = self
            .call_in_session(
                Call::Create {
                    name,
                    size,
                    options,
                    metadata,
                },
                &[name],
            )
            .await?;
        let r = reply.object()?;
        let id = r.id;
        let sink = self.sink(generation);
        let _pins = self
            .pin_segments(&maps, generation, [&r])
            .await
            .inspect_err(|_| sink.release(id))?;
        maps.buffer(r, sink.clone())
            .inspect_err(|_| sink.release(id))
    }

    async fn seal(&self, name: &str) -> Result<(), Error> {
        self.call(Call::Seal(name), &[]).await.map(|_| ())
    }

    async fn abort(&self, name: &str) -> Result<(), Error> {
        self.call(Call::Abort(name), &[]).await.map(|_| ())
    }

    async fn put(
        &self,
        name: &str,
        data: &[u8],
        metadata: &[u8],
        options: CreateOptions,
    ) -> Result<(), Error> {
        if let Some(flags) = self
            .inner
            .session
            .maps()
            .inline_flags(data.len(), &options, false)
        {
            self.call(
                Call::Put {
                    name,
                    flags,
                    metadata,
                    data,
                },
                &[name],
            )
            .await?;
            return Ok(());
        }
        let mut buf = AsyncStore::create(self, name, data.len() as u64, metadata, options).await?;
        parallel_copy(buf.as_mut_slice(), data);
        AsyncStore::seal(self, name).await?;
        drop(buf.into_view());
        Ok(())
    }

    async fn get(
        &self,
        names: &[&str],
        timeout: Option<Duration>,
    ) -> Result<Vec<Option<ObjectView>>, Error> {
        let (reply, (maps, generation)) = self
            .call_in_session(Call::Get { names, timeout }, names)
            .await?;
        let objects = reply.objects()?;
        let sink = self.sink(generation);
        let _pins = match self
            .pin_segments(&maps, generation, objects.iter().flatten())
            .await
        {
            Ok(p) => p,
            Err(e) => {
                objects.iter().flatten().for_each(|r| sink.release(r.id));
                return Err(e);
            }
        };
        maps.views(objects, sink)
    }

    async fn contains(&self, name: &str) -> Result<bool, Error> {
        self.call(Call::Contains(name), &[]).await?.boolean()
    }

    async fn delete(&self, name: &str) -> Result<(), Error> {
        self.call(Call::Delete(name), &[]).await.map(|_| ())
    }

    async fn list(&self) -> Result<Vec<ObjectInfo>, Error> {
        let mut all = Vec::new();
        let mut start = 0;
        while start != LIST_END {
            let (page, next) = self.call(Call::List(start), &[]).await?.list()?;
            all.extend(page);
            start = next;
        }
        Ok(all)
    }

    async fn evict(&self, bytes: u64) -> Result<u64, Error> {
        self.call(Call::Evict(bytes), &[]).await?.count()
    }

    async fn stats(&self) -> Result<StoreStats, Error> {
        self.call(Call::Stats, &[]).await?.stats()
    }
}

/// Milliseconds since the epoch (for display).
pub fn unix_millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A stream of seal/delete/evict notifications on a dedicated connection.
pub struct Subscription {
    stream: UnixStream,
}

impl Client {
    /// Opens a notification stream (its own connection, as Plasma's subscribe did).
    pub fn subscribe(&self) -> Result<Subscription, Error> {
        let (mut stream, _maps) = handshake(&self.inner.path)?;
        let mut out = Vec::new();
        FrameWriter::begin(&mut out, op::SUBSCRIBE, 0, 1).finish();
        stream.write_all(&out).map_err(conn_err)?;
        let mut sub = Subscription { stream };
        let (h, payload) = sub.read_frame()?;
        decode_reply(h.opcode & !REPLY_BIT, &payload, &[])?;
        Ok(sub)
    }
}

impl Subscription {
    fn read_frame(&mut self) -> Result<(Header, Vec<u8>), Error> {
        let mut header = [0u8; HEADER_LEN];
        self.stream.read_exact(&mut header).map_err(conn_err)?;
        let h = Header::parse(&header)?.ok_or_else(|| Error::Protocol("short header".into()))?;
        let mut payload = vec![0u8; h.payload_len];
        self.stream.read_exact(&mut payload).map_err(conn_err)?;
        Ok((h, payload))
    }

    /// Waits for the next notification (`timeout` None = forever).
    pub fn next(&mut self, timeout: Option<Duration>) -> Result<vovp::Notification, Error> {
        self.stream.set_read_timeout(timeout).map_err(conn_err)?;
        let (h, payload) = self.read_frame()?;
        if h.opcode != op::NOTIFY {
            return Err(Error::Protocol(format!(
                "expected NOTIFY, got opcode {:#x}",
                h.opcode
            )));
        }
        let mut r = Reader::new(&payload);
        let kind = match r.u8()? {
            1 => vovp::NotificationKind::Sealed,
            2 => vovp::NotificationKind::Deleted,
            3 => vovp::NotificationKind::Evicted,
            k => return Err(Error::Protocol(format!("notification kind {k}"))),
        };
        let name = ObjectName::new(r.str()?)?;
        let size = r.u64()?;
        let metadata = r.bytes()?.into();
        r.finish()?;
        Ok(vovp::Notification {
            kind,
            name,
            size,
            metadata,
        })
    }
}
