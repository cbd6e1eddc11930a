//! The daemon: a Unix-socket server on io_uring (tokio-uring) with one kameo actor per
//! connection. Everything runs on one thread: tokio-uring drives a current-thread tokio runtime,
//! and kameo spawns its actors with `tokio::spawn`, so the engine's actors, the connection
//! actors and the socket tasks share that runtime and no message crosses a thread.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener as StdUnixListener, UnixStream as StdUnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kameo::actor::Spawn;
use kameo::message::{Context, Message};
use kameo::Actor;
use vovp::{CreateOptions, EngineHandle, ObjectId, PutOptions, Session};

use vovp_proto::{
    encode_notification, Header, Opcode, Reply, Request, Status, CREATE_EPHEMERAL, FLAG_NO_REPLY,
    HEADER_LEN, LIST_END, LIST_PAGE_BYTES, MAX_INLINE, PUT_KEEP_REFERENCE, PUT_PIPELINED,
};

use crate::response::{error_response, Response, TransportError};

/// How the daemon is set up.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub socket: PathBuf,
    pub engine: vovp::Config,
    /// Mode of the socket file (default 0600: only the owner may connect).
    pub socket_mode: u32,
    /// Peer uids allowed to connect (checked with SO_PEERCRED).
    pub allowed_uids: Vec<u32>,
    pub limits: ConnectionLimits,
}

impl ServerConfig {
    pub fn new(socket: impl Into<PathBuf>, engine: vovp::Config) -> Self {
        ServerConfig {
            socket: socket.into(),
            engine,
            socket_mode: 0o600,
            allowed_uids: vec![rustix::process::getuid().as_raw()],
            limits: ConnectionLimits::default(),
        }
    }
}

/// What one connection may cost the daemon, so that a few bad or stuck clients can neither
/// starve the others nor grow the daemon without bound (PROTOCOL.md, "Limits"). There is no
/// idle timeout for a greeted client: holding objects for hours without a word is legitimate.
#[derive(Debug, Clone)]
pub struct ConnectionLimits {
    /// A client must send HELLO within this long after connecting.
    pub handshake_timeout: Duration,
    /// A frame, once its first byte arrived, must arrive whole within this long.
    pub frame_timeout: Duration,
    /// Replies the peer leaves unread this long (its socket buffer full) end the connection.
    pub write_timeout: Duration,
    /// Connections served at once; `None`: derived from the fd limit at start. Beyond it a new
    /// connection gets a TOO_MANY_CONNECTIONS reply and is closed.
    pub max_connections: Option<usize>,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            handshake_timeout: Duration::from_secs(10),
            frame_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(30),
            max_connections: None,
        }
    }
}

/// fds kept back from connections (segments, the listener, logs, CUDA, dup'd sockets).
const FD_RESERVE: u64 = 64;
/// Each connection costs two fds: its socket and its hold table (memfd, kept so a second
/// SHARED gets the same table).
const FDS_PER_CONNECTION: u64 = 2;
const MAX_CONNECTIONS_CAP: u64 = 16 * 1024;

