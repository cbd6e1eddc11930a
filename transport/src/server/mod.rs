//! The daemon: a Unix-socket server on io_uring (tokio-uring) with one kameo actor per
//! connection. Everything runs on one thread: tokio-uring drives a current-thread tokio runtime,
//! and kameo spawns its actors with `tokio::spawn`, so the engine's actors, the connection
//! actors and the socket tasks share that runtime and no message crosses a thread. The one
//! exception is the `--metrics` endpoint, on a thread of its own ([`crate::metrics::http`]):
//! it asks this thread for a snapshot (`snapshot`) and nothing else.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener as StdUnixListener, UnixStream as StdUnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vovp_proto::{Opcode, Status};

use crate::metrics::counters::Refusal;
use crate::metrics::{top_clients, ServerCounters, Snapshot, TableSnapshot, TOP_CLIENTS};
use crate::response::{Response, TransportError};

mod actor;
mod connection;
mod notify;

pub use actor::{ConnectionActor, Disconnect, Incoming, SegmentFds};
use connection::serve_connection;

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
    /// Serve the Prometheus metrics at `http://ADDR/metrics` (`--metrics`; off when `None`).
    /// Port 0 binds a port the kernel picks, logged at start (the `metrics_addr` field).
    pub metrics: Option<SocketAddr>,
    /// Transfers between engines: the port (`--transfer`) and the cluster's key.
    pub transfer: crate::TransferConfig,
}

