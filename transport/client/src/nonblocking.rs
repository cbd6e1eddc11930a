//! The async driver: [`AsyncClient`] over a tokio Unix socket.

use std::os::fd::AsFd;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vovp_proto::{Header, Reply, Request, HEADER_LEN, LIST_END};
use vovp_types::{
    AsyncStore, CreateOptions, Error, ObjectBuffer, ObjectId, ObjectInfo, ObjectRef, ObjectSink,
    ObjectView, StoreStats,
};

use crate::core::{self, requests, Answered, Core, Expect, Wire};
use crate::io::{self, conn_err, handshake};
use crate::lent::{self, Lends, Lent, Reservation};
use crate::mapping::{MappedSegment, Mappings};
use crate::shared::Connection;
use crate::ClientOptions;

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
        let mut header = [0u8; HEADER_LEN];
        self.stream
            .read_exact(&mut header)
            .await
            .map_err(conn_err)?;
        let h = Header::parse(&header)?.ok_or_else(|| Error::Protocol("short header".into()))?;
        self.payload.resize(h.payload_len, 0);
        self.stream
            .read_exact(&mut self.payload)
            .await
            .map_err(conn_err)?;
        core::decode_reply(&h, &self.payload, id, req)
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
        core::decode_reply(&h, &self.payload, id, req)
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
        while !core::frame_complete(&mut frame, got)? {
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
        core::map_segment_reply(&frame, id, segment, fds)
    }
}

struct AsyncInner {
    core: Core,
    conn: tokio::sync::Mutex<AsyncConn>,
    /// Map the shared directory on connect and reconnect.
    shared_reads: bool,
    /// The part of its arena the store lent this client (puts without CREATE).
    lends: Lends,
}

