//! The blocking driver: [`Client`] over a blocking Unix socket, and [`Subscription`].

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vovp_proto::{decode_notification, Opcode, Reply, Request, LIST_END};
use vovp_types::{
    CreateOptions, Error, Location, ObjectBuffer, ObjectId, ObjectInfo, ObjectRef, ObjectSink,
    ObjectView, Store, StoreStats,
};

use crate::core::{self, requests, Answered, Core, Expect, Unread, UnreadKind, Wire};
use crate::io::{self, conn_err, handshake};
use crate::lent::{self, Lends, Lent, Reservation, Reserved};
use crate::mapping::{MappedSegment, Mappings};
use crate::shared::Connection;
use crate::ClientOptions;

/// A writable address of an object's bytes and what keeps its mapping alive.
pub type WritableBytes = (*mut u8, Arc<dyn std::any::Any + Send + Sync>);

struct Conn {
    stream: UnixStream,
    wire: Wire,
    payload: Vec<u8>,
    /// The first pipelined put that failed and that [`Client::sync`] has not reported yet,
    /// with how many failed in all.
    failed_puts: Option<(Error, u64)>,
}

impl Conn {
    fn new(stream: UnixStream) -> Self {
        Conn {
            stream,
            wire: Wire::new(),
            payload: Vec::new(),
            failed_puts: None,
        }
    }

    /// Sends the batch `core` frames for `req` and reads `req`'s reply.
    fn exchange(&mut self, core: &Core, req: &Request<'_>) -> Result<Reply, Error> {
        let id = core.frame(&mut self.wire, req);
        io::write_all(self.stream.as_fd(), &self.wire.out)?;
        self.drain_unread()?;
        self.read_reply(id, req)
    }

    /// Reads the reply to request `id`, `req` (the next frame on the stream).
    fn read_reply(&mut self, id: u64, req: &Request<'_>) -> Result<Reply, Error> {
        let fd = self.stream.as_fd();
        io::spin_until_readable(fd);
        let h = io::read_frame(fd, &mut self.payload)?;
        core::decode_reply(&h, &self.payload, id, req)
    }

    /// Reads the reply of the oldest request sent without waiting. A failed SEAL can only be
    /// reported now, as a warning (the receiver's GET then times out); a failed put is logged
    /// and kept for [`Client::sync`] (another call of this client is not the place: it would
    /// fail for something it did not do). A broken stream is this call's error.
    fn read_unread(&mut self) -> Result<(), Error> {
        let Some(u) = self.wire.unread.pop_front() else {
            return Ok(());
        };
        let Unread {
            id,
            name: owned,
            kind,
        } = u;
        let name = owned.as_str().into();
        let req = match kind {
            UnreadKind::Seal => Request::Seal { name },
            UnreadKind::Put => Request::Put {
                name,
                flags: 0,
                metadata: Default::default(),
                data: Default::default(),
            },
        };
        match (self.read_reply(id, &req), kind) {
            (Ok(_), _) => Ok(()),
            (Err(e @ (Error::Connection(_) | Error::Protocol(_))), _) => Err(e),
            (Err(e), UnreadKind::Put) => {
                tracing::warn!("vovp: the put of {owned:?}, sent without waiting, failed: {e}");
                self.record_failed_puts(e, 1);
                Ok(())
            }
            (Err(e), UnreadKind::Seal) => {
                tracing::warn!("vovp: deferred seal of {owned:?} failed: {e}");
                Ok(())
            }
        }
    }

    /// Keeps `e` for [`Client::sync`] (unless an earlier failure is kept) and counts `n` more
    /// failed pipelined puts.
    fn record_failed_puts(&mut self, e: Error, n: u64) {
        match &mut self.failed_puts {
            Some((_, count)) => *count += n,
            None => self.failed_puts = Some((e, n)),
        }
    }

    /// Writes one-way RELEASE frames for `ids` now (nothing for none). A failed write is left
    /// for the next call to find: a release has no reply to wait for.
    fn send_releases(&mut self, ids: &[u64]) {
        if ids.is_empty() {
            return;
        }
        self.wire.out.clear();
        self.wire.push_releases(ids);
        let _ = io::write_all(self.stream.as_fd(), &self.wire.out);
    }

    /// Reads every reply still owed, in order.
    fn drain_unread(&mut self) -> Result<(), Error> {
        while !self.wire.unread.is_empty() {
            self.read_unread()?;
        }
        Ok(())
    }

    /// Reads the owed replies that have arrived, without waiting for the others.
    fn drain_arrived(&mut self) -> Result<(), Error> {
        while !self.wire.unread.is_empty() && io::readable_now(self.stream.as_fd()) {
            self.read_unread()?;
        }
        Ok(())
    }

