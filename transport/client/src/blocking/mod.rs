//! The blocking driver: [`Client`] over a blocking Unix socket, and [`Subscription`].

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vovp_proto::{Request, LIST_END};
use vovp_types::{
    CreateOptions, Error, Location, ObjectBuffer, ObjectInfo, ObjectRef, ObjectSink, ObjectView,
    Store, StoreStats,
};

use crate::core::{self, requests, Answered, Core, Expect, Unread, UnreadKind, Wire};
use crate::io::{self, handshake};
use crate::lent::Lends;
use crate::shared::Connection;
use crate::ClientOptions;

mod conn;
mod kept;
mod puts;
mod releases;
mod subscription;

use releases::{Flusher, ViewSink};
pub use subscription::{Subscription, SubscriptionCloser};

/// A writable address of an object's bytes and what keeps its mapping alive.
pub type WritableBytes = (*mut u8, Arc<dyn std::any::Any + Send + Sync>);

struct Conn {
    stream: UnixStream,
    wire: Wire,
    /// Replies received and not read yet (several pipelined ones come in one `recv`).
    input: io::ReadAhead,
    /// The first pipelined put that failed and that [`Client::sync`] has not reported yet,
    /// with how many failed in all.
    failed_puts: Option<(Error, u64)>,
    /// The small lend, where [`Client::put_view_later`] writes.
    small: kept::SmallLendSlot,
}

/// How long a dropped client waits for each owed reply (a daemon that stopped answering
/// must not hang the dropping thread; the daemon applies what was sent anyway).
const DROP_READ_LIMIT: Duration = Duration::from_secs(2);