impl ServerConfig {
    pub fn new(socket: impl Into<PathBuf>, engine: vovp::Config) -> Self {
        ServerConfig {
            socket: socket.into(),
            engine,
            socket_mode: 0o600,
            allowed_uids: vec![rustix::process::getuid().as_raw()],
            limits: ConnectionLimits::default(),
            metrics: None,
            transfer: crate::TransferConfig::default(),
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
    /// Connections kept after their client shut down its sending side (STATS `half_closed`).
    half_closed: AtomicU64,
    /// Requests, errors, bytes and connections, for the metrics.
    counters: ServerCounters,
    /// Each connection's holder and the pid its client was accepted with (SO_PEERCRED), for
    /// the metrics' clients holding the most. Touched once per connect, disconnect and scrape.
    pids: Mutex<HashMap<vovp::HolderId, i32>>,
    /// Transfers between engines (FETCH, GATHER, the transfer port); `None` without a key.
    transfer: Option<Arc<crate::transfer::TransferService>>,
}

impl Shared {
    fn pids(&self) -> std::sync::MutexGuard<'_, HashMap<vovp::HolderId, i32>> {
        // Plain inserts and removes: a panic elsewhere cannot leave the map half-changed.
        self.pids
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// What a scrape reports, collected on the daemon's thread: the store's numbers through
/// `session` (one table message) and the connection layer's counters.
async fn snapshot(session: &vovp::Session, shared: &Shared) -> Result<Snapshot, vovp::Error> {
    let half_closed = shared.half_closed.load(Ordering::Relaxed);
    let m = session.metrics().await?;
    let clients = {
        let pids = shared.pids();
        top_clients(&m.holders, |h| pids.get(&h).copied(), TOP_CLIENTS)
    };
    Ok(Snapshot {
        store: vovp::StoreStats {
            half_closed,
            ..m.stats
        },
        server: shared
            .counters
            .snapshot(shared.connections.load(Ordering::Relaxed), half_closed),
        table: TableSnapshot {
            resident_bytes: m.resident_bytes,
            live_lends: m.live_lends,
            activity: m.activity,
        },
        clients,
    })
}

/// Serves the metrics endpoint at `addr`: its thread, and the task on this thread that answers
/// its snapshot requests (with a session of its own, which holds nothing).
fn start_metrics(
    addr: SocketAddr,
    engine: &vovp::EngineHandle,
    shared: &Arc<Shared>,
) -> Result<SocketAddr, TransportError> {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<tokio::sync::oneshot::Sender<Snapshot>>(16);
    let bound = crate::metrics::http::start(addr, tx)
        .map_err(|e| TransportError::Setup(format!("--metrics {addr}: {e}")))?;
    let session = engine.client_session();
    let shared = shared.clone();
    tokio_uring::spawn(async move {
        while let Some(reply) = rx.recv().await {
            match snapshot(&session, &shared).await {
                Ok(s) => {
                    let _ = reply.send(s);
                }
                // The store is stopping: the scrape gets no snapshot (503).
                Err(e) => tracing::debug!("metrics snapshot: {e}"),
            }
        }
    });
    Ok(bound)
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
    // Before the socket: a port that cannot be bound stops the start before the socket file
    // exists.
    let transfer = crate::transfer::TransferService::start(
        &config.transfer,
        &engine,
        config.limits.write_timeout,
        config.limits.handshake_timeout,
    )?;
    if let Some(transfer_addr) = transfer.as_ref().and_then(|t| t.address()) {
        // Machine-readable (the `transfer_addr` field): how a port 0 is found.
        tracing::info!(%transfer_addr, "serving transfers at {transfer_addr}");
    }
    let shared = Arc::new(Shared {
        transfer: transfer.map(Arc::new),
        ..Shared::default()
    });
    // Before the socket: a client that can connect can scrape, and a port that cannot be
    // bound stops the start before the socket file exists.
    if let Some(addr) = config.metrics {
        let metrics_addr = start_metrics(addr, &engine, &shared)?;
        // Machine-readable (the `metrics_addr` field): how a port 0 is found.
        tracing::info!(%metrics_addr, "serving metrics at http://{metrics_addr}/metrics");
    }
    let listener = bind_socket(&config.socket, config.socket_mode)?;
    *bound = true;
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
                // The peer's pid, for every log line about this client (0 if unknown).
                let pid = stream.peer_cred().ok().and_then(|c| c.pid()).unwrap_or(0);
                let stream = match stream.into_std() {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(pid, "a client's socket is unusable: {e}");
                        continue;
                    }
                };
                match peer_allowed(&stream, &allowed) {
                    Ok(()) => {}
                    Err(why) => {
                        shared.counters.refused(Refusal::Uid);
                        tracing::warn!(pid, "refused a connection: {why}");
                        continue;
                    }
                }
                if shared.connections.load(Ordering::Relaxed) as usize >= max_connections {
                    shared.counters.refused(Refusal::Limit);
                    refuse_busy(stream, max_connections, pid);
                    continue;
                }
                let engine = engine.clone();
                let shared = shared.clone();
                let limits = limits.clone();
                shared.connections.fetch_add(1, Ordering::Relaxed);
                shared.counters.opened();
                tokio_uring::spawn(async move {
                    if let Err(e) = serve_connection(stream, pid, engine, shared.clone(), &limits).await {
                        tracing::debug!(pid, "connection ended: {e}");
                    }
                    shared.connections.fetch_sub(1, Ordering::Relaxed);
                    shared.counters.closed();
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
fn refuse_busy(stream: StdUnixStream, max: usize, pid: i32) {
    use std::io::Write;
    let mut frame = Vec::new();
    Response::error(
        Status::TooManyConnections,
        format!("the store serves at most {max} connections at once; try again later"),
    )
    .encode(Opcode::Hello.code(), 0, &mut frame);
    let _ = stream.set_nonblocking(true);
    let _ = (&stream).write(&frame);
    tracing::warn!(pid, "refused a connection: {max} connections already");
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

/// SO_PEERCRED: only allowed uids may talk to the store. (The caller logs the peer's pid.)
fn peer_allowed(stream: &StdUnixStream, allowed: &[u32]) -> Result<(), String> {
    let cred = rustix::net::sockopt::socket_peercred(stream).map_err(|e| e.to_string())?;
    check_uid(cred.uid.as_raw(), allowed)
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