    /// Asks for segment `segment`'s fd and maps it.
    fn map_segment(&mut self, core: &Core, segment: u32) -> Result<MappedSegment, Error> {
        // The SEGMENT reply carries an fd: read what is still due before asking.
        self.drain_unread()?;
        let id = core.frame(&mut self.wire, &Request::Segment { id: segment });
        let fd = self.stream.as_fd();
        io::write_all(fd, &self.wire.out)?;
        let (frame, fds) = io::read_frame_with_fds(fd)?;
        core::map_segment_reply(&frame, id, segment, fds)
    }
}

impl Drop for ClientInner {
    fn drop(&mut self) {
        // Pipelined puts whose answers are still owed: read them (a failure is logged by
        // `read_unread`), for a bounded time. Only in the process that sent them: a forked
        // child shares the socket, and what it read would be missing in the parent.
        let ours = self
            .core
            .session
            .maps()
            .shared
            .as_ref()
            .is_some_and(|s| s.can_announce());
        if let Ok(conn) = self.conn.get_mut() {
            if ours
                && !self.closed.load(Ordering::Acquire)
                && conn.wire.unread.iter().any(|u| u.kind == UnreadKind::Put)
                && conn.stream.set_read_timeout(Some(DROP_READ_LIMIT)).is_ok()
            {
                let _ = conn.drain_unread();
            }
        }
    }
}

/// How long a dropped client waits for each owed reply (a daemon that stopped answering
/// must not hang the dropping thread; the daemon applies what was sent anyway).
const DROP_READ_LIMIT: Duration = Duration::from_secs(2);

/// Requests sent without waiting whose replies may stay unread: past this a pipelined put
/// first reads them all. Small, so the replies always fit in the socket's receive buffer
/// (the daemon never blocks writing them while the client blocks writing puts).
const MAX_UNREAD: usize = 32;

struct ClientInner {
    core: Core,
    conn: Mutex<Conn>,
    /// Set by [`Client::close`]: no request, release or reconnect after it.
    closed: AtomicBool,
    /// A clone of the current stream, for `close` to shut down while a call holds `conn`.
    closer: Mutex<Option<UnixStream>>,
    /// [`ClientOptions::defer_cuda_mapping`], for the mappings of a reconnect.
    defer_cuda: bool,
    /// Map the shared directory on connect and reconnect (not [`ClientOptions::no_shared_reads`]).
    shared_reads: bool,
    /// [`ClientOptions::release_delay`]: dropped views' releases are queued, not sent.
    flusher: Option<Arc<Flusher>>,
    /// The part of its arena the store lent this client (puts without CREATE).
    lends: Lends,
    /// Small puts are sent without waiting (not [`ClientOptions::no_pipelined_puts`]).
    pipelined_puts: bool,
}

/// Deferred releases are sent at once when this many are queued.
const MAX_DEFERRED_RELEASES: usize = 1024;

/// [`ClientOptions::release_delay`]'s thread: sends the releases that no request carried within
/// the delay. It holds the client weakly and ends with it.
struct Flusher {
    due: Mutex<bool>,
    cv: std::sync::Condvar,
}

impl Flusher {
    fn start(inner: std::sync::Weak<ClientInner>, delay: Duration) -> Arc<Flusher> {
        let f = Arc::new(Flusher {
            due: Mutex::new(false),
            cv: std::sync::Condvar::new(),
        });
        let me = f.clone();
        // Without the thread (none could be spawned) releases still ride with requests.
        let _ = std::thread::Builder::new()
            .name("vovp-release".into())
            .spawn(move || me.run(inner, delay));
        f
    }

    /// A release was queued; `first`: into an empty queue, so a flush is due after the delay.
    fn wake(&self, first: bool) {
        if first {
            if let Ok(mut due) = self.due.lock() {
                *due = true;
                self.cv.notify_one();
            }
        }
    }

    fn run(&self, inner: std::sync::Weak<ClientInner>, delay: Duration) {
        loop {
            let Ok(mut due) = self.due.lock() else {
                return;
            };
            while !*due {
                // Wakes now and then to notice that the client is gone.
                match self.cv.wait_timeout(due, Duration::from_millis(200)) {
                    Ok((d, _)) => due = d,
                    Err(_) => return,
                }
                if inner.strong_count() == 0 {
                    return;
                }
            }
            *due = false;
            drop(due);
            let mut pause = delay;
            loop {
                std::thread::sleep(pause);
                let Some(client) = inner.upgrade() else {
                    return;
                };
                // Never wait for the connection: a call in flight (a GET waiting for its
                // object) would hand the lock to this thread on return, and that wake-up sits
                // on the caller's path. Its releases usually rode with that call anyway.
                if client.try_flush_deferred() {
                    break;
                }
                pause = (pause * 2).min(MAX_FLUSH_RETRY);
            }
        }
    }
}

/// The flusher's longest wait between tries while the connection stays busy.
const MAX_FLUSH_RETRY: Duration = Duration::from_millis(20);

/// A view's way back to its client: releases go out only while the connection it came from
/// is still the current one.
struct ViewSink {
    inner: Arc<ClientInner>,
    generation: u64,
}