impl AsyncInner {
    /// Seals `obj` on this client's own connection, from a synchronous caller
    /// (`ObjectBuffer::seal`): the daemon lets only the connection that created an object
    /// seal it. Waits for the connection if another call holds it, where waiting cannot
    /// deadlock.
    fn seal_blocking(&self, generation: u64, obj: &ObjectRef) -> Result<u64, Error> {
        let req = requests::seal(obj.name.as_str())?;
        let run = |conn: &mut AsyncConn| {
            self.core.check_generation(generation, obj)?;
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

impl std::fmt::Debug for AsyncClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncClient")
            .field("socket", &self.inner.core.path)
            .finish_non_exhaustive()
    }
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
                lends: Lends::new(!options.no_lend_puts && !options.no_shared_reads),
            }),
        })
    }

    /// Sends queued releases now.
    pub async fn flush(&self) -> Result<(), Error> {
        self.call(&Request::STATS_FIRST).await.map(drop)
    }

    async fn call(&self, req: &Request<'_>) -> Result<Reply, Error> {
        self.call_in_session(req).await.map(|(r, _)| r)
    }

    /// As the blocking client's: the reply, with the mappings and generation that answered;
    /// one reconnect and retry when the daemon went away and the client opted in.
    async fn call_in_session(&self, req: &Request<'_>) -> Result<(Reply, Answered), Error> {
        let core = &self.inner.core;
        let mut conn = self.inner.conn.lock().await;
        let session = core.session.current();
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

    /// As the blocking client's `pin_segments`, on the async connection.
    async fn pin_segments<'r>(
        &self,
        (maps, generation): &Answered,
        refs: impl IntoIterator<Item = &'r ObjectRef>,
    ) -> Result<Vec<Arc<MappedSegment>>, Error> {
        let (mut pins, missing) = maps.segments_of(refs);
        for segment in missing {
            pins.push(self.map_segment_of(maps, *generation, segment).await?);
        }
        Ok(pins)
    }

    /// As the blocking client's `map_segment_of`, on the async connection.
    async fn map_segment_of(
        &self,
        maps: &Mappings,
        generation: u64,
        segment: u32,
    ) -> Result<Arc<MappedSegment>, Error> {
        let mut conn = self.inner.conn.lock().await;
        if self.inner.core.session.generation() != generation {
            return Err(Error::Connection(
                "the daemon went away while mapping a segment".into(),
            ));
        }
        let seg = Arc::new(conn.map_segment(&self.inner.core, segment).await?);
        maps.insert_segment(segment, seg.clone());
        Ok(seg)
    }

    /// As the blocking client's: a put through this client's lend (copy, one PUBLISH);
    /// `None` when it does not go through a lend.
    async fn put_lent(
        &self,
        name: &str,
        data: &[u8],
        metadata: &[u8],
        options: &CreateOptions,
    ) -> Option<Result<(), Error>> {
        if options.device.is_some_and(|d| d != vovp_types::Device::Cpu) {
            return None;
        }
        let lends = &self.inner.lends;
        let capacity = || self.inner.core.session.maps().capacity;
        let need = lends.wants(data.len(), metadata.len(), capacity)?;
        // A lend is taken back through the hold table: no table (or a forked child, which
        // cannot announce its writes there), no lend.
        let maps = self.inner.core.session.maps();
        if !maps.shared.as_ref()?.can_announce() {
            return None;
        }
        let generation = self.inner.core.session.generation();
        let mut reserved = match lends.reserve(need, generation) {
            Reservation::Got(r) => r,
            Reservation::No | Reservation::Busy => return None,
            Reservation::Lend(asked) => {
                let lent = self.take_lend(asked.at_least).await;
                asked.install(lent)?
            }
        };
        let result = async {
            let req = reserved.write(name, data, metadata, options, 0)?;
            let (reply, answered) = self.call_in_session(&req).await?;
            if answered.1 != reserved.generation {
                return Err(Error::Connection(
                    "the daemon went away during a put; put again".into(),
                ));
            }
            reply.object().map(drop)
        }
        .await;
        // NOT_FOUND from PUBLISH is about the lend: put another way.
        if matches!(result, Err(Error::NotFound(_))) {
            reserved.lend_gone();
            return None;
        }
        Some(result)
    }

    /// LEND, and the lend's segment mapped writable.
    async fn take_lend(&self, at_least: u64) -> Result<Lent, Error> {
        let (reply, answered) = self
            .call_in_session(&Request::Lend { at_least, flags: 0 })
            .await?;
        let lend = reply.lent()?;
        let segment = match answered.0.segment(lend.segment) {
            Some(s) => s,
            None => {
                self.map_segment_of(&answered.0, answered.1, lend.segment)
                    .await?
            }
        };
        lent::check(&lend, &segment)?;
        // The store lends only to connections with a hold table; one without is refused
        // before asking (`put_lent`), so this is a daemon out of step: put another way.
        let shared = answered.0.shared.clone().ok_or_else(|| {
            Error::Config("a lend without a hold table to take it back through".into())
        })?;
        Ok((lend, segment, answered.1, shared))
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
        let req = requests::create(name, size, metadata, options)?;
        let (reply, answered) = self.call_in_session(&req).await?;
        let r = reply.object()?;
        let id = r.id;
        let sink = self.sink(answered.1);
        core::check_created(&r, size).inspect_err(|_| sink.release(id))?;
        let _pins = self
            .pin_segments(&answered, [&r])
            .await
            .inspect_err(|_| sink.release(id))?;
        answered
            .0
            .buffer(r, sink.clone())
            .inspect_err(|_| sink.release(id))
    }

    async fn seal(&self, name: &str) -> Result<u64, Error> {
        self.call(&requests::seal(name)?).await?.version()
    }

    async fn abort(&self, name: &str) -> Result<(), Error> {
        self.call(&requests::abort(name)?).await?.empty()
    }

    async fn put(
        &self,
        name: &str,
        data: &[u8],
        metadata: &[u8],
        options: CreateOptions,
    ) -> Result<(), Error> {
        if let Some(r) = self.put_lent(name, data, metadata, &options).await {
            return r;
        }
        let maps = self.inner.core.session.maps();
        if let Some(flags) = maps.inline_flags(data.len(), &options, false) {
            let req = requests::put(name, flags, metadata, data)?;
            return self.call(&req).await?.object().map(drop);
        }
        vovp_shm::put::create_copy_seal_async(self, name, data, metadata, options).await
    }

    /// As the blocking client's: the shared directory first, one GET for the rest.
    async fn get(
        &self,
        names: &[&str],
        timeout: Option<Duration>,
    ) -> Result<Vec<Option<ObjectView>>, Error> {
        let connection: Connection = self.inner.clone();
        let (mut views, missing) =
            core::shared_part(&self.inner.core.session.maps(), names, &connection);
        if missing.is_empty() {
            return Ok(views);
        }
        let rest: Vec<&str> = missing.iter().map(|&i| names[i]).collect();
        let got = self.get_over_socket(&rest, timeout).await?;
        vovp_shm::held::fill_in(&mut views, missing, got);
        Ok(views)
    }

    /// As the blocking client's: a held version above `newer_than`, else GET_NEWER.
    async fn get_newer(
        &self,
        name: &str,
        newer_than: u64,
        timeout: Option<Duration>,
    ) -> Result<ObjectView, Error> {
        let connection: Connection = self.inner.clone();
        let maps = self.inner.core.session.maps();
        if let Some(v) = core::shared_newer(&maps, name, newer_than, &connection) {
            return Ok(v);
        }
        // A reconnect may replace the mappings while GET_NEWER waits: hold none of them.
        drop(maps);
        let req = requests::get_newer(name, newer_than, timeout)?;
        core::newer_or_not_found(name, self.views_of(&req).await?)
    }

    async fn contains(&self, name: &str) -> Result<bool, Error> {
        self.call(&requests::contains(name)?).await?.boolean()
    }

    async fn delete(&self, name: &str) -> Result<(), Error> {
        self.call(&requests::delete(name)?).await?.empty()
    }

    async fn list(&self) -> Result<Vec<ObjectInfo>, Error> {
        let mut all = Vec::new();
        let mut start = 0;
        while start != LIST_END {
            let (page, next) = self.call(&requests::list(start)).await?.list()?;
            all.extend(page);
            start = next;
        }
        Ok(all)
    }

    async fn evict(&self, bytes: u64) -> Result<u64, Error> {
        self.call(&Request::Evict { bytes }).await?.count()
    }

    async fn stats(&self) -> Result<StoreStats, Error> {
        let reply = match self.call(&Request::STATS).await {
            Err(e) if crate::core::older_daemon_refused(&e) => {
                self.call(&Request::STATS_FIRST).await?
            }
            r => r?,
        };
        Ok(reply.stats()?.0)
    }
}

impl AsyncClient {
    /// GET over the socket (names the shared directory did not serve).
    async fn get_over_socket(
        &self,
        names: &[&str],
        timeout: Option<Duration>,
    ) -> Result<Vec<Option<ObjectView>>, Error> {
        self.views_of(&requests::get(names, timeout)?).await
    }

    /// The views a GET or GET_NEWER answers with.
    async fn views_of(&self, req: &Request<'_>) -> Result<Vec<Option<ObjectView>>, Error> {
        let (reply, answered) = self.call_in_session(req).await?;
        let objects = reply.objects()?;
        let sink = self.sink(answered.1);
        // Kept until the views hold the segments they point into.
        let _pins = match self.pin_segments(&answered, objects.iter().flatten()).await {
            Ok(pins) => pins,
            Err(e) => {
                objects.iter().flatten().for_each(|r| sink.release(r.id));
                return Err(e);
            }
        };
        answered.0.views(objects, sink)
    }
}
