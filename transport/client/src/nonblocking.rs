//! The async driver: [`AsyncClient`] over a tokio Unix socket, the operations of `crate::ops`
//! awaited on it, and [`AsyncSubscription`]. Its puts all wait for the store's answer: the
//! blocking client's puts that do not (pipelined, the small lend) save a thread's round trip,
//! which an async caller does not block on in the first place, and they would need a queue of
//! owed replies read by whichever task comes next.

use std::os::fd::AsFd;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vovp_proto::{Header, Reply, Request, HEADER_LEN};
use vovp_shm::held::Holder;
use vovp_types::{AsyncStore, Error, Notification, ObjectId, ObjectRef, ObjectSink, ObjectView};

use crate::core::{requests, Answered, Core, Expect, Wire};
use crate::io::{self, conn_err, handshake};
use crate::lent::ClientLend;
use crate::mapping::{MappedSegment, Mappings};
use crate::notify::Notifications;
use crate::ops::{self, Driver, Put, PutArgs};
use crate::ClientOptions;

/// Reads one whole frame from `stream`: its header, and its payload into `payload`.
async fn read_frame(
    stream: &mut tokio::net::UnixStream,
    payload: &mut Vec<u8>,
) -> Result<Header, Error> {
    let mut header = [0u8; HEADER_LEN];
    stream.read_exact(&mut header).await.map_err(conn_err)?;
    let h = Header::parse(&header)?.ok_or_else(|| Error::Protocol("short header".into()))?;
    payload.resize(h.payload_len, 0);
    stream.read_exact(payload).await.map_err(conn_err)?;
    Ok(h)
}

struct AsyncConn {
    stream: tokio::net::UnixStream,
    wire: Wire,
    payload: Vec<u8>,
}

impl AsyncConn {
    fn new(stream: tokio::net::UnixStream) -> Self {
        AsyncConn {
            stream,
            wire: Wire::new(),
            payload: Vec::new(),
        }
    }

    async fn exchange(&mut self, core: &Core, req: &Request<'_>) -> Result<Reply, Error> {
        let id = core.frame(&mut self.wire, req);
        self.stream
            .write_all(&self.wire.out)
            .await
            .map_err(conn_err)?;
        let h = read_frame(&mut self.stream, &mut self.payload).await?;
        crate::core::decode_reply(&h, &self.payload, id, req)
    }

    /// The same exchange for a synchronous caller: blocking I/O straight on the socket's
    /// (non-blocking) fd, waiting in `poll`. tokio copes with bytes read behind its back (a
    /// stale readiness is a `WouldBlock` it clears). Only with the connection locked, between
    /// two whole exchanges, so the stream is never read from two places at once.
    fn exchange_blocking(&mut self, core: &Core, req: &Request<'_>) -> Result<Reply, Error> {
        let id = core.frame(&mut self.wire, req);
        let fd = self.stream.as_fd();
        io::write_all(fd, &self.wire.out)?;
        let h = io::read_frame(fd, &mut self.payload)?;
        crate::core::decode_reply(&h, &self.payload, id, req)
    }

    /// Asks for segment `segment`'s fd (on this connection: an arena is writable only from
    /// the connection that created in it) and maps it.
    async fn map_segment(&mut self, core: &Core, segment: u32) -> Result<MappedSegment, Error> {
        let id = core.frame(&mut self.wire, &Request::Segment { id: segment });
        self.stream
            .write_all(&self.wire.out)
            .await
            .map_err(conn_err)?;
        let stream = &self.stream;
        let mut frame = vec![0u8; 4096];
        let mut got = 0;
        let mut fds = Vec::new();
        while !crate::core::frame_complete(&mut frame, got)? {
            stream.readable().await.map_err(conn_err)?;
            match stream.try_io(tokio::io::Interest::READABLE, || {
                vovp_shm::fdpass::recv_with_fds(stream, &mut frame[got..], &mut fds)
            }) {
                Ok(0) => return Err(conn_err(std::io::ErrorKind::UnexpectedEof.into())),
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(conn_err(e)),
            }
        }
        crate::core::map_segment_reply(&frame, id, segment, fds)
    }
}

struct AsyncInner {
    core: Core,
    conn: tokio::sync::Mutex<AsyncConn>,
    /// Map the shared directory on connect and reconnect.
    shared_reads: bool,
    /// The part of its arena the store lent this client (puts without CREATE).
    lend: ClientLend,
}

