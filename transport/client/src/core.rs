//! The connection state both clients share, with no socket in it: the request ids and output
//! buffer of a connection ([`Wire`]), the releases queued by dropped views, the current
//! mappings and connection generation ([`Current`]), the requests a `Store` call sends and the
//! decoding of their replies, the ways a put may take ([`put_paths`]), and what a reconnect
//! resets. The operations over it are `crate::ops`; the blocking and async clients are its
//! I/O drivers.

use std::borrow::Cow;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use vovp_proto::{Header, Reply, Request, FLAG_NO_REPLY, HEADER_LEN, REPLY_BIT};
use vovp_types::put::PutPaths;
use vovp_types::{
    CreateOptions, Device, Error, ObjectInfo, ObjectName, ObjectRef, PutOptions, StoreStats,
};

use crate::mapping::{MappedSegment, Mappings};

/// One connection's framing state: the last request id, the bytes to send next, and the
/// requests sent whose replies are still to be read in front of the next one's.
pub(crate) struct Wire {
    next_id: u64,
    pub(crate) out: Vec<u8>,
    /// Requests sent without waiting, oldest first: their replies come in this order, in
    /// front of any later request's.
    pub(crate) unread: std::collections::VecDeque<Unread>,
}

/// A request sent without waiting for its reply.
pub(crate) struct Unread {
    pub(crate) id: u64,
    pub(crate) kind: UnreadKind,
    /// The objects it names, in order: one, or a PUBLISH_MANY's several.
    pub(crate) objects: Vec<OwedObject>,
}

/// One object of an [`Unread`] request.
pub(crate) struct OwedObject {
    pub(crate) name: String,
    /// A pipelined PUBLISH's view, waiting for this reply ([`crate::pending`]).
    pub(crate) pending: Option<Arc<crate::pending::Pending>>,
    /// A PUBLISH into the lend: its announced write, withdrawn only once this reply is read
    /// (the store may take the lend back from then on: `vovp_shm::lend`).
    pub(crate) writing: Option<crate::lent::Reserved>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum UnreadKind {
    /// [`crate::Client::seal_later`]: a failure is only logged.
    Seal,
    /// A pipelined put (PUT, or PUBLISH or PUBLISH_MANY into the small lend): a failure is
    /// logged and kept for [`crate::Client::sync`].
    Put,
}

impl OwedObject {
    /// An object whose reply carries nothing for anyone (no view waits for it).
    pub(crate) fn named(name: &str) -> Self {
        OwedObject {
            name: name.to_owned(),
            pending: None,
            writing: None,
        }
    }
}

impl Unread {
    /// A request about one object.
    pub(crate) fn one(id: u64, kind: UnreadKind, name: &str) -> Self {
        Unread {
            id,
            kind,
            objects: vec![OwedObject::named(name)],
        }
    }

    /// The views waiting for this reply.
    pub(crate) fn pending(&self) -> impl Iterator<Item = &Arc<crate::pending::Pending>> {
        self.objects.iter().filter_map(|o| o.pending.as_ref())
    }

    /// Whether it is a pipelined put of `name`.
    pub(crate) fn puts(&self, name: &str) -> bool {
        self.kind == UnreadKind::Put && self.objects.iter().any(|o| o.name == name)
    }
}

impl Wire {
    pub(crate) fn new() -> Self {
        Wire {
            next_id: 0,
            out: Vec::new(),
            unread: std::collections::VecDeque::new(),
        }
    }

    /// The id of the last frame sent (requests and one-way releases are numbered 1, 2, ...).
    pub(crate) fn last_id(&self) -> u64 {
        self.next_id
    }

    /// Appends one-way RELEASE frames for `ids` (none when empty).
    pub(crate) fn push_releases(&mut self, ids: &[u64]) {
        if !ids.is_empty() {
            self.push(&Request::Release { ids: ids.into() }, FLAG_NO_REPLY);
        }
    }

    /// Appends `req` under the next request id, which it returns.
    pub(crate) fn push(&mut self, req: &Request<'_>, flags: u16) -> u64 {
        self.next_id += 1;
        req.encode(flags, self.next_id, &mut self.out);
        self.next_id
    }
}

/// Both clients' view of their current connection: its mappings and which connection it is
/// (its generation: 0 = the first; + 1 on every reconnect). Views remember their generation,
/// so the release of a reference that died with an old daemon is never sent to the new one,
/// where the same object id may name another object.
pub(crate) struct Current {
    maps: RwLock<Arc<Mappings>>,
    generation: AtomicU64,
}

impl Current {
    fn new(maps: Mappings) -> Self {
        Current {
            maps: RwLock::new(Arc::new(maps)),
            generation: AtomicU64::new(0),
        }
    }

