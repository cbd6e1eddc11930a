//! The daemon's metrics: what is counted where, and how a scrape reads it.
//!
//! * **Counted as it happens** ([`ServerCounters`]): the connection layer's own numbers
//!   (requests and their latency per opcode, errors per status, socket bytes, connections).
//!   The hot path only bumps relaxed atomics found by index (the opcode byte, the status
//!   byte): no label is hashed and no lock taken per request.
//! * **Read at scrape time** ([`Snapshot`]): the store's numbers are asked of the engine
//!   (`Session::metrics`, one table message, answered on the daemon's thread like any STATS):
//!   STATS, resident bytes, what the store did (seals, gets by message and through the shared
//!   directory, deletes, replaces, lends, publishes) and every holder's references and bytes;
//!   the holders become the clients holding the most ([`clients`], by the pid each
//!   connection was accepted with). The counters above are loaded beside them; the result is
//!   a plain struct of values.
//! * **Encoded** ([`exposition`]): a prometheus-client `Collector` writes a snapshot as the
//!   Prometheus text format. It runs where the text is wanted: on the metrics thread for
//!   `GET /metrics` ([`http`]), on the daemon's thread for a METRICS request.
//!
//! Gets through the shared directory send no message: each client counts its own in its hold
//! table's header (two plain stores under the reader's lock, vovp-shm), and the store adds the
//! tables up at scrape time (`vovp_actors::shared_regions`), so they cost the get nothing the
//! daemon sees.
//!
//! Where more numbers plug in: a new source adds a field to [`Snapshot`] (filled where the
//! snapshot is collected, `server::snapshot`) and a section to the collector
//! (`exposition::SnapshotCollector::encode`).
//!
//! [`read`] is the other direction: samples back out of the text, for `vovp top` and tests.

pub mod clients;
pub mod counters;
pub mod exposition;
pub mod http;
pub mod read;

pub use clients::{top_clients, ClientUsage, TOP_CLIENTS};
pub use counters::{ServerCounters, ServerSnapshot, LATENCY_BUCKETS};
pub use exposition::{encode_text, CONTENT_TYPE};

/// Everything one scrape reports, as plain values.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// The engine's STATS (memory, objects, references, holders, evictions).
    pub store: vovp::StoreStats,
    /// The connection layer's counters.
    pub server: ServerSnapshot,
    /// What the store did, ever, and its gauges beyond STATS.
    pub table: TableSnapshot,
    /// The clients holding the most ([`top_clients`]), biggest first by bytes.
    pub clients: Vec<ClientUsage>,
}

/// The store's numbers beyond STATS (from `Session::metrics`).
#[derive(Debug, Clone, Default)]
pub struct TableSnapshot {
    pub resident_bytes: u64,
    pub live_lends: u64,
    pub activity: vovp::StoreActivity,
}