/// Raises the soft fd limit to the hard one (many clients are normal for a store) and returns
/// how many connections fit in it.
fn raise_fd_limit() -> usize {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let limit = getrlimit(Resource::Nofile);
    let mut soft = limit.current.unwrap_or(u64::MAX);
    if limit.current != limit.maximum {
        let raised = Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        };
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => soft = limit.maximum.unwrap_or(u64::MAX),
            Err(e) => tracing::warn!("cannot raise the open-file limit: {e}"),
        }
    }
    (soft.saturating_sub(FD_RESERVE) / FDS_PER_CONNECTION).clamp(1, MAX_CONNECTIONS_CAP) as usize
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
    let fd_room = raise_fd_limit();
    let max_connections = config.limits.max_connections.unwrap_or(fd_room);
    tracing::info!("serving at most {max_connections} connections at once");
    let limits = Arc::new(config.limits.clone());
    let mut accept_errors = AcceptBackoff::default();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((s, _)) => { accept_errors.reset(); s }
                    Err(e) => {
                        // EMFILE and friends: the connection stays in the backlog; back off
                        // (up to 1 s) instead of spinning, log rarely, and keep serving the
                        // connected clients. Accepting resumes by itself once fds free up.
                        tokio::time::sleep(accept_errors.failed(&e)).await;
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
                if shared.connections.load(Ordering::Relaxed) as usize >= max_connections {
                    refuse_busy(stream, max_connections);
                    continue;
                }
                let engine = engine.clone();
                let shared = shared.clone();
                let limits = limits.clone();
                shared.connections.fetch_add(1, Ordering::Relaxed);
                tokio_uring::spawn(async move {
                    if let Err(e) = serve_connection(stream, engine, shared.clone(), &limits).await {
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

/// Backoff and rate-limited logging for a failing `accept`.
#[derive(Default)]
struct AcceptBackoff {
    failures: u32,
    last_log: Option<std::time::Instant>,
    unlogged: u64,
}

impl AcceptBackoff {
    fn failed(&mut self, e: &std::io::Error) -> Duration {
        self.failures = self.failures.saturating_add(1);
        self.unlogged += 1;
        if self
            .last_log
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(10))
        {
            tracing::warn!(
                "accept failed {} times: {e} (retrying with backoff; connected clients are \
                 still served)",
                self.unlogged
            );
            self.last_log = Some(std::time::Instant::now());
            self.unlogged = 0;
        }
        Duration::from_millis(10u64 << self.failures.min(7)).min(Duration::from_secs(1))
    }

    fn reset(&mut self) {
        if self.failures > 0 {
            tracing::info!("accepting connections again");
        }
        self.failures = 0;
    }
}

/// Tells a connection over the limit why it is closed (one small reply into an empty socket
/// buffer: never blocks) and closes it.
fn refuse_busy(stream: StdUnixStream, max: usize) {
    use std::io::Write;
    let mut frame = Vec::new();
    Response::error(
        Status::TooManyConnections,
        format!("the store serves at most {max} connections at once; try again later"),
    )
    .encode(Opcode::Hello.code(), 0, &mut frame);
    let _ = stream.set_nonblocking(true);
    let _ = (&stream).write(&frame);
    tracing::warn!("refused a connection: {max} connections already");
    // Closing with the client's HELLO unread would reset the connection and lose the reply
    // above: read what it sends (for up to a second) before closing.
    if let Ok(stream) = tokio::net::UnixStream::from_std(stream) {
        tokio::spawn(async move {
            use tokio::io::AsyncReadExt;
            let mut stream = stream;
            let mut sink = [0u8; 256];
            let _ = tokio::time::timeout(Duration::from_secs(1), async {
                while let Ok(n) = stream.read(&mut sink).await {
                    if n == 0 {
                        break;
                    }
                }
            })
            .await;
        });
    }
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

/// Input buffers above this size are given back once the big frame that grew them is done, so
/// idle connections that once sent a large frame do not pin it.
const KEPT_BUFFER: usize = 2 * READ_CHUNK;

async fn serve_connection(
    stream: StdUnixStream,
    engine: EngineHandle,
    shared: Arc<Shared>,
    limits: &ConnectionLimits,
) -> Result<(), TransportError> {
    // Non-blocking: io_uring does not care, and the raw sendmsg of HELLO's fds must never
    // block the event loop (it waits for writability there instead).
    stream.set_nonblocking(true)?;
    // A client of the daemon's own uid (`--allow-uid` lets others in).
    let own_uid = rustix::net::sockopt::socket_peercred(&stream)
        .is_ok_and(|c| c.uid == rustix::process::getuid());
    let stream = tokio_uring::net::UnixStream::from_std(stream);
    // The connection's holder: every reference it takes is recorded under it.
    let session = engine.client_session();
    let conn = ConnectionActor::spawn(ConnectionActor {
        session: session.clone(),
        shared,
        greeted: false,
        own_uid,
    });
    let io = ConnIo {
        stream: &stream,
        limits,
        peer_closed: std::cell::Cell::new(false),
    };
    let result = connection_loop(&io, &conn, &session).await;
    // Whatever the reason the connection ended, everything it held goes back.
    let _ = conn.ask(Disconnect).await;
    let _ = conn.stop_gracefully().await;
    result
}

/// The socket of one connection and its limits.
struct ConnIo<'a> {
    stream: &'a tokio_uring::net::UnixStream,
    limits: &'a ConnectionLimits,
    /// The peer closed its socket while requests of it were still to be read: they are still
    /// carried out (a put sent without waiting must not be lost because its client exited
    /// right after), their replies dropped.
    peer_closed: std::cell::Cell<bool>,
}

impl ConnIo<'_> {
    /// The socket as a plain fd, for what io_uring's stream lacks (SCM_RIGHTS, polls).
    /// Borrowed, not dup'd: a connection costs one fd, so more connections fit the fd limit.
    fn raw(&self) -> BorrowedFd<'_> {
        // SAFETY: the stream owns this fd and outlives the borrow.
        unsafe { BorrowedFd::borrow_raw(self.stream.as_raw_fd()) }
    }

    /// Writes `out` whole within the write timeout; gives the buffer back cleared.
    async fn flush(&self, mut out: Vec<u8>) -> (Result<(), TransportError>, Vec<u8>) {
        if out.is_empty() || self.peer_closed.get() {
            out.clear();
            return (Ok(()), out);
        }
        match tokio::time::timeout(self.limits.write_timeout, self.stream.write_all(out)).await {
            Ok((res, mut back)) => {
                back.clear();
                // Closed, not merely shut for reading (which keeps the write timeout's
                // backpressure): carry on without replies.
                let gone = res.as_ref().err().and_then(std::io::Error::raw_os_error);
                if matches!(gone, Some(libc::EPIPE | libc::ECONNRESET)) && peer_hung_up(self.raw())
                {
                    self.peer_closed.set(true);
                    return (Ok(()), back);
                }
                (res.map_err(TransportError::from), back)
            }
            Err(_) => (Err(self.stalled()), Vec::new()),
        }
    }

    fn stalled(&self) -> TransportError {
        TransportError::Setup(format!(
            "the client left its replies unread for {:?}; disconnected",
            self.limits.write_timeout
        ))
    }

    /// Best effort: an error reply before closing (never waits long for a peer that does not
    /// read).
    async fn last_words(&self, status: Status, message: String) {
        let mut out = Vec::new();
        Response::error(status, message).encode(0, 0, &mut out);
        let _ = tokio::time::timeout(Duration::from_secs(1), self.stream.write_all(out)).await;
    }
}

async fn connection_loop(
    io: &ConnIo<'_>,
    conn: &kameo::actor::ActorRef<ConnectionActor>,
    session: &Session,
) -> Result<(), TransportError> {
    let stream = io.stream;
    let connected = tokio::time::Instant::now();
    let mut greeted = false;
    // When the first byte of the frame now incomplete in `inbuf` arrived.
    let mut partial_since: Option<tokio::time::Instant> = None;
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
                    let _ = io.flush(out).await;
                    io.last_words(e.status(), e.to_string()).await;
                    return Err(e.into());
                }
            };
            if inbuf.len() - consumed < header.frame_len() {
                break;
            }
            let payload = &inbuf[consumed + HEADER_LEN..consumed + header.frame_len()];
            consumed += header.frame_len();
            let no_reply = header.flags & FLAG_NO_REPLY != 0;
            let response = match Request::decode(header.opcode, payload).map(Request::into_owned) {
                // A silenced error is a lost error: NO_REPLY is for RELEASE only, and refused
                // (with a reply) anywhere else.
                Ok(ref request) if no_reply && !matches!(request, Request::Release { .. }) => {
                    Response::error(
                        Status::Malformed,
                        "the NO_REPLY flag is only allowed on RELEASE",
                    )
                }
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
                Ok(request) => answer(conn, Incoming { request, no_reply }, io, session).await,
                Err(e) => Response::error(e.status(), e.to_string()),
            };
            match response {
                Response::Reply(Reply::Hello { .. }) => {
                    let (res, back) = io.flush(out).await;
                    out = back;
                    res?;
                    let mut reply = Vec::new();
                    response.encode(header.opcode, header.request_id, &mut reply);
                    send_hello(io, conn, reply).await?;
                    greeted = true;
                }
                Response::Segment { .. } => {
                    let (res, back) = io.flush(out).await;
                    out = back;
                    res?;
                    let fd_of = |r: &Response| match r {
                        Response::Segment { segment, writable } => {
                            Some(segment.clone()).map(|s| (s, *writable))
                        }
                        _ => None,
                    };
                    let (segment, writable) = fd_of(&response).expect("a segment reply");
                    let mut reply = Vec::new();
                    response.encode(header.opcode, header.request_id, &mut reply);
                    let fd = if writable {
                        segment.fd()
                    } else {
                        segment.read_only_fd()
                    };
                    send_with_fd(io, reply, &[fd]).await?;
                }
                Response::Shared(ref fds) => {
                    let (res, back) = io.flush(out).await;
                    out = back;
                    res?;
                    let mut reply = Vec::new();
                    response.encode(header.opcode, header.request_id, &mut reply);
                    match fds {
                        Some(f) => {
                            send_with_fd(io, reply, &[f.directory.as_fd(), f.holds.as_fd()]).await?
                        }
                        None => send_with_fd(io, reply, &[]).await?,
                    }
                }
                Response::Subscribed(rx) => {
                    response_empty(header, &mut out);
                    let (res, back) = io.flush(out).await;
                    res?;
                    return notify_loop(io, rx, back).await;
                }
                other => other.encode(header.opcode, header.request_id, &mut out),
            }
        }
        inbuf.drain(..consumed);
        if inbuf.capacity() > KEPT_BUFFER && inbuf.len() < READ_CHUNK {
            inbuf.shrink_to(READ_CHUNK);
        }
        if out.capacity() > KEPT_BUFFER {
            out.shrink_to(4096);
        }
        partial_since = match (inbuf.is_empty(), consumed > 0) {
            (true, _) => None,
            // What is left is the start of a new frame.
            (false, true) => Some(tokio::time::Instant::now()),
            (false, false) => partial_since.or_else(|| Some(tokio::time::Instant::now())),
        };
        let deadline = [
            (!greeted).then(|| (connected + io.limits.handshake_timeout, Deadline::Handshake)),
            partial_since.map(|t| (t + io.limits.frame_timeout, Deadline::Frame)),
        ]
        .into_iter()
        .flatten()
        .min_by_key(|d| d.0);
        rbuf.clear();
        // The replies and the next read go to the kernel together (one io_uring_enter):
        // waiting for the write before submitting the read costs a context switch per request.
        let read = async {
            match deadline {
                None => Ok(stream.read(rbuf).await),
                Some((at, why)) => tokio::time::timeout_at(at, stream.read(rbuf))
                    .await
                    .map_err(|_| LoopStop::Deadline(why)),
            }
        };
        let write = async {
            let (res, back) = io.flush(out).await;
            res.map(|()| back).map_err(LoopStop::Write)
        };
        // A write that fails or stalls ends the connection even while the read still waits
        // (try_join drops the read), and a read deadline ends it even while the write waits.
        let (back, (res, back_r)) = match tokio::try_join!(write, read) {
            Ok(both) => both,
            Err(LoopStop::Write(e)) => return Err(e),
            Err(LoopStop::Deadline(why)) => {
                let message = why.message(io.limits);
                io.last_words(Status::ProtocolState, message.clone()).await;
                return Err(TransportError::Setup(message));
            }
        };
        out = back;
        let back = back_r;
        rbuf = back;
        match res {
            // The peer shut down its sending side. Only a closed connection is a dead peer: a
            // half-closed one may still read replies and still holds its references.
            Ok(0) => return wait_for_hangup(io.raw()).await,
            Ok(_) => inbuf.extend_from_slice(&rbuf),
            Err(e) => return Err(e.into()),
        }
    }
}

