//! The connection layer's counters, bumped on the daemon's hot path and read at scrape time.
//!
//! Cheap by construction: every counter is an `AtomicU64` updated with `Relaxed` adds and
//! found by index, never by label: a request's latency histogram is `requests[opcode byte]`,
//! an error's counter `errors[status byte]`. The daemon serves every connection on one thread,
//! so the adds are never contended; a scrape on the metrics thread only loads them. A request
//! costs two clock reads (vDSO, no syscall) and two adds (its bucket and the sum; a third for
//! an error reply), a socket read or write one add for its bytes.
//!
//! Latency is the daemon's: from the request's frame read whole to its reply ready to write
//! (a GET that waits for a seal counts its wait), not the client's round trip.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use vovp_proto::{Opcode, Status};

/// Upper bounds of the latency buckets in seconds (Prometheus' `le`), 1 µs to 10 s; a last,
/// unbounded bucket (`+Inf`) follows.
pub const LATENCY_BUCKETS: [f64; 22] = [
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
    5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
/// [`LATENCY_BUCKETS`] in nanoseconds, what the hot path compares with.
const BUCKET_NS: [u64; 22] = [
    1_000,
    2_500,
    5_000,
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    5_000_000_000,
    10_000_000_000,
];
/// Buckets of one histogram: the bounded ones and `+Inf`.
pub const BUCKETS: usize = LATENCY_BUCKETS.len() + 1;

/// Counter slots indexed by a wire byte (opcode, status): every code this protocol has is
/// below 32. Slot 0 takes the bytes that name no request (an unknown opcode, NOTIFY).
const SLOTS: usize = 32;
const _: () =
    assert!((Opcode::Metrics as usize) < SLOTS && (Status::TooManyConnections as usize) < SLOTS);

/// What a refused connection was refused for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Its peer's uid is not allowed (`--allow-uid`).
    Uid,
    /// The daemon already serves its most connections (`--max-connections`).
    Limit,
}

/// One request kind's latency histogram: a count per bucket (not cumulative) and the sum.
#[derive(Debug)]
struct Latencies {
    buckets: [AtomicU64; BUCKETS],
    sum_ns: AtomicU64,
}

impl Latencies {
    fn new() -> Self {
        Latencies {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_ns: AtomicU64::new(0),
        }
    }

    fn observe(&self, took: Duration) {
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        // The first bucket whose bound is at least `ns` (Prometheus' `le`); past the last
        // bound, `+Inf`.
        let bucket = BUCKET_NS.partition_point(|&bound| bound < ns);
        self.buckets[bucket].fetch_add(1, Relaxed);
        self.sum_ns.fetch_add(ns, Relaxed);
    }

    fn load(&self) -> ([u64; BUCKETS], u64) {
        (
            std::array::from_fn(|i| self.buckets[i].load(Relaxed)),
            self.sum_ns.load(Relaxed),
        )
    }
}

/// The connection layer's counters, shared by every connection of the daemon.
#[derive(Debug)]
pub struct ServerCounters {
    /// Indexed by opcode byte (0: bytes that name no request).
    requests: [Latencies; SLOTS],
    /// Error replies, indexed by status byte.
    errors: [AtomicU64; SLOTS],
    socket_received: AtomicU64,
    socket_sent: AtomicU64,
    opened: AtomicU64,
    closed: AtomicU64,
    refused_uid: AtomicU64,
    refused_limit: AtomicU64,
}

impl Default for ServerCounters {
    fn default() -> Self {
        ServerCounters {
            requests: std::array::from_fn(|_| Latencies::new()),
            errors: std::array::from_fn(|_| AtomicU64::new(0)),
            socket_received: AtomicU64::new(0),
            socket_sent: AtomicU64::new(0),
            opened: AtomicU64::new(0),
            closed: AtomicU64::new(0),
            refused_uid: AtomicU64::new(0),
            refused_limit: AtomicU64::new(0),
        }
    }
}

/// The slot of an opcode byte: its own for a request, 0 for anything else.
fn request_slot(opcode: u8) -> usize {
    match Opcode::from_code(opcode) {
        Some(op) if op.is_request() => usize::from(opcode),
        _ => 0,
    }
}

impl ServerCounters {
    /// One request answered (or refused) after `took`; `failed`: its error reply's status.
    pub fn answered(&self, opcode: u8, took: Duration, failed: Option<Status>) {
        self.requests[request_slot(opcode)].observe(took);
        if let Some(status) = failed {
            self.error(status);
        }
    }

    /// An error reply not tied to an answered request (a frame that does not parse).
    pub fn error(&self, status: Status) {
        self.errors[usize::from(status.code())].fetch_add(1, Relaxed);
    }

    pub fn received(&self, bytes: usize) {
        self.socket_received.fetch_add(bytes as u64, Relaxed);
    }

    pub fn sent(&self, bytes: usize) {
        self.socket_sent.fetch_add(bytes as u64, Relaxed);
    }