impl ObjectSink for ViewSink {
    fn release(&self, id: ObjectId) {
        let id = id.get();
        // A closed connection's end released it; an older connection's died with it.
        if self.inner.is_closed() || self.inner.core.session.generation() != self.generation {
            return;
        }
        if let Some(flusher) = &self.inner.flusher {
            // Deferred: ride ahead of the next request, or the flusher sends it soon.
            let queued = self.inner.core.defer_release_counted(id, self.generation);
            if queued < MAX_DEFERRED_RELEASES {
                flusher.wake(queued == 1);
                return;
            }
        }
        // Never block in Drop: send now if the connection is free, else queue for the next call.
        match self.inner.conn.try_lock() {
            Ok(mut conn) => {
                let mut ids = self.inner.core.take_deferred();
                ids.push(id);
                conn.send_releases(&ids);
            }
            Err(_) => self.inner.core.defer_release(id, self.generation),
        }
    }

    fn seal(&self, obj: &ObjectRef) -> Result<(), Error> {
        self.inner.core.check_generation(self.generation, obj)?;
        self.inner
            .call(&requests::seal(obj.name.as_str())?)?
            .empty()
    }
}

impl ClientInner {
    /// Sends the queued releases (the flusher thread, `Client::flush`; waits for a request in
    /// flight).
    fn flush_deferred(&self) {
        let Ok(mut conn) = self.lock() else {
            return;
        };
        conn.send_releases(&self.core.take_deferred());
    }

    /// The flusher's send: `false` while the connection is busy with a call (queued releases
    /// then ride with the next request or a later try); `true` when nothing is left to send.
    fn try_flush_deferred(&self) -> bool {
        if !self.core.has_deferred() || self.is_closed() {
            return true;
        }
        let mut conn = match self.conn.try_lock() {
            Ok(conn) => conn,
            Err(std::sync::TryLockError::WouldBlock) => return false,
            Err(std::sync::TryLockError::Poisoned(_)) => return true,
        };
        conn.send_releases(&self.core.take_deferred());
        true
    }

    /// The connection, locked, unless the client was closed.
    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Conn>, Error> {
        let conn = self
            .conn
            .lock()
            .map_err(|_| Error::Internal("client lock poisoned".into()))?;
        if self.is_closed() {
            return Err(Error::Connection("the vovp client is closed".into()));
        }
        Ok(conn)
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    fn call(&self, req: &Request<'_>) -> Result<Reply, Error> {
        self.call_in_session(req).map(|(r, _)| r)
    }

    /// Sends `req` and reads its reply, with the mappings and generation of the connection
    /// that answered; one reconnect and retry when the daemon went away and the client opted in.
    fn call_in_session(&self, req: &Request<'_>) -> Result<(Reply, Answered), Error> {
        let mut conn = self.lock()?;
        let session = self.core.session.current();
        match conn.exchange(&self.core, req) {
            Err(Error::Connection(why)) if self.core.reconnect && !self.is_closed() => {
                tracing::info!("vovp: connection lost ({why}); reconnecting");
                let (stream, mut maps) = handshake(&self.core.path, self.shared_reads)?;
                maps.defer_cuda = self.defer_cuda;
                if let Ok(mut c) = self.closer.lock() {
                    *c = stream.try_clone().ok();
                }
                conn.stream = stream;
                // Puts sent without waiting and never answered went with the old daemon (as
                // every object it held): `sync` says so.
                let lost = (conn.wire.unread.iter())
                    .filter(|u| u.kind == UnreadKind::Put)
                    .count() as u64;
                if lost > 0 {
                    let e = Error::Connection(format!(
                        "{lost} puts sent without waiting were lost with the old connection"
                    ));
                    conn.record_failed_puts(e, lost);
                }
                let answered = self.core.reconnected(&mut conn.wire, maps);
                let reply = conn.exchange(&self.core, req)?;
                Ok((reply, answered))
            }
            other => other.map(|r| (r, session)),
        }
    }

    /// Holds the segments of `refs` that are mapped and maps those that are not, asking the
    /// daemon for their fds (read-write only for this client's own arenas): the returned
    /// mappings keep them all alive until the caller's views hold them. `answered`: the
    /// connection the refs came from.
    fn pin_segments<'r>(
        &self,
        (maps, generation): &Answered,
        refs: impl IntoIterator<Item = &'r ObjectRef>,
    ) -> Result<Vec<Arc<MappedSegment>>, Error> {
        let (mut pins, missing) = maps.segments_of(refs);
        for segment in missing {
            pins.push(self.map_segment_of(maps, *generation, segment)?);
        }
        Ok(pins)
    }

    /// Maps segment `segment` (SEGMENT) into `maps`, those of connection `generation`.
    fn map_segment_of(
        &self,
        maps: &Mappings,
        generation: u64,
        segment: u32,
    ) -> Result<Arc<MappedSegment>, Error> {
        let mut conn = self.lock()?;
        if self.core.session.generation() != generation {
            return Err(Error::Connection(
                "the daemon went away while mapping a segment".into(),
            ));
        }
        let seg = Arc::new(conn.map_segment(&self.core, segment)?);
        maps.insert_segment(segment, seg.clone());
        Ok(seg)
    }
}