impl AsyncInner {
    /// Seals `obj` on this client's own connection, from a synchronous caller
    /// (`ObjectBuffer::seal`): the daemon lets only the connection that created an object
    /// seal it. Waits for the connection if another call holds it, where waiting cannot
    /// deadlock.
    fn seal_blocking(&self, generation: u64, obj: &ObjectRef) -> Result<u64, Error> {
        let req = requests::seal(obj.name.as_str())?;
        let run = |conn: &mut AsyncConn| {
            self.core.check_generation(generation, obj.name.as_str())?;
            conn.exchange_blocking(&self.core, &req)?.version()
        };
        if let Ok(mut conn) = self.conn.try_lock() {
            return run(&mut conn);
        }
        use tokio::runtime::{Handle, RuntimeFlavor};
        match Handle::try_current().map(|h| h.runtime_flavor()) {
            // Outside any runtime: the holder runs elsewhere; wait for it.
            Err(_) => run(&mut self.conn.blocking_lock()),
            // A worker thread: hand its other tasks (the holder among them) to other workers
            // while this one waits.
            Ok(RuntimeFlavor::MultiThread) => {
                tokio::task::block_in_place(|| run(&mut self.conn.blocking_lock()))
            }
            // The holder may be a task of this very thread, which cannot run while we wait.
            Ok(_) => Err(Error::Protocol(format!(
                "ObjectBuffer::seal of {} while another call of its AsyncClient is in flight \
                 on this single-threaded runtime would deadlock; use AsyncStore::seal",
                obj.name
            ))),
        }
    }
}

/// A view's way back to its async client: releases queue for the next request, only while
/// the connection the view came from is the current one.
struct AsyncViewSink {
    inner: Arc<AsyncInner>,
    generation: u64,
}

impl ObjectSink for AsyncViewSink {
    fn release(&self, id: ObjectId) {
        let id = id.get();
        self.inner.core.defer_release(id, self.generation);
    }

    fn seal(&self, obj: &ObjectRef) -> Result<u64, Error> {
        self.inner.seal_blocking(self.generation, obj)
    }
}

/// Connects and handshakes off the async runtime (the handshake is blocking socket I/O).
async fn async_handshake(
    path: &Path,
    shared: bool,
) -> Result<(tokio::net::UnixStream, Mappings), Error> {
    let path = path.to_owned();
    let (std_stream, maps) = tokio::task::spawn_blocking(move || handshake(&path, shared))
        .await
        .map_err(|e| Error::Internal(e.to_string()))??;
    std_stream.set_nonblocking(true).map_err(conn_err)?;
    let stream = tokio::net::UnixStream::from_std(std_stream).map_err(conn_err)?;
    Ok((stream, maps))
}

/// The async client: the same protocol on a tokio `UnixStream`. Blocking-free: releases from
/// dropped views are queued and sent ahead of the next request (or by [`AsyncClient::flush`]).
#[derive(Clone)]
pub struct AsyncClient {
    inner: Arc<AsyncInner>,
}

impl AsyncClient {
    /// Connects to the daemon listening on `path`, on the current tokio runtime.
    ///
    /// ```no_run
    /// use vovp_client::{AsyncClient, AsyncStore};
    ///
    /// # async fn run() -> Result<(), vovp_client::Error> {
    /// let client = AsyncClient::connect("/tmp/vovp.sock").await?;
    /// client.put("greeting", b"hello", b"", Default::default()).await?;
    /// let views = client.get(&["greeting"], None).await?;
    /// assert!(views[0].is_some());
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect(path: impl AsRef<Path>) -> Result<AsyncClient, Error> {
        Self::connect_with(path, ClientOptions::default()).await
    }

    pub async fn connect_with(
        path: impl AsRef<Path>,
        options: ClientOptions,
    ) -> Result<AsyncClient, Error> {
        let path = path.as_ref().to_owned();
        let shared_reads = !options.no_shared_reads;
        let (stream, maps) = async_handshake(&path, shared_reads).await?;
        Ok(AsyncClient {
            inner: Arc::new(AsyncInner {
                shared_reads,
                core: Core::new(path, maps, options.reconnect),
                conn: tokio::sync::Mutex::new(AsyncConn::new(stream)),
                lend: ClientLend::new(!options.no_lend_puts && !options.no_shared_reads),
            }),
        })
    }

    /// Sends queued releases now.
    pub async fn flush(&self) -> Result<(), Error> {
        ops::call(self, &Request::STATS_FIRST).await.map(drop)
    }

    /// The daemon's metrics in the Prometheus text format (as the blocking client's
    /// [`crate::Client::metrics`]).
    pub async fn metrics(&self) -> Result<String, Error> {
        ops::call(self, &Request::Metrics).await?.metrics()
    }

    /// Opens a notification stream (its own connection, as the blocking client's
    /// [`crate::Client::subscribe`]).
    pub async fn subscribe(&self) -> Result<AsyncSubscription, Error> {
        let (stream, _maps) = async_handshake(&self.inner.core.path, false).await?;
        let mut conn = AsyncConn::new(stream);
        // Not through `Core::frame`: the queued releases belong to the main connection.
        let id = conn.wire.push(&Request::Subscribe, 0);
        conn.stream
            .write_all(&conn.wire.out)
            .await
            .map_err(conn_err)?;
        // Read exactly: the notifications after it are the subscription's.
        let h = read_frame(&mut conn.stream, &mut conn.payload).await?;
        crate::notify::subscribed(&h, &conn.payload, id)?;
        Ok(AsyncSubscription {
            stream: conn.stream,
            received: Notifications::default(),
        })
    }

