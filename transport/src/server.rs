//! The daemon: a Unix-socket server on io_uring (tokio-uring) with one kameo actor per
//! connection. Everything runs on one thread: tokio-uring drives a current-thread tokio runtime,
//! and kameo spawns its actors with `tokio::spawn`, so the engine's actors, the connection
//! actors and the socket tasks share that runtime and no message crosses a thread.

use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener as StdUnixListener, UnixStream as StdUnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kameo::actor::Spawn;
use kameo::message::{Context, Message};
use kameo::Actor;
use tokio_uring::buf::BoundedBuf;
use vovp::{AsyncStore, CreateOptions, EngineHandle, HolderId, ObjectName};
use vovp_actors::table_actor as table;

use crate::protocol::*;

/// How the daemon is set up.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub socket: PathBuf,
    pub engine: vovp::Config,
    /// Mode of the socket file (default 0600: only the owner may connect).
    pub socket_mode: u32,
    /// Peer uids allowed to connect (checked with SO_PEERCRED).
    pub allowed_uids: Vec<u32>,
}

impl ServerConfig {
    pub fn new(socket: impl Into<PathBuf>, engine: vovp::Config) -> Self {
        ServerConfig {
            socket: socket.into(),
            engine,
            socket_mode: 0o600,
            allowed_uids: vec![rustix::process::getuid().as_raw()],
        }
    }
}

/// Counters shared by all connections.
#[derive(Default)]
struct Shared {
    connections: AtomicU64,
}

/// Binds the socket (refusing a path a live daemon serves, replacing a stale one), then serves
/// until SIGINT/SIGTERM, and removes the socket file on the way out.
pub fn run(config: ServerConfig) -> Result<(), TransportError> {
    let socket = config.socket.clone();
    let mut bound = false;
    let result = tokio_uring::start(serve(config, &mut bound));
    // Only a socket this daemon bound is removed (never a live daemon's it refused to replace).
    if bound {
        let _ = std::fs::remove_file(&socket);
    }
    result
}

fn bind_socket(path: &Path, mode: u32) -> Result<StdUnixListener, TransportError> {
    let setup = |what: String| TransportError::Setup(what);
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(setup(format!(
                "{} exists and is not a socket; refusing to replace it",
                path.display()
            )));
        }
        if StdUnixStream::connect(path).is_ok() {
            return Err(setup(format!(
                "a live daemon already serves {}; stop it or choose another --socket",
                path.display()
            )));
        }
        tracing::info!("replacing stale socket {}", path.display());
        std::fs::remove_file(path).map_err(|e| setup(format!("removing stale socket: {e}")))?;
    }
    // Bind under a tight umask so the socket is never reachable with looser permissions.
    let old = rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o177));
    let bound = StdUnixListener::bind(path);
    rustix::process::umask(old);
    let listener = bound.map_err(|e| setup(format!("cannot bind {}: {e}", path.display())))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| setup(format!("chmod {}: {e}", path.display())))?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

async fn serve(config: ServerConfig, bound: &mut bool) -> Result<(), TransportError> {
    // Signals first: from the moment the socket accepts, SIGTERM means a clean shutdown.
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut sigint = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    let engine = vovp::Engine::start(config.engine.clone())
        .await
        .map_err(|e| TransportError::Setup(format!("starting the engine: {e}")))?;
    let listener = bind_socket(&config.socket, config.socket_mode)?;
    *bound = true;
    let shared = Arc::new(Shared::default());
    // tokio's reactor runs inside tokio-uring's runtime; accepting through it sidesteps
    // tokio-uring's listener, which sets SO_REUSEPORT and fails on Unix sockets (EOPNOTSUPP).
    let listener = tokio::net::UnixListener::from_std(listener)?;
    tracing::info!(
        "vovp-engine serving {} with {} bytes of shared memory",
        config.socket.display(),
        config.engine.capacity
    );
    let allowed = Arc::new(config.allowed_uids.clone());
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((s, _)) => s,
                    Err(e) => {
                        tracing::warn!("accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let stream = match stream.into_std() {
                    Ok(s) => s,
                    Err(e) => { tracing::warn!("socket conversion failed: {e}"); continue; }
                };
                match peer_allowed(&stream, &allowed) {
                    Ok(()) => {}
                    Err(why) => { tracing::warn!("refused a connection: {why}"); continue; }
                }
                let engine = engine.clone();
                let shared = shared.clone();
                tokio_uring::spawn(async move {
                    shared.connections.fetch_add(1, Ordering::Relaxed);
                    if let Err(e) = serve_connection(stream, engine, shared.clone()).await {
                        tracing::debug!("connection ended: {e}");
                    }
                    shared.connections.fetch_sub(1, Ordering::Relaxed);
                });
            }
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
        }
    }
    tracing::info!("shutting down");
    Ok(())
}

