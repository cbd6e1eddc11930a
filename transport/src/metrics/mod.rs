//! The daemon's metrics: what is counted where, and how a scrape reads it.
//!
//! * **Counted as it happens** ([`ServerCounters`]): the connection layer's own numbers
//!   (requests and their latency per opcode, errors per status, socket bytes, connections).
//!   The hot path only bumps relaxed atomics found by index (the opcode byte, the status
//!   byte): no label is hashed and no lock taken per request.
//! * **Read at scrape time** ([`Snapshot`]): the store's numbers are asked of the engine
//!   (`Session::stats`, one table message, answered on the daemon's thread like any STATS),
//!   the counters above are loaded, and the result is a plain struct of values.
//! * **Encoded** ([`exposition`]): a prometheus-client `Collector` writes a snapshot as the
//!   Prometheus text format. It runs where the text is wanted: on the metrics thread for
//!   `GET /metrics` ([`http`]), on the daemon's thread for a METRICS request.
//!
//! Where more numbers plug in: a new source adds a field to [`Snapshot`] (filled where the
//! snapshot is collected, `server::snapshot`) and a section to the collector
//! (`exposition::SnapshotCollector::encode`). The table's own counters (seals, gets by path,
//! deletes, replaces, lends, the shared-directory gets summed over hold tables, the clients
//! holding the most) are such a field, still to come.
//!
//! [`read`] is the other direction: samples back out of the text, for `vovp top` and tests.

pub mod counters;
pub mod exposition;
pub mod http;
pub mod read;

pub use counters::{ServerCounters, ServerSnapshot, LATENCY_BUCKETS};
pub use exposition::{encode_text, CONTENT_TYPE};

/// Everything one scrape reports, as plain values.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// The engine's STATS (memory, objects, references, holders, evictions).
    pub store: vovp::StoreStats,
    /// The connection layer's counters.
    pub server: ServerSnapshot,
}