    pub(crate) fn maps(&self) -> Arc<Mappings> {
        match self.maps.read() {
            Ok(m) => m.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    pub(crate) fn now(&self) -> (Arc<Mappings>, u64) {
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

/// The ways a put of `size` bytes may take on a connection (sans I/O; `crate::ops` reads them
/// from the connection): inline up to the daemon's `max_inline`, at most
/// [`vovp_types::CLIENT_INLINE_PUT`]; without waiting only where the client `pipelines` and
/// this process may announce in the connection's hold table (`announce`: a table, and not a
/// forked child's); through the lend (as large as `lend` says, asked only for a size the lend
/// may take) under the same condition, since a lend is taken back through that table.
pub(crate) fn put_paths(
    size: usize,
    max_inline: u32,
    announce: bool,
    pipelines: bool,
    lend: impl FnOnce() -> Option<u64>,
) -> PutPaths {
    let lend = (announce && size >= vovp_types::lends::MIN_OBJECT)
        .then(lend)
        .flatten();
    PutPaths {
        inline_limit: (max_inline as usize).min(vovp_types::CLIENT_INLINE_PUT),
        pipelining: pipelines && announce,
        lend,
        small_lend: pipelines && announce,
    }
}

/// Queued releases a pipelined request takes along ([`Core::frame_pipelined`]).
pub(crate) const RELEASES_PER_FRAME: usize = 64;

/// The mappings and generation of the connection that answered a call (a reply's locations
/// only make sense in those mappings).
pub(crate) type Answered = (Arc<Mappings>, u64);

/// What a client is, besides its socket.
pub(crate) struct Core {
    pub(crate) current: Current,
    /// Releases from views dropped while the connection was busy: sent ahead of the next
    /// request as one-way frames.
    deferred_releases: Mutex<Vec<u64>>,
    /// Re-establish the connection (once per call) when the daemon went away.
    pub(crate) reconnect: bool,
    pub(crate) path: PathBuf,
}

impl std::fmt::Debug for Core {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Core")
            .field("socket", &self.path)
            .field("generation", &self.current.generation())
            .finish_non_exhaustive()
    }
}

impl Core {
    pub(crate) fn new(path: PathBuf, maps: Mappings, reconnect: bool) -> Self {
        Core {
            current: Current::new(maps),
            deferred_releases: Mutex::new(Vec::new()),
            reconnect,
            path,
        }
    }

    pub(crate) fn take_deferred(&self) -> Vec<u64> {
        self.take_deferred_from(0)
    }

    /// The queued releases, if at least `count` are queued (else none, all left queued).
    fn take_deferred_from(&self, count: usize) -> Vec<u64> {
        self.deferred_releases
            .lock()
            .map(|mut v| {
                if v.len() >= count {
                    std::mem::take(&mut *v)
                } else {
                    Vec::new()
                }
            })
            .unwrap_or_default()
    }

    /// Whether releases are queued (the flusher's check before it takes the connection).
    pub(crate) fn has_deferred(&self) -> bool {
        self.deferred_releases
            .lock()
            .map(|v| !v.is_empty())
            .unwrap_or(false)
    }

    /// Queues the release of `id` for the next request, if it belongs to connection
    /// `generation` (a reference of an older connection died with it).
    pub(crate) fn defer_release(&self, id: u64, generation: u64) {
        self.defer_release_counted(id, generation);
    }

    /// [`Core::defer_release`], returning how many releases are queued now (0: none queued).
    pub(crate) fn defer_release_counted(&self, id: u64, generation: u64) -> usize {
        if self.current.generation() != generation {
            return 0;
        }
        match self.deferred_releases.lock() {
            Ok(mut v) => {
                v.push(id);
                v.len()
            }
            Err(_) => 0,
        }
    }

    /// Starts `wire`'s next batch with the queued releases.
    pub(crate) fn begin(&self, wire: &mut Wire) {
        wire.out.clear();
        wire.push_releases(&self.take_deferred());
    }

    /// Starts `wire`'s next batch: the queued releases, then `req`. Returns `req`'s id.
    pub(crate) fn frame(&self, wire: &mut Wire, req: &Request<'_>) -> u64 {
        self.begin(wire);
        wire.push(req, 0)
    }

    /// [`Core::frame`] for a request sent without waiting (a pipelined put): the queued
    /// releases ride along only once [`RELEASES_PER_FRAME`] are queued, else they wait for
    /// the next waiting request or the release thread (within its delay). A stream of small
    /// puts whose results are dropped would otherwise send a RELEASE of one id with every
    /// put, and the store would handle two messages per put.
    pub(crate) fn frame_pipelined(&self, wire: &mut Wire, req: &Request<'_>) -> u64 {
        wire.out.clear();
        wire.push_releases(&self.take_deferred_from(RELEASES_PER_FRAME));
        wire.push(req, 0)
    }

    /// After a reconnect: references held on the old connection died with it (and replies it
    /// owed will never come), and the new connection's mappings become current. Returns them
    /// with the new generation.
    pub(crate) fn reconnected(&self, wire: &mut Wire, maps: Mappings) -> Answered {
        *wire = Wire::new();
        self.take_deferred();
        self.current.replace(maps)
    }

    /// A sink's check before it seals: only on the connection that created the object.
    pub(crate) fn check_generation(&self, generation: u64, name: &str) -> Result<(), Error> {
        if self.current.generation() != generation {
            return Err(Error::NotFound(format!(
                "{name} (created on a connection to a daemon that has since gone away)",
            )));
        }
        Ok(())
    }
}

/// Decodes the reply to `req` (request id `id`); an error reply becomes `Err`.
pub(crate) fn decode_reply(
    h: &Header,
    payload: &[u8],
    id: u64,
    req: &Request<'_>,
) -> Result<Reply, Error> {
    decode_reply_with(h, payload, id, |p| Reply::decode_for(req, p))
}

/// [`decode_reply`] with the body decoded by `decode` (for a reply read after its request
/// was sent and let go: a pipelined one, decoded by its opcode and names).
pub(crate) fn decode_reply_with(
    h: &Header,
    payload: &[u8],
    id: u64,
    decode: impl FnOnce(&[u8]) -> Result<Reply, vovp_proto::DecodeError>,
) -> Result<Reply, Error> {
    if h.request_id != id {
        // Whatever it was, say what it said: usually an error frame of a broken stream.
        let why = Reply::decode::<&str>(h.opcode & !REPLY_BIT, payload, &[])
            .ok()
            .and_then(|r| match r {
                Reply::Failure(f) => Some(format!(": {}", Error::from(f))),
                _ => None,
            });
        return Err(Error::Protocol(format!(
            "reply to request {} while waiting for {id}{}",
            h.request_id,
            why.unwrap_or_default()
        )));
    }
    match decode(payload)? {
        Reply::Failure(f) => Err(f.into()),
        reply => Ok(reply),
    }
}

/// With `got` bytes of `frame` received: true (and `frame` cut to it) once a whole frame is
/// there; else `frame` is grown to hold the frame its header announces.
pub(crate) fn frame_complete(frame: &mut Vec<u8>, got: usize) -> Result<bool, Error> {
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

/// Decodes a whole SEGMENT reply frame (to request `id`) and maps the fd that came with it.
pub(crate) fn map_segment_reply(
    frame: &[u8],
    id: u64,
    segment: u32,
    fds: Vec<OwnedFd>,
) -> Result<MappedSegment, Error> {
    let h = Header::parse(frame)?.ok_or_else(|| Error::Protocol("short header".into()))?;
    let reply = decode_reply(
        &h,
        &frame[HEADER_LEN..h.frame_len()],
        id,
        &Request::Segment { id: segment },
    )?;
    let Reply::Segment { size, writable } = reply else {
        return Err(unexpected(&reply));
    };
    let mut fds = fds.into_iter();
    match (fds.next(), fds.next()) {
        // SEGMENT hands out the read-write fd only for the asking client's own arenas.
        (Some(fd), None) => MappedSegment::map(fd, size, writable, true),
        _ => Err(Error::Protocol(
            "a SEGMENT reply must carry exactly one fd".into(),
        )),
    }
}

/// A CREATE's answer is an object of the size asked for: a buffer of another size would break
/// `Store::create`'s promise, and a put that copies its data into it would not fit (found by
/// the `client_session` fuzz target: `put` of a big object panicked in the copy).
pub(crate) fn check_created(r: &ObjectRef, size: u64) -> Result<(), Error> {
    if r.size != size {
        return Err(Error::Protocol(format!(
            "CREATE of {} bytes answered with an object of {} bytes",
            size, r.size
        )));
    }
    Ok(())
}

fn check_name(n: &str) -> Result<(), Error> {
    ObjectName::new(n).map(drop)
}

/// What the store refuses in a put whatever its state (a bad name, too much metadata): a put
/// sent without waiting checks it before anything goes out, so it fails at once as a waiting
/// put would.
pub(crate) fn check_put(name: &str, metadata: &[u8]) -> Result<(), Error> {
    check_name(name)?;
    vovp_types::check_metadata(metadata)
}

/// The requests of the `Store` calls, with the caller's arguments checked (a bad name never
/// reaches the wire) and borrowed, not copied.
pub(crate) mod requests {
    use super::*;

    pub(crate) fn create<'a>(
        name: &'a str,
        size: u64,
        metadata: &'a [u8],
        options: CreateOptions,
    ) -> Result<Request<'a>, Error> {
        check_name(name)?;
        Ok(Request::Create {
            name: name.into(),
            size,
            flags: vovp_proto::create_flags(&options),
            version: options.version,
            device: options.device.unwrap_or(Device::Cpu),
            metadata: metadata.into(),
        })
    }

    pub(crate) fn put<'a>(
        name: &'a str,
        options: &PutOptions,
        metadata: &'a [u8],
        data: &'a [u8],
    ) -> Result<Request<'a>, Error> {
        check_name(name)?;
        Ok(Request::Put {
            name: name.into(),
            flags: vovp_proto::put_flags(options),
            version: options.version,
            metadata: metadata.into(),
            data: data.into(),
        })
    }