/// SO_PEERCRED: only allowed uids may talk to the store.
fn peer_allowed(stream: &StdUnixStream, allowed: &[u32]) -> Result<(), String> {
    let cred = rustix::net::sockopt::socket_peercred(stream).map_err(|e| e.to_string())?;
    check_uid(cred.uid.as_raw(), allowed)
        .map_err(|e| format!("pid {}: {e}", cred.pid.as_raw_nonzero()))
}

/// The permission rule itself (unit-tested).
pub fn check_uid(uid: u32, allowed: &[u32]) -> Result<(), String> {
    if allowed.contains(&uid) {
        Ok(())
    } else {
        Err(format!(
            "uid {uid} is not allowed (allowed: {allowed:?}; see --allow-uid)"
        ))
    }
}

const READ_CHUNK: usize = 256 * 1024;

async fn serve_connection(
    stream: StdUnixStream,
    engine: EngineHandle,
    shared: Arc<Shared>,
) -> Result<(), TransportError> {
    // Blocking mode: io_uring does not care, and the one raw sendmsg (HELLO) then never
    // sees EAGAIN.
    stream.set_nonblocking(false)?;
    let raw = stream.try_clone()?;
    let stream = tokio_uring::net::UnixStream::from_std(stream);
    let holder = engine.new_holder_id();
    let conn = ConnectionActor::spawn(ConnectionActor {
        holder,
        engine: engine.clone(),
        shared,
        greeted: false,
    });
    let result = connection_loop(&stream, &raw, &conn, (holder, &engine)).await;
    // Whatever the reason the connection ended, everything it held goes back.
    let _ = conn.ask(Disconnect).await;
    let _ = conn.stop_gracefully().await;
    debug_assert!(raw.as_raw_fd() >= 0);
    result
}