impl ClientInner {
    /// Puts through a lend: the bytes are written into this client's lend and one PUBLISH
    /// makes them a sealed object. `None`: not through a lend (too small or too big for one,
    /// a store that lends nothing, the lend busy); the caller puts another way.
    fn put_lent(
        &self,
        name: &str,
        data: &[u8],
        metadata: &[u8],
        options: &CreateOptions,
        keep: bool,
    ) -> Option<Result<(Reply, Answered), Error>> {
        if options.device.is_some_and(|d| d != vovp_types::Device::Cpu) {
            return None;
        }
        let need = self.lends.wants(data.len(), metadata.len())?;
        // A lend is taken back through the hold table: no table (or a forked child, which
        // cannot announce its writes there), no lend.
        if !self.core.session.maps().shared.as_ref()?.can_announce() {
            return None;
        }
        let generation = self.core.session.generation();
        let mut reserved = match self.lends.reserve(need, generation) {
            Reservation::Got(r) => r,
            Reservation::No => return None,
            Reservation::Lend(asked) => {
                let lent = self.take_lend(asked.at_least);
                asked.install(lent)?
            }
        };
        let result = self.publish_reserved(&reserved, name, data, metadata, options, keep);
        // NOT_FOUND from PUBLISH is about the lend (never the name): the store no longer
        // has it, so put another way (the bytes are copied again, once).
        if matches!(result, Err(Error::NotFound(_))) {
            reserved.lend_gone();
            return None;
        }
        Some(result)
    }

    fn publish_reserved(
        &self,
        r: &Reserved,
        name: &str,
        data: &[u8],
        metadata: &[u8],
        options: &CreateOptions,
        keep: bool,
    ) -> Result<(Reply, Answered), Error> {
        let req = r.write(name, data, metadata, options, keep)?;
        let (reply, answered) = self.call_in_session(&req)?;
        if answered.1 != r.generation {
            // Reconnected in between: the new daemon knows no such lend (it answered NOT_FOUND).
            return Err(Error::Connection(
                "the daemon went away during a put; put again".into(),
            ));
        }
        Ok((reply, answered))
    }

    /// An inline PUT sent without waiting for its reply (read before the next call that
    /// waits for the store, or by [`Client::sync`]): a put then costs a write, not a round
    /// trip. Counted in the hold table first, so no other client is told the name is missing
    /// while the PUT is on its way (vovp-shm's `sent`). `None`: not this way (opted out, no
    /// hold table, a forked child, a broken connection that a waiting call may reconnect).
    fn put_pipelined(
        &self,
        name: &str,
        flags: u32,
        metadata: &[u8],
        data: &[u8],
    ) -> Option<Result<(), Error>> {
        if !self.pipelined_puts {
            return None;
        }
        // What the store would refuse whatever its state is refused here, now, as a waiting
        // put's would be: a bad name, too much metadata, a name published already or put by
        // this client a moment ago. (A name another client took but has not published yet
        // fails in the store: `sync` reports it.)
        if let Err(e) = vovp_types::ObjectName::new(name) {
            return Some(Err(e));
        }
        if let Err(e) = vovp_types::check_metadata(metadata) {
            return Some(Err(e));
        }
        let req = match requests::put(name, flags | vovp_proto::PUT_PIPELINED, metadata, data) {
            Ok(r) => r,
            Err(e) => return Some(Err(e)),
        };
        let mut conn = match self.lock() {
            Ok(c) => c,
            Err(e) => return Some(Err(e)),
        };
        // The mappings of the connection this lock guards (a reconnect replaces both under
        // it): the count must go into the hold table of the connection the PUT goes out on.
        let maps = self.core.session.maps();
        let shared = maps.shared.as_ref()?;
        if !shared.can_announce() {
            return None;
        }
        let sent = (|| {
            // Replies owed stay few: read those that came, and wait for them past the cap.
            if conn.wire.unread.len() >= MAX_UNREAD {
                conn.drain_unread()?;
            } else {
                conn.drain_arrived()?;
            }
            // (After reading the replies that came: a put answered is in the directory.)
            if shared.is_published(name) {
                return Err(Error::AlreadyExists(name.to_owned()));
            }
            // This client's own put of the name is still unanswered: wait, so a second put of
            // it fails here as it would have without pipelining.
            let own = |u: &Unread| u.kind == UnreadKind::Put && u.name == name;
            if conn.wire.unread.iter().any(own) || !shared.count_sent_put() {
                return Ok(false);
            }
            let id = self.core.frame(&mut conn.wire, &req);
            io::write_all(conn.stream.as_fd(), &conn.wire.out)?;
            conn.wire.unread.push_back(Unread {
                id,
                name: name.to_owned(),
                kind: UnreadKind::Put,
            });
            Ok(true)
        })();
        match sent {
            Ok(true) => Some(Ok(())),
            Ok(false) => None,
            // The waiting way reconnects when it may.
            Err(Error::Connection(_)) if self.core.reconnect => None,
            Err(e) => Some(Err(e)),
        }
    }