/// Why one turn of the connection loop ends the connection.
enum LoopStop {
    Write(TransportError),
    Deadline(Deadline),
}

/// Which read deadline fired.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Deadline {
    Handshake,
    Frame,
}

impl Deadline {
    fn message(self, limits: &ConnectionLimits) -> String {
        match self {
            Deadline::Handshake => format!(
                "no HELLO within {:?} of connecting; closing",
                limits.handshake_timeout
            ),
            Deadline::Frame => format!(
                "a frame stayed incomplete for {:?}; closing",
                limits.frame_timeout
            ),
        }
    }
}

/// How often a long request (a GET waiting for a seal) checks that its client is still there.
const LIVENESS_CHECK: Duration = Duration::from_millis(100);

/// Asks the connection actor and waits for its response. While a request waits (a GET with a
/// timeout), the loop does not read the socket, so it would not notice the client dying: every
/// `LIVENESS_CHECK` it looks at the socket, and once the peer has closed it releases everything
/// the session held at once (which also cancels the waiting GET) instead of when the wait ends.
async fn answer(
    conn: &kameo::actor::ActorRef<ConnectionActor>,
    incoming: Incoming,
    io: &ConnIo<'_>,
    session: &Session,
) -> Response {
    let stopping = |_| Response::error(Status::ShuttingDown, "store stopping");
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
                if peer_hung_up(io.raw()) {
                    released = true;
                    session.release_all();
                }
            }
        }
    }
}