async fn connection_loop(
    stream: &tokio_uring::net::UnixStream,
    raw: &StdUnixStream,
    conn: &kameo::actor::ActorRef<ConnectionActor>,
    holder: (HolderId, &EngineHandle),
) -> Result<(), TransportError> {
    let mut inbuf: Vec<u8> = Vec::with_capacity(READ_CHUNK);
    let mut rbuf: Vec<u8> = Vec::with_capacity(READ_CHUNK);
    let mut out: Vec<u8> = Vec::with_capacity(4096);
    loop {
        let mut consumed = 0;
        loop {
            let header = match Header::parse(&inbuf[consumed..]) {
                Ok(Some(h)) => h,
                Ok(None) => break,
                Err(e) => {
                    // The stream cannot be resynchronised: say why, then close.
                    let code = match e {
                        TransportError::UnsupportedVersion(_) => status::UNSUPPORTED_VERSION,
                        TransportError::FrameTooLarge(_) => status::TOO_LARGE,
                        _ => status::MALFORMED,
                    };
                    Response::error(code, e.to_string()).encode(0, 0, &mut out);
                    let _ = stream.write_all(out).await;
                    return Err(e);
                }
            };
            if inbuf.len() - consumed < header.frame_len() {
                break;
            }
            let payload = &inbuf[consumed + HEADER_LEN..consumed + header.frame_len()];
            consumed += header.frame_len();
            let no_reply = header.flags & FLAG_NO_REPLY != 0;
            let response = match Request::decode(header.opcode, payload) {
                // One-way releases are told, not asked: nothing waits for them, and the
                // mailboxes' FIFO order still puts them before the next request's work.
                Ok(request @ Request::Release { .. }) if no_reply => {
                    // Waits only when the mailbox is full: backpressure on release floods.
                    if conn
                        .tell(Incoming { request, no_reply })
                        .send()
                        .await
                        .is_err()
                    {
                        return Err(TransportError::Setup("store stopping".into()));
                    }
                    Response::NoReply
                }
                Ok(request) => answer(conn, Incoming { request, no_reply }, raw, holder).await,
                Err((code, message)) => Response::error(code, message),
            };
            match response {
                Response::Hello { .. } => {
                    let (res, back) = flush(stream, out).await;
                    out = back;
                    res?;
                    let mut reply = Vec::new();
                    response.encode(header.opcode, header.request_id, &mut reply);
                    send_hello(stream, raw, conn, reply).await?;
                }
                Response::Subscribed(rx) => {
                    response_empty(header, &mut out);
                    let (res, back) = flush(stream, out).await;
                    res?;
                    return notify_loop(stream, rx, back).await;
                }
                other => other.encode(header.opcode, header.request_id, &mut out),
            }
        }
        inbuf.drain(..consumed);
        rbuf.clear();
        // The replies and the next read go to the kernel together (one io_uring_enter):
        // waiting for the write before submitting the read costs a context switch per request.
        let (write_res, (res, back)) = if out.is_empty() {
            (Ok(()), stream.read(rbuf).await)
        } else {
            let (written, read) = tokio::join!(flush(stream, out), stream.read(rbuf));
            out = written.1;
            (written.0, read)
        };
        rbuf = back;
        write_res?;
        match res {
            Ok(0) => return Ok(()),
            Ok(_) => inbuf.extend_from_slice(&rbuf),
            Err(e) => return Err(e.into()),
        }
    }
}

/// How often a long request (a GET waiting for a seal) checks that its client is still there.
const LIVENESS_CHECK: Duration = Duration::from_millis(100);

/// Asks the connection actor and waits for its response. While a request waits (a GET with a
/// timeout), the loop does not read the socket, so it would not notice the client dying: every
/// `LIVENESS_CHECK` it peeks at the socket, and on end-of-file releases everything the holder
/// held at once (which also cancels the waiting GET) instead of when the wait ends.
async fn answer(
    conn: &kameo::actor::ActorRef<ConnectionActor>,
    incoming: Incoming,
    raw: &StdUnixStream,
    (holder, engine): (HolderId, &EngineHandle),
) -> Response {
    let stopping = |_| Response::error(status::SHUTTING_DOWN, "store stopping");
    // Only a GET with a timeout can wait; every other request is answered at once and needs no
    // timer on the hot path.
    let may_wait = matches!(&incoming.request, Request::Get { timeout_ms, .. } if *timeout_ms != 0);
    if !may_wait {
        return conn.ask(incoming).await.unwrap_or_else(stopping);
    }
    let ask = conn.ask(incoming).send();
    tokio::pin!(ask);
    let mut released = false;
    loop {
        tokio::select! {
            r = &mut ask => {
                return r.unwrap_or_else(stopping);
            }
            _ = tokio::time::sleep(LIVENESS_CHECK), if !released => {
                if peer_closed(raw) {
                    released = true;
                    let _ = engine.actors().table.tell(table::ReleaseHolder { holder }).try_send();
                }
            }
        }
    }
}

/// True when the peer has closed its end (a peek reads end-of-file) or the socket failed.
fn peer_closed(raw: &StdUnixStream) -> bool {
    let mut b = [0u8; 1];
    match rustix::net::recv(
        raw,
        &mut b,
        rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT,
    ) {
        Ok((0, _)) => true,
        Ok(_) | Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => false,
        Err(_) => true,
    }
}

fn response_empty(header: Header, out: &mut Vec<u8>) {
    Response::Empty.encode(header.opcode, header.request_id, out);
}

async fn flush(
    stream: &tokio_uring::net::UnixStream,
    out: Vec<u8>,
) -> (Result<(), TransportError>, Vec<u8>) {
    if out.is_empty() {
        return (Ok(()), out);
    }
    let (res, mut back) = stream.write_all(out).await;
    back.clear();
    (res.map_err(TransportError::from), back)
}