    /// LEND: a new lend of at least `at_least` bytes, its segment mapped writable, and the
    /// connection generation it belongs to.
    fn take_lend(&self, at_least: u64) -> Result<Lent, Error> {
        let (reply, answered) = self.call_in_session(&Request::Lend { at_least })?;
        let lend = reply.lent()?;
        let segment = match answered.0.segment(lend.segment) {
            Some(s) => s,
            None => self.map_segment_of(&answered.0, answered.1, lend.segment)?,
        };
        lent::check(&lend, &segment)?;
        // The store lends only to connections with a hold table; one without is refused
        // before asking (`put_lent`), so this is a daemon out of step: put another way.
        let shared = answered.0.shared.clone().ok_or_else(|| {
            Error::Config("a lend without a hold table to take it back through".into())
        })?;
        Ok((lend, segment, answered.1, shared))
    }
}

/// A blocking connection to a `vovp-engine`. Cheap to clone; thread-safe (one request at a time).
#[derive(Clone)]
pub struct Client {
    inner: Arc<ClientInner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("socket", &self.inner.core.path)
            .finish_non_exhaustive()
    }
}

impl Client {
    /// Connects to the daemon listening on `path` (HELLO, the segments' fds, the shared
    /// directory). A missing daemon is an [`Error::Connection`] naming the socket.
    ///
    /// ```no_run
    /// use vovp_client::{Client, Store};
    ///
    /// let client = Client::connect("/tmp/vovp.sock")?;
    /// client.put("greeting", b"hello", b"", Default::default())?;
    /// assert_eq!(&client.get_one("greeting", None)?[..], b"hello");
    /// # Ok::<(), vovp_client::Error>(())
    /// ```
    pub fn connect(path: impl AsRef<Path>) -> Result<Client, Error> {
        Self::connect_with(path, ClientOptions::default())
    }

    pub fn connect_with(path: impl AsRef<Path>, options: ClientOptions) -> Result<Client, Error> {
        let (stream, mut maps) = handshake(path.as_ref(), !options.no_shared_reads)?;
        maps.defer_cuda = options.defer_cuda_mapping;
        let closer = stream.try_clone().ok();
        let inner = Arc::new_cyclic(|me| ClientInner {
            core: Core::new(path.as_ref().to_owned(), maps, options.reconnect),
            conn: Mutex::new(Conn::new(stream)),
            closed: AtomicBool::new(false),
            closer: Mutex::new(closer),
            defer_cuda: options.defer_cuda_mapping,
            shared_reads: !options.no_shared_reads,
            flusher: options
                .release_delay
                .map(|delay| Flusher::start(me.clone(), delay)),
            lends: Lends::new(!options.no_lend_puts && !options.no_shared_reads),
            pipelined_puts: !options.no_pipelined_puts && !options.no_shared_reads,
        });
        Ok(Client { inner })
    }

    /// Sends the releases queued by [`ClientOptions::release_delay`] now.
    pub fn flush(&self) {
        self.inner.flush_deferred();
    }

    /// A writable address of `view`'s bytes in this process, with what keeps it mapped: the
    /// shared mapping for objects in this client's own arenas, else a private copy-on-write
    /// mapping of the segment (writes stay in this process and never reach the store). For
    /// clients that must hand out writable views of sealed objects (the Python package's
    /// `writable=True` and torch results). `None` for device objects.
    pub fn private_view(&self, view: &ObjectView) -> Result<Option<WritableBytes>, Error> {
        let Location::Host { segment, offset } = view.location() else {
            return Ok(None);
        };
        let seg = self
            .inner
            .core
            .session
            .maps()
            .segment(segment)
            .ok_or_else(|| Error::Protocol(format!("segment {segment} is not mapped")))?;
        if offset.saturating_add(view.size()) > seg.len() {
            return Err(Error::Protocol("object outside its segment".into()));
        }
        let base = seg.writable_base()?;
        // SAFETY: offset + size lies inside the mapping (checked above), kept alive by `seg`.
        let ptr = unsafe { base.add(offset as usize) };
        Ok(Some((ptr, seg)))
    }