    /// GET over the socket, the shared directory not asked (as the blocking client's
    /// [`crate::Client::get_from_store`]).
    pub async fn get_from_store(
        &self,
        names: &[&str],
        timeout: Option<Duration>,
    ) -> Result<Vec<Option<ObjectView>>, Error> {
        ops::get_from_store(self, names, timeout).await
    }

    /// As the blocking client's: the reply, with the mappings and generation that answered;
    /// one reconnect and retry when the daemon went away and the client opted in.
    async fn call_in_session(&self, req: &Request<'_>) -> Result<(Reply, Answered), Error> {
        let core = &self.inner.core;
        let mut conn = self.inner.conn.lock().await;
        let session = core.current.now();
        match conn.exchange(core, req).await {
            Err(Error::Connection(why)) if core.reconnect => {
                tracing::info!("vovp: connection lost ({why}); reconnecting");
                let (stream, maps) = async_handshake(&core.path, self.inner.shared_reads).await?;
                conn.stream = stream;
                let answered = core.reconnected(&mut conn.wire, maps);
                let reply = conn.exchange(core, req).await?;
                Ok((reply, answered))
            }
            other => other.map(|r| (r, session)),
        }
    }

    /// As the blocking client's `map_segment_of`, on the async connection.
    async fn map_segment_of(
        &self,
        maps: &Mappings,
        generation: u64,
        segment: u32,
    ) -> Result<Arc<MappedSegment>, Error> {
        let mut conn = self.inner.conn.lock().await;
        if self.inner.core.current.generation() != generation {
            return Err(Error::Connection(
                "the daemon went away while mapping a segment".into(),
            ));
        }
        let seg = Arc::new(conn.map_segment(&self.inner.core, segment).await?);
        maps.insert_segment(segment, seg.clone());
        Ok(seg)
    }
}

/// A stream of seal/delete/evict notifications on a dedicated connection (the blocking
/// [`crate::Subscription`]'s async twin).
#[derive(Debug)]
pub struct AsyncSubscription {
    stream: tokio::net::UnixStream,
    received: Notifications,
}

impl AsyncSubscription {
    /// The next notification. Cancel-safe (a notification cut short stays buffered for the
    /// next call), so it can be raced against a timeout. A stream the daemon ended (it drops
    /// subscribers that fall too far behind) is `Error::Connection`.
    pub async fn next(&mut self) -> Result<Notification, Error> {
        loop {
            if let Some(n) = self.received.next()? {
                return Ok(n);
            }
            let mut chunk = [0u8; 4096];
            match self.stream.read(&mut chunk).await {
                Ok(0) => return Err(Error::Connection("the notification stream ended".into())),
                Ok(n) => self.received.extend(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(conn_err(e)),
            }
        }
    }
}

/// The async driver of the shared operations (`crate::ops`).
impl Driver for AsyncClient {
    fn core(&self) -> &Core {
        &self.inner.core
    }

    fn lend(&self) -> &ClientLend {
        &self.inner.lend
    }

    fn pipelines(&self) -> bool {
        false
    }

    fn call_in_session<'a>(
        &'a self,
        req: &'a Request<'_>,
    ) -> impl std::future::Future<Output = Result<(Reply, Answered), Error>> + Send + 'a {
        AsyncClient::call_in_session(self, req)
    }

    fn map_segment<'a>(
        &'a self,
        (maps, generation): &'a Answered,
        segment: u32,
    ) -> impl std::future::Future<Output = Result<Arc<MappedSegment>, Error>> + Send + 'a {
        self.map_segment_of(maps, *generation, segment)
    }

    fn sink(&self, generation: u64) -> Arc<dyn ObjectSink> {
        Arc::new(AsyncViewSink {
            inner: self.inner.clone(),
            generation,
        })
    }

    fn put<'a>(
        &'a self,
        put: PutArgs<'a>,
    ) -> impl std::future::Future<Output = Result<Put, Error>> + Send + 'a {
        ops::put(self, put)
    }

    fn directory(&self) -> impl FnMut(&str) -> Option<ObjectView> + '_ {
        let maps = self.inner.core.current.maps();
        let holder: Holder = self.inner.clone();
        move |name| maps.shared_view(name, &holder)
    }
}

impl std::fmt::Debug for AsyncClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("AsyncClient")
            .field(&self.inner.core)
            .finish()
    }
}

impl AsyncClient {
    /// The driver its operations run on (`crate::ops`): itself.
    fn driver(&self) -> &Self {
        self
    }
}

crate::ops::puts_on_driver!(AsyncClient, async, |op| op.await);
crate::ops::transfers_on_driver!(AsyncClient, async, |op| op.await);

crate::ops::store_on_driver!(AsyncStore for AsyncClient, async, |op| op.await, {});