    /// `timeout` None: do not wait; a duration too long for the wire: forever.
    pub(crate) fn get<'a>(
        names: &[&'a str],
        timeout: Option<Duration>,
    ) -> Result<Request<'a>, Error> {
        let names = names
            .iter()
            .map(|&n| check_name(n).map(|()| Cow::Borrowed(n)))
            .collect::<Result<_, _>>()?;
        Ok(Request::Get {
            timeout_ms: timeout_ms(timeout),
            names,
        })
    }

    /// GET_NEWER of one name: found as a version above `newer_than`.
    pub(crate) fn get_newer(
        name: &str,
        newer_than: u64,
        timeout: Option<Duration>,
    ) -> Result<Request<'_>, Error> {
        check_name(name)?;
        Ok(Request::GetNewer {
            timeout_ms: timeout_ms(timeout),
            names: vec![Cow::Borrowed(name)],
            newer_than: vec![newer_than],
        })
    }

    fn timeout_ms(timeout: Option<Duration>) -> i64 {
        match timeout {
            None => 0,
            Some(d) if d.as_millis() >= i64::MAX as u128 => -1,
            Some(d) => d.as_millis().max(1) as i64,
        }
    }

    pub(crate) fn publish<'a>(
        lend: u64,
        offset: u64,
        name: &'a str,
        options: &PutOptions,
        metadata: &'a [u8],
        size: u64,
    ) -> Result<Request<'a>, Error> {
        check_name(name)?;
        Ok(Request::Publish {
            lend,
            offset,
            name: name.into(),
            flags: vovp_proto::put_flags(options),
            version: options.version,
            metadata: metadata.into(),
            size,
        })
    }

    pub(crate) fn seal(name: &str) -> Result<Request<'_>, Error> {
        check_name(name)?;
        Ok(Request::Seal { name: name.into() })
    }

    pub(crate) fn abort(name: &str) -> Result<Request<'_>, Error> {
        check_name(name)?;
        Ok(Request::Abort { name: name.into() })
    }

    pub(crate) fn contains(name: &str) -> Result<Request<'_>, Error> {
        check_name(name)?;
        Ok(Request::Contains { name: name.into() })
    }

    pub(crate) fn delete(name: &str) -> Result<Request<'_>, Error> {
        check_name(name)?;
        Ok(Request::Delete { name: name.into() })
    }

    /// One LIST page from cursor `start`; limit 0: the daemon's page size.
    pub(crate) fn list(start: u64) -> Request<'static> {
        Request::List { start, limit: 0 }
    }
}