async fn send_hello(
    stream: &tokio_uring::net::UnixStream,
    raw: &StdUnixStream,
    conn: &kameo::actor::ActorRef<ConnectionActor>,
    reply: Vec<u8>,
) -> Result<(), TransportError> {
    let segments = conn
        .ask(SegmentFds)
        .await
        .map_err(|_| TransportError::Setup("store stopping".into()))?;
    let fds: Vec<_> = segments.iter().map(|s| s.fd()).collect();
    let sent = crate::fdpass::send_with_fds(raw.as_fd(), &reply, &fds)?;
    if sent < reply.len() {
        let (res, _) = stream.write_all(reply.slice(sent..)).await;
        res?;
    }
    Ok(())
}

async fn notify_loop(
    stream: &tokio_uring::net::UnixStream,
    mut rx: tokio::sync::mpsc::Receiver<vovp::Notification>,
    mut out: Vec<u8>,
) -> Result<(), TransportError> {
    while let Some(n) = rx.recv().await {
        let mut w = FrameWriter::begin(&mut out, op::NOTIFY, 0, 0);
        w.u8(n.kind as u8)
            .str(n.name.as_str())
            .u64(n.size)
            .bytes(&n.metadata);
        w.finish();
        // Batch whatever else is already queued into the same write.
        while let Ok(n) = rx.try_recv() {
            let mut w = FrameWriter::begin(&mut out, op::NOTIFY, 0, 0);
            w.u8(n.kind as u8)
                .str(n.name.as_str())
                .u64(n.size)
                .bytes(&n.metadata);
            w.finish();
        }
        let (res, back) = flush(stream, out).await;
        out = back;
        res?;
    }
    Ok(())
}

/// The per-connection actor: turns this client's requests into messages to the engine's
/// actors, under the connection's own reference holder id. The object table keeps the
/// authoritative record of what each holder holds, so cleanup on disconnect is one message
/// (`ReleaseHolder`) whatever state the client left things in.
#[derive(Actor)]
pub struct ConnectionActor {
    holder: HolderId,
    engine: EngineHandle,
    shared: Arc<Shared>,
    greeted: bool,
}

/// A decoded request from the socket.
pub struct Incoming {
    pub request: Request,
    pub no_reply: bool,
}

/// The client went away.
pub struct Disconnect;

/// The segments whose fds a HELLO reply carries.
pub struct SegmentFds;

fn name(s: &str) -> Result<ObjectName, vovp::Error> {
    Ok(ObjectName::new(s)?)
}