/// True when the peer has closed the connection: both directions (POLLHUP) or with an error.
/// A peer that only shut down its writing side (`shutdown(SHUT_WR)`: POLLRDHUP without
/// POLLHUP) is alive and still reads its replies.
fn peer_hung_up(raw: BorrowedFd<'_>) -> bool {
    use rustix::event::{poll, PollFd, PollFlags};
    let mut fds = [PollFd::new(&raw, PollFlags::empty())];
    match poll(&mut fds, Some(&rustix::event::Timespec::default())) {
        Ok(_) => fds[0]
            .revents()
            .intersects(PollFlags::HUP | PollFlags::ERR | PollFlags::NVAL),
        Err(rustix::io::Errno::INTR) => false,
        Err(_) => true,
    }
}

/// After the peer shut down its writing side: keep its references until it closes the
/// connection entirely (it may still be using the objects it got).
async fn wait_for_hangup(raw: BorrowedFd<'_>) -> Result<(), TransportError> {
    while !peer_hung_up(raw) {
        tokio::time::sleep(LIVENESS_CHECK).await;
    }
    Ok(())
}

fn response_empty(header: Header, out: &mut Vec<u8>) {
    Reply::Empty.encode(header.opcode, header.request_id, out);
}

/// PUT's and PUBLISH's flags.
fn put_options(flags: u32) -> PutOptions {
    PutOptions {
        ephemeral: flags & CREATE_EPHEMERAL != 0,
        keep_reference: flags & PUT_KEEP_REFERENCE != 0,
        pipelined: flags & PUT_PIPELINED != 0,
    }
}