    pub fn opened(&self) {
        self.opened.fetch_add(1, Relaxed);
    }

    pub fn closed(&self) {
        self.closed.fetch_add(1, Relaxed);
    }

    pub fn refused(&self, why: Refusal) {
        match why {
            Refusal::Uid => &self.refused_uid,
            Refusal::Limit => &self.refused_limit,
        }
        .fetch_add(1, Relaxed);
    }

    /// The counters now, with the gauges the server keeps beside them: `connections` served
    /// and `half_closed` among them.
    pub fn snapshot(&self, connections: u64, half_closed: u64) -> ServerSnapshot {
        let mut requests: Vec<RequestLatencies> = Opcode::ALL
            .iter()
            .filter(|op| op.is_request())
            .map(|op| RequestLatencies::load(op.name(), &self.requests[usize::from(op.code())]))
            .collect();
        requests.push(RequestLatencies::load("UNKNOWN", &self.requests[0]));
        ServerSnapshot {
            connections,
            half_closed,
            connections_opened: self.opened.load(Relaxed),
            connections_closed: self.closed.load(Relaxed),
            refused_uid: self.refused_uid.load(Relaxed),
            refused_limit: self.refused_limit.load(Relaxed),
            socket_received_bytes: self.socket_received.load(Relaxed),
            socket_sent_bytes: self.socket_sent.load(Relaxed),
            requests,
            errors: Status::ALL
                .iter()
                .map(|s| (*s, self.errors[usize::from(s.code())].load(Relaxed)))
                .collect(),
        }
    }
}

/// The connection layer's numbers at one moment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ServerSnapshot {
    /// Connections served now.
    pub connections: u64,
    /// Of those, connections whose client shut down its sending side.
    pub half_closed: u64,
    pub connections_opened: u64,
    pub connections_closed: u64,
    pub refused_uid: u64,
    pub refused_limit: u64,
    pub socket_received_bytes: u64,
    pub socket_sent_bytes: u64,
    /// One per request opcode, in wire order (by PROTOCOL.md name), then `UNKNOWN`.
    pub requests: Vec<RequestLatencies>,
    /// Error replies per status, in wire order.
    pub errors: Vec<(Status, u64)>,
}

/// One request kind's latency histogram as read.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestLatencies {
    /// The opcode's PROTOCOL.md name (`GET`), or `UNKNOWN`.
    pub op: &'static str,
    /// Requests per bucket of [`LATENCY_BUCKETS`] and `+Inf` (not cumulative).
    pub buckets: [u64; BUCKETS],
    pub sum_seconds: f64,
}

impl RequestLatencies {
    fn load(op: &'static str, l: &Latencies) -> Self {
        let (buckets, sum_ns) = l.load();
        RequestLatencies {
            op,
            buckets,
            sum_seconds: sum_ns as f64 / 1e9,
        }
    }

    /// Requests of this kind, ever.
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_bounds_agree_in_both_units() {
        for (s, ns) in LATENCY_BUCKETS.iter().zip(BUCKET_NS) {
            assert_eq!((s * 1e9).round() as u64, ns);
        }
        assert!(BUCKET_NS.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn a_request_lands_in_the_first_bucket_at_or_above_its_latency() {
        let c = ServerCounters::default();
        let us = Duration::from_micros;
        c.answered(Opcode::Get.code(), us(1), None); // le 1e-6, exactly on the bound
        c.answered(Opcode::Get.code(), us(3), None); // le 5e-6
        c.answered(
            Opcode::Get.code(),
            Duration::from_secs(60),
            Some(Status::NotFound),
        );
        c.answered(0x7F, us(1), Some(Status::UnknownOpcode));
        c.answered(Opcode::Notify.code(), us(1), Some(Status::UnknownOpcode));
        let s = c.snapshot(3, 1);
        let get = s.requests.iter().find(|r| r.op == "GET").unwrap();
        assert_eq!(get.count(), 3);
        assert_eq!(
            (get.buckets[0], get.buckets[2], get.buckets[BUCKETS - 1]),
            (1, 1, 1)
        );
        assert!(
            (get.sum_seconds - 60.000_004).abs() < 1e-9,
            "{}",
            get.sum_seconds
        );
        let unknown = s.requests.last().unwrap();
        assert_eq!((unknown.op, unknown.count()), ("UNKNOWN", 2));
        let errors = |status| s.errors.iter().find(|(st, _)| *st == status).unwrap().1;
        assert_eq!(
            (errors(Status::NotFound), errors(Status::UnknownOpcode)),
            (1, 2)
        );
        assert_eq!((s.connections, s.half_closed), (3, 1));
        // Every request opcode has its histogram, NOTIFY (never a request) none.
        assert_eq!(s.requests.len(), Opcode::ALL.len());
        assert!(s.requests.iter().all(|r| r.op != "NOTIFY"));
    }
}