/// A daemon from before a request's optional payload (STATS' field count) refuses it as
/// MALFORMED: the client asks again without it.
pub(crate) fn older_daemon_refused(e: &Error) -> bool {
    matches!(e, Error::Protocol(m) if m.starts_with("MALFORMED"))
}

pub(crate) fn unexpected(r: &Reply) -> Error {
    Error::Protocol(format!("unexpected reply {r:?}"))
}

/// The reply body each call expects; anything else is a protocol error.
pub(crate) trait Expect {
    fn object(self) -> Result<ObjectRef, Error>;
    fn objects(self) -> Result<Vec<Option<ObjectRef>>, Error>;
    fn boolean(self) -> Result<bool, Error>;
    fn count(self) -> Result<u64, Error>;
    fn list(self) -> Result<(Vec<ObjectInfo>, u64), Error>;
    fn stats(self) -> Result<(StoreStats, u64), Error>;
    fn empty(self) -> Result<(), Error>;
    fn lent(self) -> Result<vovp_types::Lend, Error>;
    /// SEAL's: the version the object became.
    fn version(self) -> Result<u64, Error>;
    /// METRICS': the Prometheus text.
    fn metrics(self) -> Result<String, Error>;
}

impl Expect for Reply {
    fn object(self) -> Result<ObjectRef, Error> {
        match self {
            Reply::Object(r) => Ok(r),
            other => Err(unexpected(&other)),
        }
    }
    fn objects(self) -> Result<Vec<Option<ObjectRef>>, Error> {
        match self {
            Reply::Objects(v) => Ok(v),
            other => Err(unexpected(&other)),
        }
    }
    fn boolean(self) -> Result<bool, Error> {
        match self {
            Reply::Bool(b) => Ok(b),
            other => Err(unexpected(&other)),
        }
    }
    fn count(self) -> Result<u64, Error> {
        match self {
            Reply::Count(n) => Ok(n),
            other => Err(unexpected(&other)),
        }
    }
    fn list(self) -> Result<(Vec<ObjectInfo>, u64), Error> {
        match self {
            Reply::List { entries, next } => Ok((entries, next)),
            other => Err(unexpected(&other)),
        }
    }
    fn stats(self) -> Result<(StoreStats, u64), Error> {
        match self {
            Reply::Stats {
                stats, connections, ..
            } => Ok((stats, connections)),
            other => Err(unexpected(&other)),
        }
    }
    fn empty(self) -> Result<(), Error> {
        match self {
            Reply::Empty => Ok(()),
            other => Err(unexpected(&other)),
        }
    }
    fn version(self) -> Result<u64, Error> {
        match self {
            Reply::Version(v) => Ok(v),
            other => Err(unexpected(&other)),
        }
    }
    fn lent(self) -> Result<vovp_types::Lend, Error> {
        match self {
            Reply::Lent(l) => Ok(l),
            other => Err(unexpected(&other)),
        }
    }
    fn metrics(self) -> Result<String, Error> {
        match self {
            Reply::Metrics(text) => Ok(text),
            other => Err(unexpected(&other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::frames;

    fn core() -> Core {
        let maps = Mappings::from_hello(1 << 20, 1 << 10, Vec::new(), Vec::new()).unwrap();
        Core::new(PathBuf::from("/nonexistent"), maps, true)
    }

    #[test]
    fn queued_releases_ride_ahead_of_the_next_request_one_way() {
        let core = core();
        let mut wire = Wire::new();
        core.defer_release(7, 0);
        core.defer_release(8, 0);
        // A view of a connection that is gone: its release is dropped, not sent.
        core.defer_release(9, 5);
        let id = core.frame(&mut wire, &Request::STATS);
        let got = frames(&wire.out);
        assert_eq!(got.len(), 2);
        assert_eq!(
            (got[0].1, got[0].2, &got[0].3),
            (
                FLAG_NO_REPLY,
                1,
                &Request::Release {
                    ids: vec![7, 8].into()
                }
            )
        );
        assert_eq!((got[1].2, &got[1].3), (id, &Request::STATS));
        assert_eq!((id, wire.last_id()), (2, 2));
        // Sent once: the next batch is the request alone.
        let id = core.frame(&mut wire, &Request::STATS);
        assert_eq!(frames(&wire.out).len(), 1);
        assert_eq!(id, 3);
    }

    #[test]
    fn a_reconnect_starts_a_new_generation_and_forgets_the_old_connection() {
        let core = core();
        let mut wire = Wire::new();
        core.frame(&mut wire, &Request::STATS);
        wire.unread.push_back(Unread::one(1, UnreadKind::Seal, "x"));
        core.defer_release(4, 0);
        let maps = Mappings::from_hello(2 << 20, 1 << 10, Vec::new(), Vec::new()).unwrap();
        let (maps, generation) = core.reconnected(&mut wire, maps);
        assert_eq!((generation, maps.capacity), (1, 2 << 20));
        assert_eq!(core.current.generation(), 1);
        // Request ids start again, owed replies and old references are forgotten.
        assert!(wire.unread.is_empty());
        assert_eq!(core.frame(&mut wire, &Request::STATS), 1);
        assert_eq!(frames(&wire.out).len(), 1);
        // Views of the old connection neither release nor seal on the new one.
        core.defer_release(5, 0);
        assert!(core.take_deferred().is_empty());
        let obj = ObjectRef {
            id: vovp_types::ObjectId::from_raw(1),
            name: ObjectName::new("x").unwrap(),
            size: 0,
            metadata: Arc::from(&b""[..]),
            location: vovp_types::Location::Host {
                segment: 0,
                offset: 0,
            },
            version: 1,
        };
        assert!(matches!(
            core.check_generation(0, obj.name.as_str()),
            Err(Error::NotFound(_))
        ));
        assert!(core.check_generation(1, obj.name.as_str()).is_ok());
    }

    #[test]
    fn a_created_object_of_another_size_is_refused() {
        let obj = |size| ObjectRef {
            id: vovp_types::ObjectId::from_raw(1),
            name: ObjectName::new("x").unwrap(),
            size,
            metadata: Arc::from(&b""[..]),
            location: vovp_types::Location::Host {
                segment: 1,
                offset: 0,
            },
            version: 0,
        };
        assert!(check_created(&obj(65600), 65600).is_ok());
        assert!(matches!(
            check_created(&obj(3), 65600),
            Err(Error::Protocol(_))
        ));
    }

    #[test]
    fn a_put_pipelines_and_lends_only_through_a_hold_table_this_process_may_write() {
        use vovp_types::lends::MIN_OBJECT;
        let lend = || Some(4 << 20);
        let all = put_paths(MIN_OBJECT, 1 << 20, true, true, lend);
        assert_eq!(
            all,
            PutPaths {
                inline_limit: vovp_types::CLIENT_INLINE_PUT,
                pipelining: true,
                lend: Some(4 << 20),
                small_lend: true,
            }
        );
        // No hold table (`no_shared_reads`, a daemon without one) or a forked child's: no
        // lend, nothing without waiting; inline and create remain.
        let none = put_paths(MIN_OBJECT, 1 << 20, false, true, lend);
        assert_eq!(
            (none.pipelining, none.lend, none.small_lend),
            (false, None, false)
        );
        assert_eq!(none.inline_limit, vovp_types::CLIENT_INLINE_PUT);
        // Pipelining opted out (or the async client): lends still.
        let waits = put_paths(MIN_OBJECT, 1 << 20, true, false, lend);
        assert_eq!(
            (waits.pipelining, waits.lend, waits.small_lend),
            (false, Some(4 << 20), false)
        );
        // The daemon's max_inline is the limit when smaller.
        assert_eq!(put_paths(64, 1000, true, true, lend).inline_limit, 1000);
        // The lend is not asked about for a size it never takes.
        let asked = std::cell::Cell::new(false);
        let small = put_paths(MIN_OBJECT - 1, 1 << 20, true, true, || {
            asked.set(true);
            Some(4 << 20)
        });
        assert_eq!((small.lend, asked.get()), (None, false));
    }

    #[test]
    fn requests_refuse_bad_names_before_the_wire() {
        assert!(matches!(requests::seal(""), Err(Error::InvalidName(_))));
        let long = "x".repeat(vovp_types::MAX_NAME_LEN + 1);
        assert!(matches!(
            requests::get(&["ok", &long], None),
            Err(Error::InvalidName(_))
        ));
        let Request::Get { timeout_ms, .. } =
            requests::get(&["a"], Some(Duration::from_micros(10))).unwrap()
        else {
            unreachable!()
        };
        assert_eq!(timeout_ms, 1, "a short wait is not 'do not wait'");
        let Request::Get { timeout_ms, .. } = requests::get(&["a"], Some(Duration::MAX)).unwrap()
        else {
            unreachable!()
        };
        assert_eq!(timeout_ms, -1);
    }
}