/// Sends HELLO's reply with segment 0's fd attached: every client may read the store's own
/// segment; none may write it (the store copies inline puts in itself) unless the store has
/// no client arenas (`--prefault`), where every object lives there and its creator writes it
/// (read-write for clients of the daemon's own uid, as Plasma's store was; see `SegmentFds`).
/// The client tells by the fd's access mode.
async fn send_hello(
    io: &ConnIo<'_>,
    conn: &kameo::actor::ActorRef<ConnectionActor>,
    reply: Vec<u8>,
) -> Result<(), TransportError> {
    let (segments, writable) = conn
        .ask(SegmentFds)
        .await
        .map_err(|_| TransportError::Setup("store stopping".into()))?;
    let fds: Vec<_> = segments
        .iter()
        .map(|s| if writable { s.fd() } else { s.read_only_fd() })
        .collect();
    send_with_fd(io, reply, &fds).await
}

/// Sends a reply with fds attached (SCM_RIGHTS through a raw `sendmsg`, which tokio-uring
/// lacks). The socket is non-blocking: while its buffer is full (a client that pipelined
/// requests and reads nothing), this waits for writability on the event loop, up to the write
/// timeout, instead of blocking the daemon's one thread.
async fn send_with_fd(
    io: &ConnIo<'_>,
    reply: Vec<u8>,
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> Result<(), TransportError> {
    let sent = match vovp_shm::fdpass::send_with_fds(io.raw(), &reply, fds) {
        Ok(n) => n,
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
            // SAFETY: the AsyncFd owns its own dup of the socket, open for its whole life.
            let waiter = unsafe {
                tokio::io::unix::AsyncFd::register_with_interest(
                    io.raw().try_clone_to_owned()?,
                    tokio::io::Interest::WRITABLE,
                )
            }
            .map_err(|e| TransportError::Io(e.into()))?;
            let send = async {
                loop {
                    let mut ready = waiter.writable().await?;
                    match ready
                        .try_io(|fd| vovp_shm::fdpass::send_with_fds(fd.as_fd(), &reply, fds))
                    {
                        Ok(res) => return res,
                        Err(_would_block) => continue,
                    }
                }
            };
            tokio::time::timeout(io.limits.write_timeout, send)
                .await
                .map_err(|_| io.stalled())??
        }
        Err(e) => return Err(e.into()),
    };
    if sent < reply.len() {
        let rest = reply[sent..].to_vec();
        let (res, _) = io.flush(rest).await;
        res?;
    }
    Ok(())
}