    /// Closes the connection now (the daemon releases every reference it held), even while
    /// views or clones of this client live: later calls fail with `Error::Connection` and
    /// never reconnect, and dropped views send nothing. Wakes a thread waiting in a GET.
    /// Puts sent without waiting are still applied by the daemon, but their failures are not
    /// read any more: [`Client::sync`] first to see them.
    pub fn close(&self) {
        self.inner.closed.store(true, Ordering::Release);
        // Another thread is mid-request: shutting the socket down (through a clone of it)
        // wakes it.
        if let Some(s) = self.inner.closer.lock().ok().and_then(|mut c| c.take()) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    /// The largest PUT payload the daemon accepts (HELLO).
    pub fn max_inline(&self) -> u32 {
        self.inner.core.session.maps().max_inline
    }

    /// SEAL without waiting for its reply, which is read in front of the next request's. For
    /// hand-offs: the receiver's GET waits for the seal anyway, so the sender need not pay a
    /// round trip before sending the name. A failure is only logged (a warning).
    pub fn seal_later(&self, name: &str) -> Result<(), Error> {
        let req = requests::seal(name)?;
        let mut conn = self.inner.lock()?;
        let id = self.inner.core.frame(&mut conn.wire, &req);
        let conn = &mut *conn;
        io::write_all(conn.stream.as_fd(), &conn.wire.out)?;
        conn.wire.unread.push_back(Unread {
            id,
            name: name.to_owned(),
            kind: UnreadKind::Seal,
        });
        Ok(())
    }

    /// Waits for the store's answer to every put sent without waiting (see
    /// [`ClientOptions::no_pipelined_puts`]): `Ok` when all of them since the last `sync`
    /// were applied, else the first that failed (logged with the others as they were read;
    /// each failure is reported by one `sync`).
    pub fn sync(&self) -> Result<(), Error> {
        let mut conn = self.inner.lock()?;
        conn.drain_unread()?;
        match conn.failed_puts.take() {
            None => Ok(()),
            Some((e, 1)) => Err(e),
            Some((e, n)) => {
                tracing::warn!("vovp: {n} puts sent without waiting failed; the first: {e}");
                Err(e)
            }
        }
    }

    /// Requests sent without waiting (SEALs by [`Client::seal_later`], pipelined puts) whose
    /// replies have not been read yet.
    pub fn unread_replies(&self) -> usize {
        self.inner
            .conn
            .lock()
            .map(|c| c.wire.unread.len())
            .unwrap_or(0)
    }

    /// The id of the last frame this connection sent (requests and one-way releases are
    /// numbered 1, 2, ...): how many went out, for tests that count round trips.
    pub fn last_request_id(&self) -> u64 {
        self.inner
            .conn
            .lock()
            .map(|c| c.wire.last_id())
            .unwrap_or(0)
    }

    /// Several inline PUTs (each up to the inline size; `PUT_KEEP_REFERENCE`) sent in one
    /// write, their replies read together: one round trip. Each item's result is its view (or
    /// its error: a name taken, ...); an error that breaks the stream fails the whole call.
    pub fn put_many(
        &self,
        items: &[(&str, &[u8], &[u8], CreateOptions)],
    ) -> Result<Vec<Result<ObjectView, Error>>, Error> {
        let maps = self.inner.core.session.maps();
        let reqs = items
            .iter()
            .map(|&(name, data, metadata, options)| {
                let flags = maps
                    .inline_flags(data.len(), &options, true)
                    .ok_or_else(|| {
                        Error::TooLarge(format!("{name}: {} bytes do not go inline", data.len()))
                    })?;
                requests::put(name, flags, metadata, data)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let (replies, answered) = {
            let mut conn = self.inner.lock()?;
            let answered = self.inner.core.session.current();
            self.inner.core.begin(&mut conn.wire);
            let ids: Vec<u64> = reqs.iter().map(|r| conn.wire.push(r, 0)).collect();
            io::write_all(conn.stream.as_fd(), &conn.wire.out)?;
            conn.drain_unread()?;
            let mut replies = Vec::with_capacity(reqs.len());
            for (req, id) in reqs.iter().zip(ids) {
                match conn.read_reply(id, req) {
                    Err(e @ (Error::Connection(_) | Error::Protocol(_))) => return Err(e),
                    other => replies.push(other),
                }
            }
            (replies, answered)
        };
        Ok(replies
            .into_iter()
            .map(|reply| self.view_of(reply?.object()?, answered.clone()))
            .collect())
    }

    /// [`Store::put`] that returns the new object's id.
    pub fn put_id(
        &self,
        name: &str,
        data: &[u8],
        metadata: &[u8],
        options: CreateOptions,
    ) -> Result<u64, Error> {
        if let Some(r) = self.inner.put_lent(name, data, metadata, &options, false) {
            return Ok(r?.0.object()?.id.get());
        }
        let maps = self.inner.core.session.maps();
        if let Some(flags) = maps.inline_flags(data.len(), &options, false) {
            let req = requests::put(name, flags, metadata, data)?;
            return Ok(self.inner.call(&req)?.object()?.id.get());
        }
        Ok(self.put_and_view(name, data, metadata, options)?.id().get())
    }

    /// Host bytes the daemon manages.
    pub fn capacity(&self) -> u64 {
        self.inner.core.session.maps().capacity
    }

    pub fn socket_path(&self) -> &Path {
        &self.inner.core.path
    }

    /// Number of connections the daemon serves (from STATS).
    pub fn connections(&self) -> Result<u64, Error> {
        Ok(self.stats_and_connections()?.1)
    }

    /// One STATS: the store's counters and the number of connections the daemon serves.
    pub fn stats_and_connections(&self) -> Result<(StoreStats, u64), Error> {
        self.inner.call(&Request::Stats)?.stats()
    }

    /// Where the views of connection `generation` send their releases.
    fn sink(&self, generation: u64) -> Arc<dyn ObjectSink> {
        Arc::new(ViewSink {
            inner: self.inner.clone(),
            generation,
        })
    }

    /// A view of the object a reply of connection `answered` located (mapping its segment
    /// first if need be); the reference is released if that fails.
    fn view_of(&self, r: ObjectRef, answered: Answered) -> Result<ObjectView, Error> {
        let sink = self.sink(answered.1);
        let id = r.id;
        let _pins = self
            .inner
            .pin_segments(&answered, [&r])
            .inspect_err(|_| sink.release(id))?;
        answered
            .0
            .view(r, sink.clone())
            .inspect_err(|_| sink.release(id))
    }

    /// Puts and keeps a reference: the view is the store's copy (zero-copy afterwards).
    pub fn put_and_view(
        &self,
        name: &str,
        data: &[u8],
        metadata: &[u8],
        options: CreateOptions,
    ) -> Result<ObjectView, Error> {
        if let Some(r) = self.inner.put_lent(name, data, metadata, &options, true) {
            let (reply, answered) = r?;
            return self.view_of(reply.object()?, answered);
        }
        let maps = self.inner.core.session.maps();
        if let Some(flags) = maps.inline_flags(data.len(), &options, true) {
            let req = requests::put(name, flags, metadata, data)?;
            let (reply, answered) = self.inner.call_in_session(&req)?;
            return self.view_of(reply.object()?, answered);
        }
        vovp_shm::put::create_copy_seal(self, name, data, metadata, options)
    }

    /// Opens a notification stream (its own connection, as Plasma's subscribe did).
    pub fn subscribe(&self) -> Result<Subscription, Error> {
        let (stream, _maps) = handshake(&self.inner.core.path, false)?;
        let mut conn = Conn::new(stream);
        // Not through `Core::frame`: the queued releases belong to the main connection.
        let id = conn.wire.push(&Request::Subscribe, 0);
        io::write_all(conn.stream.as_fd(), &conn.wire.out)?;
        let h = io::read_frame(conn.stream.as_fd(), &mut conn.payload)?;
        core::decode_reply(&h, &conn.payload, id, &Request::Subscribe)?.empty()?;
        Ok(Subscription {
            stream: conn.stream,
            pending: Vec::new(),
        })
    }

    /// The part of a get the shared directory serves now: a view per name it has (no message,
    /// never blocks), and the positions of the names left for [`Store::get`]. For a caller
    /// that must not block while holding something (the Python core holds the GIL for this
    /// part only).
    pub fn get_shared(&self, names: &[&str]) -> (Vec<Option<ObjectView>>, Vec<usize>) {
        if self.inner.is_closed() {
            return (
                names.iter().map(|_| None).collect(),
                (0..names.len()).collect(),
            );
        }
        let connection: Connection = self.inner.clone();
        core::shared_part(&self.inner.core.session.maps(), names, &connection)
    }

    /// GET over the socket (names not served by the shared directory, or all of them).
    fn get_over_socket(
        &self,
        names: &[&str],
        timeout: Option<Duration>,
    ) -> Result<Vec<Option<ObjectView>>, Error> {
        let req = requests::get(names, timeout)?;
        let (reply, answered) = self.inner.call_in_session(&req)?;
        let objects = reply.objects()?;
        let sink = self.sink(answered.1);
        // Kept until the views hold the segments they point into.
        let _pins = match self.inner.pin_segments(&answered, objects.iter().flatten()) {
            Ok(pins) => pins,
            Err(e) => {
                objects.iter().flatten().for_each(|r| sink.release(r.id));
                return Err(e);
            }
        };
        answered.0.views(objects, sink)
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
        let req = requests::create(name, size, metadata, options)?;
        let (reply, answered) = self.inner.call_in_session(&req)?;
        let r = reply.object()?;
        let id = r.id;
        let sink = self.sink(answered.1);
        let _pins = self
            .inner
            .pin_segments(&answered, [&r])
            .inspect_err(|_| sink.release(id))?;
        answered
            .0
            .buffer(r, sink.clone())
            .inspect_err(|_| sink.release(id))
    }

    fn seal(&self, name: &str) -> Result<(), Error> {
        self.inner.call(&requests::seal(name)?)?.empty()
    }

    fn abort(&self, name: &str) -> Result<(), Error> {
        self.inner.call(&requests::abort(name)?)?.empty()
    }

    fn put(
        &self,
        name: &str,
        data: &[u8],
        metadata: &[u8],
        options: CreateOptions,
    ) -> Result<(), Error> {
        if let Some(r) = self.inner.put_lent(name, data, metadata, &options, false) {
            return r?.0.object().map(drop);
        }
        let maps = self.inner.core.session.maps();
        if let Some(flags) = maps.inline_flags(data.len(), &options, false) {
            if let Some(sent) = self.inner.put_pipelined(name, flags, metadata, data) {
                return sent;
            }
            let req = requests::put(name, flags, metadata, data)?;
            return self.inner.call(&req)?.object().map(drop);
        }
        self.put_and_view(name, data, metadata, options).map(drop)
    }

    /// Names published in the shared directory are got with no message (a hold in this
    /// connection's table); the rest, if any, in one GET.
    fn get(
        &self,
        names: &[&str],
        timeout: Option<Duration>,
    ) -> Result<Vec<Option<ObjectView>>, Error> {
        if self.inner.is_closed() {
            return self.get_over_socket(names, timeout);
        }
        let maps = self.inner.core.session.maps();
        let connection: Connection = self.inner.clone();
        vovp_shm::held::get_held_first(
            names,
            |n| maps.shared_view(n, &connection),
            |rest| self.get_over_socket(rest, timeout),
        )
    }

    fn contains(&self, name: &str) -> Result<bool, Error> {
        self.inner.call(&requests::contains(name)?)?.boolean()
    }

    fn delete(&self, name: &str) -> Result<(), Error> {
        self.inner.call(&requests::delete(name)?)?.empty()
    }

    fn list(&self) -> Result<Vec<ObjectInfo>, Error> {
        let mut all = Vec::new();
        let mut start = 0;
        while start != LIST_END {
            let (page, next) = self.inner.call(&requests::list(start))?.list()?;
            all.extend(page);
            start = next;
        }
        Ok(all)
    }

    fn evict(&self, bytes: u64) -> Result<u64, Error> {
        self.inner.call(&Request::Evict { bytes })?.count()
    }

    fn stats(&self) -> Result<StoreStats, Error> {
        Ok(self.inner.call(&Request::Stats)?.stats()?.0)
    }
}

/// A stream of seal/delete/evict notifications on a dedicated connection.
#[derive(Debug)]
pub struct Subscription {
    stream: UnixStream,
    /// Bytes received but not yet a whole frame: a read cut short by a timeout must not lose
    /// half a notification.
    pending: Vec<u8>,
}

/// Ends a [`Subscription`] from another thread: a `next` blocked on it returns at once.
#[derive(Debug)]
pub struct SubscriptionCloser(UnixStream);

impl SubscriptionCloser {
    /// Shuts the stream down; the subscription's `next` then fails with a connection error.
    pub fn close(&self) {
        // Already shut down or gone: nothing left to close.
        let _ = self.0.shutdown(std::net::Shutdown::Both);
    }
}

impl Subscription {
    /// Waits for the next notification: `Ok(None)` when `timeout` passes first (None: wait
    /// forever); the stream stays usable after a timeout. A stream the daemon ended (it drops
    /// subscribers that fall too far behind) or that was closed is `Error::Connection`.
    pub fn next(
        &mut self,
        timeout: Option<Duration>,
    ) -> Result<Option<vovp_types::Notification>, Error> {
        use std::io::{ErrorKind, Read};
        let deadline = timeout.map(|t| std::time::Instant::now() + t);
        let mut looked_last = false;
        loop {
            if let Some(h) = vovp_proto::Header::parse(&self.pending)? {
                let len = h.frame_len();
                if self.pending.len() >= len {
                    if h.opcode != Opcode::Notify.code() {
                        return Err(Error::Protocol(format!(
                            "expected NOTIFY, got opcode {:#x}",
                            h.opcode
                        )));
                    }
                    let n = decode_notification(&self.pending[vovp_proto::HEADER_LEN..len]);
                    self.pending.drain(..len);
                    return Ok(Some(n?));
                }
            }
            let wait = match deadline {
                None => None,
                Some(d) => match d.checked_duration_since(std::time::Instant::now()) {
                    Some(left) if !left.is_zero() => Some(left),
                    // Past the deadline: one last look at what has already arrived (a zero
                    // timeout still reads what is queued), then give up.
                    _ if !looked_last => {
                        looked_last = true;
                        Some(Duration::from_micros(1))
                    }
                    _ => return Ok(None),
                },
            };
            self.stream.set_read_timeout(wait).map_err(conn_err)?;
            let mut chunk = [0u8; 4096];
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err(Error::Connection("the notification stream ended".into())),
                Ok(n) => self.pending.extend_from_slice(&chunk[..n]),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(conn_err(e)),
            }
        }
    }

    /// A handle that ends this stream from another thread.
    pub fn closer(&self) -> Result<SubscriptionCloser, Error> {
        Ok(SubscriptionCloser(
            self.stream.try_clone().map_err(conn_err)?,
        ))
    }
}
