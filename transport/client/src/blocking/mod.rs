//! The blocking driver: [`Client`] over a blocking Unix socket, and [`Subscription`].

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vovp_proto::Request;
use vovp_shm::held::{DirectoryPart, Holder};
use vovp_types::put::Route;
use vovp_types::{
    CreateOptions, Error, Location, ObjectInfo, ObjectSink, ObjectView, PutOptions, Store,
    StoreStats,
};

use crate::core::{requests, Answered, Core, Expect, Unread, UnreadKind, Wire};
use crate::io::{self, handshake};
use crate::lent::ClientLend;
use crate::mapping::MappedSegment;
use crate::ops::{self, ready, Driver, Put, PutArgs};
use crate::ClientOptions;

mod conn;
mod kept;
mod puts;
mod releases;
mod subscription;

use releases::{Flusher, ViewSink};
pub use subscription::{Subscription, SubscriptionCloser};

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
    lend: ClientLend,
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
            lend: ClientLend::new(!options.no_lend_puts && !options.no_shared_reads),
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
    pub fn private_view(&self, view: &ObjectView) -> Result<Option<vovp_types::Mapped>, Error> {
        let Location::Host { segment, offset } = view.location() else {
            return Ok(None);
        };
        let seg = self
            .inner
            .core
            .current
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
        let maps = self.inner.core.current.maps();
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
        self.inner.core.current.maps().max_inline
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

    /// [`Client::put_with`] of every `(name, data, metadata)` of `items` with `options`, the
    /// kept ones batched: those that may return before the store's answer go into the small
    /// lend together (one write, [`Client::put_views_later`]), and those that wait and fit in
    /// a request go inline together (one round trip, [`Client::put_many`], which for objects
    /// the lend would take beats a PUBLISH round trip each); the others, and every put that
    /// keeps nothing, one by one. Per item its outcome or its error; `Err` when the
    /// connection broke under the batch.
    pub fn put_batch(
        &self,
        items: &[(&str, &[u8], &[u8])],
        options: PutOptions,
    ) -> Result<Vec<Result<Put, Error>>, Error> {
        let mut answers: Vec<Option<Result<Put, Error>>> = items.iter().map(|_| None).collect();
        if options.keep_reference && options.pipelined {
            let puts: Vec<_> = (items.iter())
                .map(|&(name, data, metadata)| (name, data, metadata, options))
                .collect();
            let later = self.inner.put_views_later(&puts);
            for (answer, view) in answers.iter_mut().zip(later) {
                *answer = ops::pending(view);
            }
        }
        if options.keep_reference {
            let maps = self.inner.core.current.maps();
            let inline_only = crate::core::put_paths(0, maps.max_inline, false, false, || None);
            let waiting = options.with(true, false);
            let together: Vec<usize> = (0..items.len())
                .filter(|&i| {
                    let (_, data, metadata) = items[i];
                    let route =
                        vovp_types::put::route(data.len(), metadata.len(), &waiting, &inline_only);
                    answers[i].is_none() && matches!(route, Ok(Route::Inline))
                })
                .collect();
            if !together.is_empty() {
                let puts: Vec<_> = (together.iter())
                    .map(|&i| (items[i].0, items[i].1, items[i].2, waiting))
                    .collect();
                let views = self.put_many(&puts)?;
                for (i, view) in together.into_iter().zip(views) {
                    answers[i] = Some(view.map(Put::Kept));
                }
            }
        }
        Ok((answers.into_iter().zip(items))
            .map(|(answer, &(name, data, metadata))| {
                answer.unwrap_or_else(|| self.put_with(name, data, metadata, options))
            })
            .collect())
    }

    /// Several inline PUTs (each up to the inline size; `PUT_KEEP_REFERENCE`) sent in one
    /// write, their replies read together: one round trip. Each item's result is its view (or
    /// its error: a name taken, ...); an error that breaks the stream fails the whole call.
    pub fn put_many(
        &self,
        items: &[(&str, &[u8], &[u8], CreateOptions)],
    ) -> Result<Vec<Result<ObjectView, Error>>, Error> {
        let maps = self.inner.core.current.maps();
        let inline_only = crate::core::put_paths(0, maps.max_inline, false, false, || None);
        let reqs = items
            .iter()
            .map(|&(name, data, metadata, options)| {
                let options = options.with(true, false);
                match vovp_types::put::route(data.len(), metadata.len(), &options, &inline_only) {
                    Ok(Route::Inline) => requests::put(name, &options, metadata, data),
                    _ => Err(Error::TooLarge(format!(
                        "{name}: {} bytes do not go inline",
                        data.len()
                    ))),
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        let (replies, answered) = {
            let mut conn = self.inner.lock()?;
            let answered = self.inner.core.current.now();
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
            .map(|reply| {
                ready(ops::view_of(
                    &self.inner,
                    reply?.object()?,
                    answered.clone(),
                ))
            })
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
    /// nothing (too small to lend, `--prefault`), device objects, or a lend held by a failed put's
    /// view that still lives (the lend can be replaced only once such views are gone).
    /// [`Client::put_with`] (kept, pipelined) falls back by itself.
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
    ///
    /// [`PipelinedView`]: crate::PipelinedView
    /// [`PipelinedView::wait`]: crate::PipelinedView::wait
    pub fn put_view_later(
        &self,
        name: &str,
        data: &[u8],
        metadata: &[u8],
        options: CreateOptions,
    ) -> Result<Option<crate::PipelinedView>, Error> {
        let put = PutArgs {
            name,
            data,
            metadata,
            options: options.with(true, true),
        };
        let paths = ops::put_paths(&self.inner, data.len());
        // (A device object is no put: not this way, as before the route existed.)
        let route = vovp_types::put::route(data.len(), metadata.len(), &put.options, &paths);
        let later = match route {
            Ok(r @ (Route::LendPipelined | Route::SmallLend)) => self.inner.put_later(r, &put),
            _ => None,
        };
        match later {
            Some(Ok(Put::Pending(view))) => Ok(Some(view)),
            Some(Ok(_)) | None => Ok(None),
            Some(Err(e)) => Err(e),
        }
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

    /// Host bytes the daemon manages.
    pub fn capacity(&self) -> u64 {
        self.inner.core.current.maps().capacity
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
        ready(ops::stats_and_connections(&self.inner))
    }

    /// The daemon's metrics in the Prometheus text format (one METRICS request): what
    /// `vovp-engine --metrics` serves at `/metrics`, with or without that endpoint.
    pub fn metrics(&self) -> Result<String, Error> {
        self.inner.call(&Request::Metrics)?.metrics()
    }

    /// One LIST page from cursor `start` (0 for the first): its objects and the next cursor
    /// (`vovp_proto::LIST_END` after the last). For a caller that keeps a part of a big list
    /// (`Store::list` reads every page into one list).
    pub fn list_page(&self, start: u64) -> Result<(Vec<ObjectInfo>, u64), Error> {
        self.inner.call(&requests::list(start))?.list()
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
        crate::notify::subscribed(&h, &payload, id)?;
        Ok(Subscription::new(conn.stream))
    }

    /// The part of a get the shared directory serves now: a view per name it has (no message,
    /// never blocks), and the names left for the store ([`Client::get_from_store`], then
    /// `DirectoryPart::fill`). For a caller that must not block while holding something (the
    /// Python core holds the GIL for this part only); [`Store::get`] is both halves.
    pub fn get_shared<'n>(&self, names: &'n [&'n str]) -> DirectoryPart<'n> {
        DirectoryPart::look(names, self.inner.directory())
    }

    /// GET over the socket, the shared directory not asked (for a caller that looked there
    /// already: [`Client::get_shared`]).
    pub fn get_from_store(
        &self,
        names: &[&str],
        timeout: Option<Duration>,
    ) -> Result<Vec<Option<ObjectView>>, Error> {
        ready(ops::get_from_store(&self.inner, names, timeout))
    }

    /// GET_NEWER over the socket, the shared directory not asked (see
    /// [`Client::get_from_store`] and [`Store::get_newer`]).
    pub fn get_newer_from_store(
        &self,
        name: &str,
        newer_than: u64,
        timeout: Option<Duration>,
    ) -> Result<ObjectView, Error> {
        ready(ops::get_newer_from_store(
            &self.inner,
            name,
            newer_than,
            timeout,
        ))
    }
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Client").field(&self.inner.core).finish()
    }
}

impl Client {
    /// The driver its operations run on (`crate::ops`).
    fn driver(&self) -> &Arc<ClientInner> {
        &self.inner
    }
}

/// The blocking driver of the shared operations (`crate::ops`): every call does its I/O before
/// it returns, so its futures are ready at once.
impl Driver for Arc<ClientInner> {
    fn core(&self) -> &Core {
        &self.core
    }

    fn lend(&self) -> &ClientLend {
        &self.lend
    }

    fn pipelines(&self) -> bool {
        self.pipelined_puts
    }

    fn call_in_session<'a>(
        &'a self,
        req: &'a Request<'_>,
    ) -> impl std::future::Future<Output = Result<(vovp_proto::Reply, Answered), Error>> + Send + 'a
    {
        std::future::ready(ClientInner::call_in_session(self, req))
    }

    fn map_segment<'a>(
        &'a self,
        (maps, generation): &'a Answered,
        segment: u32,
    ) -> impl std::future::Future<Output = Result<Arc<MappedSegment>, Error>> + Send + 'a {
        std::future::ready(self.map_segment_of(maps, *generation, segment))
    }

    fn sink(&self, generation: u64) -> Arc<dyn ObjectSink> {
        Arc::new(ViewSink {
            inner: self.clone(),
            generation,
        })
    }

    fn directory(&self) -> impl FnMut(&str) -> Option<ObjectView> + '_ {
        // A closed client reads nothing more (its hold table went with its connection).
        let maps = (!self.is_closed()).then(|| self.core.current.maps());
        let holder: Holder = self.clone();
        move |name| maps.as_ref()?.shared_view(name, &holder)
    }

    fn put<'a>(
        &'a self,
        put: PutArgs<'a>,
    ) -> impl std::future::Future<Output = Result<Put, Error>> + Send + 'a {
        std::future::ready(ops::put_blocking(self, put))
    }

    fn put_later(&self, route: Route, put: &PutArgs<'_>) -> Option<Result<Put, Error>> {
        match route {
            Route::InlinePipelined => self.put_pipelined(put).map(|r| r.map(|()| Put::Sent)),
            Route::LendPipelined => ops::pending(self.put_lent_later(put)),
            Route::SmallLend => {
                let one = [(put.name, put.data, put.metadata, put.options)];
                ops::pending(self.put_views_later(&one).pop().flatten())
            }
            Route::Inline | Route::Lend | Route::CreateCopySeal => None,
        }
    }
}

crate::ops::puts_on_driver!(Client, , |op| ready(op));
crate::ops::transfers_on_driver!(Client, , |op| ready(op));

crate::ops::store_on_driver!(Store for Client, , |op| ready(op), {
    /// `ops::get_one`'s halves apart: a get the shared directory serves makes no future.
    fn get_one(&self, name: &str, timeout: Option<Duration>) -> Result<ObjectView, Error> {
        match ops::held_one(&self.inner, name) {
            Some(view) => Ok(view),
            None => ready(ops::get_one_from_store(&self.inner, name, timeout)),
        }
    }
});

/// The blocking client over one end of a socket pair whose other end a test plays the daemon
/// on: its puts, batches and owed replies, with no daemon.
#[cfg(test)]
mod tests;
