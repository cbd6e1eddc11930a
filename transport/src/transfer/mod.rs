//! Transfers between engines: the bytes of an object go from the store of the engine that
//! holds it (the *holder*) to the store of another engine (the *receiver*) over TCP, straight
//! from one store's memory into the other's, with no client process and no copy in between.
//! The cluster layer (Python, over Ray) only decides what moves where; it asks its local
//! engine for a FETCH (or a GATHER of rows) and gets the object back as from a GET.
//!
//! - **Where it runs.** A few transfer threads ([`pool`]), each a tokio-uring runtime, run every
//!   stream, sending and receiving alike; the daemon's own thread only answers the object-table
//!   messages of the streams' sessions (create, seal, take or drop a reference), so it stays
//!   responsive to socket clients during a transfer of any size. The port (`--transfer ADDR`,
//!   off by default; port 0 takes a free one, reported by TRANSFER_INFO and logged as
//!   `transfer_addr`) is accepted on a thread of its own ([`holder`]).
//! - **Tickets** (the wire is `vovp_proto::transfer`). The engines of a cluster share a 32-byte
//!   key, given to each at start (`--transfer-key-file`, a file of mode 0600 or stricter, or
//!   the `VOVP_TRANSFER_KEY` variable; 64 hex digits). The receiver mints a ticket per transfer
//!   (name, version, expiry ([`TransferConfig::ticket_life`], 30 s), a random 128-bit nonce,
//!   its stream count) and MACs it with the key; no control message is added: whoever can
//!   ask a receiver for a FETCH (its socket's users) is authorized the way the key is handed
//!   out, over the cluster's control path. The holder serves a stream only for a ticket whose
//!   MAC checks, unexpired, for an object it holds at exactly that version, and each (nonce,
//!   stream) once (remembered until the ticket expires): a replayed ticket, or one copied off
//!   the wire after its use, gets nothing. Refusals are counted by reason (TRANSFER_INFO).
//! - **Trust.** The bytes are neither encrypted nor authenticated on the wire, and the key
//!   only controls who may *read* objects through the port: run the transfer port on a private
//!   network, as Ray's own ports (ARCHITECTURE.md, "Security").
//! - **A fetch** ([`receiver`]): stream 0 learns the object (size, version, metadata); the
//!   receiver creates `name` as a replacement sealed as exactly that version (the holder's,
//!   which is the cluster's), receives the byte ranges over up to `streams` streams (one per
//!   16 MiB, 4 by default), each on its own transfer thread so that copies and page faults
//!   overlap across cores, copies the ranges a local base version already has (parallel
//!   memcpy), and seals only once every byte arrived; any failure (a refusal, the holder gone,
//!   a stream that stalls past the idle timeout, another object announced on a later stream)
//!   aborts it, so nothing half-written is ever visible. Concurrent FETCHes of one name and
//!   version on one engine share one transfer.
//! - **A stalled peer** costs only its stream: every read and write of a stream has a deadline
//!   (the daemon's `--write-timeout` between bytes), after which the socket is shut down.

mod holder;
mod io;
mod pool;
mod receiver;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use vovp::Error;
pub use vovp_proto::transfer::TransferKey;

use crate::response::TransportError;
use holder::Holder;
use pool::Pool;
pub(crate) use receiver::Received;
use receiver::{FetchJob, GatherJob, Receiver};
use vovp::transfer::DEFAULT_TIMEOUT;

/// The environment variable that may hold the transfer key (64 hex digits), when no key file
/// is given.
pub const KEY_VARIABLE: &str = "VOVP_TRANSFER_KEY";

/// How a daemon takes part in transfers.
#[derive(Debug, Clone)]
pub struct TransferConfig {
    /// Serve the transfer port at this address (`--transfer`); `None`: no port is opened.
    pub listen: Option<SocketAddr>,
    /// The cluster's key: needed to serve the port and to fetch. Without one, FETCH and GATHER
    /// are refused and no port may be opened.
    pub key: Option<TransferKey>,
    /// Transfer threads (`--transfer-threads`).
    pub threads: usize,
    /// Streams of a transfer when the request does not say.
    pub streams: u16,
    /// How long a minted ticket is valid.
    pub ticket_life: Duration,
}

impl Default for TransferConfig {
    fn default() -> Self {
        TransferConfig {
            listen: None,
            key: None,
            threads: 4,
            streams: 4,
            ticket_life: Duration::from_secs(30),
        }
    }
}