impl ConnectionActor {
    async fn dispatch(
        &mut self,
        request: Request,
        no_reply: bool,
    ) -> Result<Response, vovp::Error> {
        let actors = self.engine.actors().clone();
        let holder = self.holder;
        if !self.greeted && !matches!(request, Request::Hello { .. }) {
            return Ok(Response::error(status::PROTOCOL_STATE, "send HELLO first"));
        }
        Ok(match request {
            Request::Hello { pid } => {
                if self.greeted {
                    return Ok(Response::error(
                        status::PROTOCOL_STATE,
                        "HELLO was already sent",
                    ));
                }
                self.greeted = true;
                tracing::debug!("client pid {pid} connected as holder {holder}");
                Response::Hello {
                    capacity: self.engine.config().capacity,
                    max_inline: MAX_INLINE,
                    segments: self
                        .engine
                        .segments()
                        .iter()
                        .map(|s| (s.id(), s.len()))
                        .collect(),
                }
            }
            Request::Create {
                name: n,
                size,
                flags,
                device,
                metadata,
            } => {
                let r = actors
                    .table
                    .ask(table::Create {
                        holder,
                        name: name(&n)?,
                        size,
                        metadata: metadata.into(),
                        options: CreateOptions {
                            ephemeral: flags & CREATE_EPHEMERAL != 0,
                            device: Some(device),
                        },
                    })
                    .await?;
                Response::Object(r)
            }
            Request::Seal { name: n } => {
                actors
                    .table
                    .ask(table::Seal {
                        holder,
                        name: name(&n)?,
                    })
                    .await?;
                Response::Empty
            }
            Request::Abort { name: n } => {
                actors
                    .table
                    .ask(table::Abort {
                        holder,
                        name: name(&n)?,
                    })
                    .await?;
                Response::Empty
            }
            Request::Put {
                name: n,
                flags,
                metadata,
                data,
            } => {
                if data.len() > MAX_INLINE as usize {
                    return Err(vovp::Error::TooLarge(format!(
                        "inline PUT of {} bytes; the limit is {MAX_INLINE}: use CREATE and SEAL",
                        data.len()
                    )));
                }
                let r = actors
                    .table
                    .ask(table::PutInline {
                        holder,
                        name: name(&n)?,
                        data,
                        metadata: metadata.into(),
                        ephemeral: flags & CREATE_EPHEMERAL != 0,
                        keep_reference: flags & PUT_KEEP_REFERENCE != 0,
                    })
                    .await?;
                Response::Object(r)
            }
            Request::Get { timeout_ms, names } => {
                let names = names
                    .iter()
                    .map(|n| name(n))
                    .collect::<Result<Vec<_>, _>>()?;
                let wait = match timeout_ms {
                    t if t < 0 => Some(Duration::MAX),
                    0 => None,
                    t => Some(Duration::from_millis(t as u64)),
                };
                let rx = actors
                    .table
                    .ask(table::Get {
                        holder,
                        names,
                        wait,
                    })
                    .await?;
                Response::Objects(rx.await.map_err(|_| vovp::Error::ShuttingDown)?)
            }
            Request::Release { ids } if no_reply => {
                // Unbounded mailbox: never blocks; errors of one-way releases are not reported.
                let _ = actors.table.tell(table::Release { holder, ids }).try_send();
                Response::NoReply
            }
            Request::Release { ids } => {
                match actors.table.ask(table::Release { holder, ids }).await? {
                    Some(e) => return Err(e.into()),
                    None => Response::Empty,
                }
            }
            Request::Contains { name: n } => Response::Bool(
                actors
                    .table
                    .ask(table::Contains { name: name(&n)? })
                    .await?,
            ),
            Request::Delete { name: n } => {
                actors.table.ask(table::Delete { name: name(&n)? }).await?;
                Response::Empty
            }
            Request::List => Response::List(actors.table.ask(table::List).await?),
            Request::Evict { bytes } => {
                Response::Count(AsyncStore::evict(&self.engine, bytes).await?)
            }
            Request::Stats => Response::Stats {
                stats: actors.table.ask(table::Stats).await?,
                connections: self.shared.connections.load(Ordering::Relaxed),
            },
            Request::Subscribe => Response::Subscribed(actors.table.ask(table::Subscribe).await?),
        })
    }
}

impl Message<Incoming> for ConnectionActor {
    type Reply = Response;

    async fn handle(&mut self, m: Incoming, _: &mut Context<Self, Self::Reply>) -> Response {
        let no_reply = m.no_reply;
        match self.dispatch(m.request, no_reply).await {
            Ok(r) => r,
            Err(_) if no_reply => Response::NoReply,
            Err(e) => error_response(&e),
        }
    }
}

impl Message<Disconnect> for ConnectionActor {
    type Reply = ();

    async fn handle(&mut self, _: Disconnect, _: &mut Context<Self, Self::Reply>) {
        let _ = self
            .engine
            .actors()
            .table
            .tell(table::ReleaseHolder {
                holder: self.holder,
            })
            .await;
    }
}

impl Message<SegmentFds> for ConnectionActor {
    type Reply = Vec<Arc<vovp_actors::segment::Segment>>;

    async fn handle(&mut self, _: SegmentFds, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.engine.segments().to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_allowed_uids_pass() {
        assert!(check_uid(1000, &[1000]).is_ok());
        let err = check_uid(1001, &[1000, 0]).unwrap_err();
        assert!(
            err.contains("uid 1001") && err.contains("--allow-uid"),
            "{err}"
        );
    }
}