/// Streams notifications to a subscriber until it closes its connection. The socket is read
/// meanwhile (subscribers send nothing; any bytes are ignored) so that a closed subscriber is
/// noticed at once, not at the next notification.
async fn notify_loop(
    io: &ConnIo<'_>,
    mut rx: tokio::sync::mpsc::Receiver<vovp::Notification>,
    mut out: Vec<u8>,
) -> Result<(), TransportError> {
    let encode = |out: &mut Vec<u8>, n: vovp::Notification| encode_notification(&n, out);
    let watch = |buf: Vec<u8>| io.stream.read(buf);
    let mut closed = Box::pin(watch(Vec::with_capacity(64)));
    loop {
        tokio::select! {
            n = rx.recv() => {
                let Some(n) = n else { return Ok(()) };
                if rx.is_closed() {
                    // The table dropped this subscriber for falling 4096 notifications behind:
                    // end the stream now rather than after the backlog, so the client learns
                    // at once that it missed some.
                    tracing::debug!("subscriber dropped as too slow; closing its stream");
                    return Ok(());
                }
                encode(&mut out, n);
                // Batch whatever else is already queued into the same write.
                while let Ok(n) = rx.try_recv() {
                    encode(&mut out, n);
                }
                let (res, back) = io.flush(out).await;
                out = back;
                if let Err(e) = res {
                    tracing::debug!("subscriber write failed: {e}");
                    return Err(e);
                }
            }
            (res, buf) = &mut closed => match res {
                Ok(0) | Err(_) => {
                    tracing::debug!("subscriber closed its connection ({res:?})");
                    return Ok(());
                }
                Ok(_) => closed = Box::pin(watch(buf)),
            },
        }
    }
}

/// The per-connection actor: turns this client's requests into calls on the connection's
/// engine [`Session`] (its own reference holder) and tracks the HELLO state. The engine keeps
/// the authoritative record of what each holder holds, so cleanup on disconnect is one call
/// (`Session::release_all`) whatever state the client left things in.
#[derive(Actor)]
pub struct ConnectionActor {
    session: Session,
    shared: Arc<Shared>,
    greeted: bool,
    /// The peer runs as the daemon's uid.
    own_uid: bool,
}

impl std::fmt::Debug for ConnectionActor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectionActor")
            .field("session", &self.session)
            .field("greeted", &self.greeted)
            .field("own_uid", &self.own_uid)
            .finish_non_exhaustive()
    }
}

/// A decoded request from the socket.
#[derive(Debug)]
pub struct Incoming {
    pub request: Request<'static>,
    pub no_reply: bool,
}

/// The client went away.
#[derive(Debug)]
pub struct Disconnect;

/// The segments whose fds a HELLO reply carries.
#[derive(Debug)]
pub struct SegmentFds;

/// The ids of a RELEASE as the client sent them (the table checks each against its object).
fn object_ids(ids: &[u64]) -> Vec<ObjectId> {
    ids.iter().copied().map(ObjectId::from_raw).collect()
}