impl TransferConfig {
    /// The key in `path`: refused unless only its owner may read it (mode 0600 or 0400).
    pub fn key_from_file(path: &Path) -> Result<TransferKey, String> {
        use std::os::unix::fs::PermissionsExt;
        let at = |e: std::io::Error| format!("{}: {e}", path.display());
        let mode = std::fs::metadata(path).map_err(at)?.permissions().mode();
        if mode & 0o077 != 0 {
            return Err(format!(
                "{}: mode {:o} lets others read the transfer key; chmod 600 it",
                path.display(),
                mode & 0o777
            ));
        }
        let text = std::fs::read(path).map_err(at)?;
        TransferKey::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// The key in [`KEY_VARIABLE`], if it is set.
    pub fn key_from_env() -> Option<Result<TransferKey, String>> {
        let value = std::env::var_os(KEY_VARIABLE)?;
        Some(
            TransferKey::parse(value.as_encoded_bytes())
                .map_err(|e| format!("{KEY_VARIABLE}: {e}")),
        )
    }
}

macro_rules! counters {
    ($($var:ident = $name:literal,)*) => {
        /// What the transfer service counts (TRANSFER_INFO reports each by its name).
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub(crate) enum Counter {
            $($var,)*
        }

        impl Counter {
            const ALL: &'static [Counter] = &[$(Counter::$var,)*];

            pub(crate) fn name(self) -> &'static str {
                match self {
                    $(Counter::$var => $name,)*
                }
            }
        }
    };
}

counters! {
    StreamsServed = "streams_served",
    BytesServed = "bytes_served",
    StreamsDropped = "streams_dropped",
    RefusedBadMac = "refused_bad_mac",
    RefusedExpired = "refused_expired",
    RefusedReplayed = "refused_replayed",
    RefusedNotHeld = "refused_not_held",
    RefusedMalformed = "refused_malformed",
    Fetches = "fetches",
    FetchesShared = "fetches_shared",
    FetchesFailed = "fetches_failed",
    Gathers = "gathers",
    GathersFailed = "gathers_failed",
    BytesReceived = "bytes_received",
    BytesCopiedFromBase = "bytes_copied_from_base",
}

/// The counters, one atomic each.
#[derive(Debug)]
pub(crate) struct Counters(Vec<AtomicU64>);

impl Default for Counters {
    fn default() -> Self {
        Counters(Counter::ALL.iter().map(|_| AtomicU64::new(0)).collect())
    }
}

impl Counters {
    pub(crate) fn add(&self, c: Counter, n: u64) {
        self.0[c as usize].fetch_add(n, Ordering::Relaxed);
    }

    fn snapshot(&self) -> Vec<(String, u64)> {
        Counter::ALL
            .iter()
            .map(|&c| {
                (
                    c.name().to_owned(),
                    self.0[c as usize].load(Ordering::Relaxed),
                )
            })
            .collect()
    }
}

/// A transfer some FETCH started, which later FETCHes of the same name and version await.
type Outcome = watch::Receiver<Option<Result<Received, Error>>>;

/// A daemon's transfers: its port (if any), its receiving side, the transfers in flight.
#[derive(Debug)]
pub(crate) struct TransferService {
    receiver: Arc<Receiver>,
    address: Option<SocketAddr>,
    counters: Arc<Counters>,
    in_flight: Arc<Mutex<HashMap<(String, u64), Outcome>>>,
}

impl TransferService {
    /// Starts the transfer threads and, when asked, the port. `None` without a key (then no
    /// port may be asked for). `idle`: the daemon's write timeout, `handshake` its handshake
    /// timeout, applied to transfer streams alike.
    pub(crate) fn start(
        config: &TransferConfig,
        engine: &vovp::EngineHandle,
        idle: Duration,
        handshake: Duration,
    ) -> Result<Option<TransferService>, TransportError> {
        let Some(key) = config.key.clone() else {
            if let Some(addr) = config.listen {
                return Err(TransportError::Setup(format!(
                    "--transfer {addr} needs the cluster's key: --transfer-key-file PATH or \
                     {KEY_VARIABLE}"
                )));
            }
            return Ok(None);
        };
        let pool = Arc::new(
            Pool::start(config.threads)
                .map_err(|e| TransportError::Setup(format!("transfer threads: {e}")))?,
        );
        let counters = Arc::new(Counters::default());
        let address = match config.listen {
            None => None,
            Some(addr) => {
                let holder = Holder::new(
                    engine.clone(),
                    key.clone(),
                    counters.clone(),
                    idle,
                    handshake,
                );
                let bound = holder::listen(addr, Arc::new(holder), pool.clone())
                    .map_err(|e| TransportError::Setup(format!("--transfer {addr}: {e}")))?;
                Some(bound)
            }
        };
        tracing::debug!(threads = pool.threads(), "transfer threads started");
        let receiver = Receiver {
            engine: engine.clone(),
            key,
            pool,
            counters: counters.clone(),
            idle,
            ticket_life: config.ticket_life,
            default_streams: config.streams,
        };
        Ok(Some(TransferService {
            receiver: Arc::new(receiver),
            address,
            counters,
            in_flight: Arc::default(),
        }))
    }