/// Objects of requests sent without waiting whose replies may stay unread: at this a pipelined
/// put first reads replies (a kept batch the oldest until a flight fits, `kept.rs`; a raw
/// `put` all of them). Within what the store believes a client has in flight (128; a daemon
/// from before this cap was raised from 32 believes up to 64: exactly enough). The daemon
/// never blocks writing replies while the client blocks writing puts: the client reads what
/// has arrived before each pipelined write and reads instead of writing at the cap, and the
/// replies of kept puts (≤ 4 KiB each with their metadata) fit the socket buffer anyway.
/// 64, not 32: a `put_tensors` of 64 went out as 4 flights and then waited for the store
/// at each further one (FINDINGS.md, finding 18: 1.01-1.24× → 1.25-1.46× single calls).
const MAX_UNREAD: usize = 64;

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

    /// Whether dropped views' releases are queued and sent by a thread of this client
    /// ([`ClientOptions::release_delay`]): that thread also reads the reply of a
    /// [`PipelinedView`] dropped before it came, so its reference goes back without another
    /// call.
    ///
    /// [`PipelinedView`]: crate::PipelinedView
    pub fn defers_releases(&self) -> bool {
        self.inner.flusher.is_some()
    }

    /// Sends the releases queued by [`ClientOptions::release_delay`] now.
    pub fn flush(&self) {
        self.inner.flush_deferred();
    }

    /// A writable address of `view`'s bytes in this process, with what keeps it mapped: the
    /// shared mapping for large objects (over 4 KiB) in this client's own arenas, else a
    /// private copy-on-write mapping (writes stay in this process and never reach the store;
    /// every such view shows the object's bytes as the store has them, whatever this process
    /// wrote through earlier views of the same memory). For clients that must hand out
    /// writable views of sealed objects (the Python package's `writable=True` and torch
    /// results). `None` for device objects.
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
        seg.private_view(offset, view.size()).map(Some)
    }

    /// Whether [`Client::private_view`] of `view` answers without mapping the whole segment
    /// (in place, or its private mapping exists; what may remain is a mapping of the object's
    /// own pages): a caller holding a lock others wait for (Python's GIL) may then call it
    /// without letting go.
    pub fn private_view_ready(&self, view: &ObjectView) -> bool {
        let Location::Host { segment, .. } = view.location() else {
            return true;
        };
        let maps = self.inner.core.session.maps();
        maps.segment(segment)
            .is_none_or(|s| s.private_ready(view.size()))
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
        conn.wire
            .unread
            .push_back(Unread::one(id, UnreadKind::Seal, name));
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
            // Owed replies first (as `exchange`: their releases go out ahead of the batch).
            conn.drain_unread()?;
            self.inner.core.begin(&mut conn.wire);
            let ids: Vec<u64> = reqs.iter().map(|r| conn.wire.push(r, 0)).collect();
            io::write_all(conn.stream.as_fd(), &conn.wire.out)?;
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

    /// A put that returns the store's copy at once, without waiting for the store's answer:
    /// the bytes are written into this client's small lend (a small object) or its lend (64
    /// KiB up to the lend's largest object, a quarter of the lend), whole before the request
    /// goes out, so no one ever reads a half-made object; one PUBLISH goes out, and the
    /// [`PipelinedView`] over them is returned. Its object id and version (and the put's
    /// outcome) come with the reply, read by [`PipelinedView::wait`], by this client's next
    /// call that waits, or by [`Client::sync`]. As with [`Store::put`]'s pipelining: a name
    /// already published (or put by this client a moment ago) fails at once; a put that fails
    /// in the store anyway (a name taken meanwhile by a racing put, full memory) is reported
    /// by `wait` and by `sync`, and its bytes stay readable in the view; any process that
    /// learns of the name after this returned finds the object.
    ///
    /// `Ok(None)`: not this way; [`Client::put_and_view`] then. Objects whose data (padded to
    /// 64 bytes) and metadata take more than 4 KiB but whose data is under 64 KiB, objects
    /// too big for the lend, pipelining off ([`ClientOptions::no_pipelined_puts`]) or lend
    /// puts off ([`ClientOptions::no_lend_puts`], for the bigger ones), a store that lends
    /// nothing (under 64 MiB, `--prefault`), or a lend held by a failed put's view that
    /// still lives (the lend can be replaced only once such views are gone).
    ///
    /// ```no_run
    /// use vovp_client::{Client, Store};
    ///
    /// let client = Client::connect("/tmp/vovp.sock")?;
    /// match client.put_view_later("step", &7u64.to_le_bytes(), b"", Default::default())? {
    ///     Some(view) => {
    ///         view.wait()?; // the store's answer (needed only for the id / an error)
    ///         assert_eq!(view.take_view().map(|v| v.size()), Some(8));
    ///     }
    ///     None => drop(client.put_and_view("step", &7u64.to_le_bytes(), b"", Default::default())?),
    /// }
    /// # Ok::<(), vovp_client::Error>(())
    /// ```
    pub fn put_view_later(
        &self,
        name: &str,
        data: &[u8],
        metadata: &[u8],
        options: CreateOptions,
    ) -> Result<Option<crate::PipelinedView>, Error> {
        if data.len() >= crate::lent::CLIENT_LEND_MIN {
            return (self.inner)
                .put_lent_later(name, data, metadata, &options)
                .transpose();
        }
        let mut answers = self
            .inner
            .put_views_later(&[(name, data, metadata, options)]);
        answers.pop().flatten().transpose()
    }

    /// [`Client::put_view_later`] of several objects in one go (one write for all of them):
    /// per object its view, its error, or `None` (not this way; put it with
    /// [`Client::put_and_view`]).
    pub fn put_views_later(
        &self,
        puts: &[(&str, &[u8], &[u8], CreateOptions)],
    ) -> Vec<Option<Result<crate::PipelinedView, Error>>> {
        self.inner.put_views_later(puts)
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
        match self.inner.call(&Request::STATS) {
            Err(e) if crate::core::older_daemon_refused(&e) => {
                self.inner.call(&Request::STATS_FIRST)?.stats()
            }
            r => r?.stats(),
        }
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
        // Read exactly: the notifications after it are the subscription's.
        let mut payload = Vec::new();
        let h = io::read_frame(conn.stream.as_fd(), &mut payload)?;
        core::decode_reply(&h, &payload, id, &Request::Subscribe)?.empty()?;
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
        self.views_of(&requests::get(names, timeout)?)
    }

    /// The views a GET or GET_NEWER answers with.
    fn views_of(&self, req: &Request<'_>) -> Result<Vec<Option<ObjectView>>, Error> {
        let (reply, answered) = self.inner.call_in_session(req)?;
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
        core::check_created(&r, size).inspect_err(|_| sink.release(id))?;
        let _pins = self
            .inner
            .pin_segments(&answered, [&r])
            .inspect_err(|_| sink.release(id))?;
        answered
            .0
            .buffer(r, sink.clone())
            .inspect_err(|_| sink.release(id))
    }

    fn seal(&self, name: &str) -> Result<u64, Error> {
        self.inner.call(&requests::seal(name)?)?.version()
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

    /// The shared directory first (a held version above `newer_than` is the answer, an older
    /// one is let go at once), then GET_NEWER, which waits for the next version to be sealed.
    fn get_newer(
        &self,
        name: &str,
        newer_than: u64,
        timeout: Option<Duration>,
    ) -> Result<ObjectView, Error> {
        if !self.inner.is_closed() {
            let connection: Connection = self.inner.clone();
            let maps = self.inner.core.session.maps();
            if let Some(v) = core::shared_newer(&maps, name, newer_than, &connection) {
                return Ok(v);
            }
        }
        let req = requests::get_newer(name, newer_than, timeout)?;
        core::newer_or_not_found(name, self.views_of(&req)?)
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
        Ok(self.stats_and_connections()?.0)
    }
}