impl ConnectionActor {
    async fn dispatch(
        &mut self,
        request: Request<'static>,
        no_reply: bool,
    ) -> Result<Response, vovp::Error> {
        let session = &self.session;
        if !self.greeted && !matches!(request, Request::Hello { .. }) {
            return Ok(Response::error(Status::ProtocolState, "send HELLO first"));
        }
        Ok(match request {
            Request::Hello { pid } => {
                if self.greeted {
                    return Ok(Response::error(
                        Status::ProtocolState,
                        "HELLO was already sent",
                    ));
                }
                self.greeted = true;
                tracing::debug!("client pid {pid} connected as holder {}", session.holder());
                Reply::Hello {
                    capacity: session.config().capacity,
                    max_inline: MAX_INLINE,
                    // Only the store's own segment: arenas are mapped on demand (SEGMENT).
                    segments: session
                        .segments()
                        .iter()
                        .take(1)
                        .map(|s| (s.id(), s.len()))
                        .collect(),
                }
                .into()
            }
            Request::Create {
                name,
                size,
                flags,
                device,
                metadata,
            } => {
                let options = CreateOptions {
                    ephemeral: flags & CREATE_EPHEMERAL != 0,
                    device: Some(device),
                };
                Reply::Object(session.create(&name, size, &metadata, options).await?).into()
            }
            Request::Seal { name } => {
                session.seal(&name).await?;
                Reply::Empty.into()
            }
            Request::Abort { name } => {
                session.abort(&name).await?;
                Reply::Empty.into()
            }
            Request::Put {
                name,
                flags,
                metadata,
                data,
            } => {
                let options = put_options(flags);
                Reply::Object(
                    session
                        .put_inline(&name, data.into_owned(), &metadata, options)
                        .await?,
                )
                .into()
            }
            Request::Lend { at_least } => Reply::Lent(session.lend(at_least).await?).into(),
            Request::Publish {
                lend,
                offset,
                name,
                flags,
                metadata,
                size,
            } => {
                let options = put_options(flags);
                Reply::Object(
                    session
                        .publish(lend, offset, &name, size, &metadata, options)
                        .await?,
                )
                .into()
            }
            Request::Get { timeout_ms, names } => {
                let wait = match timeout_ms {
                    t if t < 0 => Some(Duration::MAX),
                    0 => None,
                    t => Some(Duration::from_millis(t as u64)),
                };
                Reply::Objects(session.get(&names, wait).await?).into()
            }
            Request::Release { ids } if no_reply => {
                // Errors of one-way releases are not reported.
                session.release_later(object_ids(&ids));
                Response::NoReply
            }
            Request::Release { ids } => {
                session.release(object_ids(&ids)).await?;
                Reply::Empty.into()
            }
            Request::Contains { name } => Reply::Bool(session.contains(&name).await?).into(),
            Request::Delete { name } => {
                session.delete(&name).await?;
                Reply::Empty.into()
            }
            Request::List { start, limit } => {
                let (entries, next) = session
                    .list_page(
                        start,
                        limit as usize,
                        LIST_PAGE_BYTES,
                        vovp_proto::list_entry_bytes,
                    )
                    .await?;
                Reply::List {
                    entries,
                    next: next.unwrap_or(LIST_END),
                }
                .into()
            }
            Request::Evict { bytes } => Reply::Count(session.evict(bytes).await?).into(),
            Request::Stats => Reply::Stats {
                stats: session.stats().await?,
                connections: self.shared.connections.load(Ordering::Relaxed),
            }
            .into(),
            Request::Subscribe => Response::Subscribed(session.subscribe().await?),
            Request::Shared => Response::Shared(session.attach_shared().await?),
            Request::Segment { id } => {
                let grant = session.segment(id).await?;
                Response::Segment {
                    segment: grant.segment,
                    writable: grant.writable,
                }
            }
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
        self.session.release_all();
    }
}

impl Message<SegmentFds> for ConnectionActor {
    /// Segment 0, and whether this client writes it: with no client arenas (`--prefault`)
    /// every object lives there and its creator writes it, as in Plasma's store; never a
    /// client of another uid (`--allow-uid`), which keeps read-only fds only.
    type Reply = (Vec<Arc<vovp::Segment>>, bool);

    async fn handle(&mut self, _: SegmentFds, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let config = self.session.config();
        let shared_writable = (config.prefault || !config.client_arenas) && self.own_uid;
        (
            self.session.segments().iter().take(1).cloned().collect(),
            shared_writable,
        )
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