    /// The port's address (`ip:port`), if one is served.
    pub(crate) fn address(&self) -> Option<SocketAddr> {
        self.address
    }

    pub(crate) fn counters(&self) -> Vec<(String, u64)> {
        self.counters.snapshot()
    }

    /// FETCH: `name` at `version` from `source` into this store (sealed as that version), or
    /// the transfer of it already under way here. The result holds the object until dropped.
    pub(crate) async fn fetch(&self, f: &vovp_proto::Fetch<'_>) -> Result<Received, Error> {
        if f.version == 0 {
            return Err(Error::Protocol(
                "FETCH of version 0 (versions count from 1)".into(),
            ));
        }
        let job = FetchJob {
            name: f.name.to_string(),
            version: f.version,
            source: source(&f.source)?,
            streams: f.streams,
            timeout: timeout(f.timeout_ms),
            base: f.base.as_ref().map(|b| (b.version, b.ranges.to_vec())),
        };
        let key = (job.name.clone(), job.version);
        let mut outcome = {
            let mut in_flight = self
                .in_flight
                .lock()
                .map_err(|_| Error::Internal("transfers: poisoned".into()))?;
            match in_flight.get(&key) {
                Some(started) => {
                    self.counters.add(Counter::FetchesShared, 1);
                    started.clone()
                }
                None => {
                    let (tx, rx) = watch::channel(None);
                    in_flight.insert(key.clone(), rx.clone());
                    self.counters.add(Counter::Fetches, 1);
                    let receiver = self.receiver.clone();
                    let done = self.receiver.pool.run(move || receiver.fetch(job));
                    let (in_flight, counters) = (self.in_flight.clone(), self.counters.clone());
                    // On the daemon's thread: whoever asked first may go away, the others
                    // still learn the outcome.
                    tokio::spawn(async move {
                        let outcome = done.await.unwrap_or_else(|_| {
                            Err(Error::Internal("a transfer thread stopped".into()))
                        });
                        if outcome.is_err() {
                            counters.add(Counter::FetchesFailed, 1);
                        }
                        if let Ok(mut in_flight) = in_flight.lock() {
                            in_flight.remove(&key);
                        }
                        let _ = tx.send(Some(outcome));
                    });
                    rx
                }
            }
        };
        let outcome = outcome
            .wait_for(Option::is_some)
            .await
            .map_err(|_| Error::Internal("a transfer ended without an outcome".into()))?;
        outcome
            .clone()
            .unwrap_or_else(|| Err(Error::Internal("no outcome".into())))
    }

    /// GATHER: rows of `name` at `version` on `source` into a new ephemeral object.
    pub(crate) async fn gather(&self, g: &vovp_proto::Gather<'_>) -> Result<Received, Error> {
        let job = GatherJob {
            name: g.name.to_string(),
            version: g.version,
            source: source(&g.source)?,
            row_bytes: g.row_bytes,
            ids: g.ids.to_vec(),
            into: g.into.to_string(),
            timeout: timeout(g.timeout_ms),
        };
        self.counters.add(Counter::Gathers, 1);
        let receiver = self.receiver.clone();
        let outcome = self
            .receiver
            .pool
            .run(move || receiver.gather(job))
            .await
            .unwrap_or_else(|_| Err(Error::Internal("a transfer thread stopped".into())));
        if outcome.is_err() {
            self.counters.add(Counter::GathersFailed, 1);
        }
        outcome
    }
}

/// A source address as the wire gives it: `ip:port` (no name lookup on the daemon's thread).
fn source(s: &str) -> Result<SocketAddr, Error> {
    s.parse()
        .map_err(|_| Error::Protocol(format!("transfer source {s:?} is not ip:port")))
}

fn timeout(ms: i64) -> Duration {
    match u64::try_from(ms) {
        Ok(ms) if ms > 0 => Duration::from_millis(ms),
        _ => DEFAULT_TIMEOUT,
    }
}
