//! A [`Snapshot`] as the Prometheus text format, written by prometheus-client: a `Collector`
//! over the snapshot's values, registered in a registry made for the one scrape.
//!
//! Naming follows Prometheus' conventions: everything is `vovp_...`; prometheus-client appends
//! the unit (`_bytes`, `_seconds`) and a counter's `_total`. Each family's HELP says what it
//! counts. The families, their types and labels are listed in one place, the collector below.

use std::fmt::Error as FmtError;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType::{self, Counter, Gauge};
use prometheus_client::registry::{Registry, Unit};

use super::clients::ClientUsage;
use super::counters::{ServerSnapshot, LATENCY_BUCKETS};
use super::{Snapshot, TableSnapshot};

/// The `Content-Type` of what [`encode_text`] writes (Prometheus text format 0.0.4).
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// The snapshot in the Prometheus text format (version 0.0.4).
pub fn encode_text(snapshot: Snapshot) -> String {
    let mut registry = Registry::with_prefix("vovp");
    registry.register_collector(Box::new(SnapshotCollector(snapshot)));
    let mut text = String::new();
    // Writing into a String cannot fail, and the collector only fails when its writer does.
    if let Err(e) = prometheus_client::encoding::prometheus_text::encode(&mut text, &registry) {
        tracing::error!("encoding the metrics failed: {e}");
    }
    text
}

/// Encodes one snapshot: every family the daemon reports.
#[derive(Debug)]
struct SnapshotCollector(Snapshot);

impl Collector for SnapshotCollector {
    fn encode(&self, mut e: DescriptorEncoder) -> Result<(), FmtError> {
        let mut e = Families(&mut e);
        e.info(
            "build",
            "The daemon's version.",
            &[("version", env!("CARGO_PKG_VERSION"))],
        )?;
        store(&mut e, &self.0.store)?;
        table(&mut e, &self.0.table)?;
        clients(&mut e, &self.0.clients)?;
        server(&mut e, &self.0.server)
    }
}

/// The store's numbers beyond STATS: resident memory, lends, and what the store did, each
/// count with its data bytes.
fn table(e: &mut Families<'_, '_>, t: &TableSnapshot) -> Result<(), FmtError> {
    let bytes = Some(&Unit::Bytes);
    e.one(
        Gauge,
        "resident",
        "Host memory of the store's segments the kernel may have backed now: allocated \
         blocks plus freed pages not yet given back (an upper bound, at most the capacity).",
        bytes,
        t.resident_bytes,
    )?;
    e.one(
        Gauge,
        "lends",
        "Lends alive: parts of clients' arenas lent to them for puts without a CREATE.",
        None,
        t.live_lends,
    )?;
    let a = &t.activity;
    // (name of the count, its help, name of the bytes, their help, the values)
    let counted = [
        (
            "seals",
            "Objects sealed (SEAL, inline PUT, PUBLISH), replacements included.",
            "sealed",
            "Data bytes of the objects sealed.",
            a.seals,
        ),
        (
            "replaces",
            "Seals that made a name's next version (a replace).",
            "replaced",
            "Data bytes of the objects sealed as a name's next version.",
            a.replaces,
        ),
        (
            "deletes",
            "Objects deleted by name (DELETE).",
            "deleted",
            "Data bytes of the objects deleted by name.",
            a.deletes,
        ),
        (
            "shared_gets",
            "Gets served from the shared directory, without a message (counted by each \
             client in its hold table; a departed client's count is kept).",
            "shared_get",
            "Data bytes of the gets served from the shared directory.",
            a.shared_gets,
        ),
        (
            "lends_made",
            "Lends handed to clients (LEND).",
            "lent",
            "Bytes of the lends handed to clients.",
            a.lends,
        ),
        (
            "publishes",
            "Objects published from lends (PUBLISH, each PUBLISH_MANY item).",
            "published",
            "Data bytes of the objects published from lends.",
            a.publishes,
        ),
    ];
    for (count, count_help, data, data_help, v) in counted {
        e.one(Counter, count, count_help, None, v.count)?;
        e.one(Counter, data, data_help, bytes, v.bytes)?;
    }
    e.each(
        Counter,
        "socket_gets",
        "Names asked by a get over the socket (GET, GET_NEWER): hit, answered with an \
         object; miss, not sealed in time.",
        None,
        "result",
        &[("hit", a.socket_hits.count), ("miss", a.socket_misses)],
    )?;
    e.one(
        Counter,
        "socket_get",
        "Data bytes of the objects gets over the socket answered with.",
        bytes,
        a.socket_hits.bytes,
    )
}

/// The clients holding the most, by pid (see [`super::clients`]).
fn clients(e: &mut Families<'_, '_>, clients: &[ClientUsage]) -> Result<(), FmtError> {
    let pids: Vec<String> = clients.iter().map(|c| c.pid.to_string()).collect();
    let of = |v: fn(&ClientUsage) -> u64| -> Vec<(&str, u64)> {
        pids.iter()
            .map(String::as_str)
            .zip(clients.iter().map(v))
            .collect()
    };
    e.each(
        Gauge,
        "client_held",
        "Data bytes of the objects a client process holds (pid; 0: unknown), for the clients \
         holding the most bytes or references (at most 20).",
        Some(&Unit::Bytes),
        "pid",
        &of(|c| c.bytes),
    )?;
    e.each(
        Gauge,
        "client_references",
        "References a client process holds, hold-table holds included (pid; 0: unknown), for \
         the clients holding the most bytes or references (at most 20).",
        None,
        "pid",
        &of(|c| c.references),
    )
}

/// The engine's STATS.
fn store(e: &mut Families<'_, '_>, s: &vovp::StoreStats) -> Result<(), FmtError> {
    let bytes = Some(&Unit::Bytes);
    e.one(
        Gauge,
        "capacity",
        "Host memory the store may use for objects (-m).",
        bytes,
        s.capacity,
    )?;
    e.one(
        Gauge,
        "used",
        "Host memory handed out for objects (sizes rounded up to 64 bytes, with metadata).",
        bytes,
        s.used_bytes,
    )?;
    e.each(
        Gauge,
        "objects",
        "Objects by state: sealed and unsealed ones have a name; pending_delete ones were \
         deleted and wait for their last holder.",
        None,
        "state",
        &[
            ("sealed", s.sealed),
            ("unsealed", s.unsealed),
            ("pending_delete", s.pending_delete),
        ],
    )?;
    e.one(
        Gauge,
        "references",
        "References held on objects, hold-table holds included.",
        None,
        s.references,
    )?;
    e.one(
        Gauge,
        "holders",
        "Holders (connections) holding at least one reference.",
        None,
        s.holders,
    )?;
    e.one(
        Gauge,
        "shared_holds",
        "References held through clients' hold tables (gets without a message).",
        None,
        s.shared_holds,
    )?;
    e.one(
        Gauge,
        "waiting_gets",
        "GETs waiting for a name to be sealed.",
        None,
        s.waiting_gets,
    )?;
    e.one(Counter, "creates", "Objects created.", None, s.creates)?;
    e.one(
        Counter,
        "evicted_objects",
        "Objects evicted to make room.",
        None,
        s.evicted_objects,
    )?;
    e.one(
        Counter,
        "evicted",
        "Bytes of the objects evicted to make room.",
        bytes,
        s.evicted_bytes,
    )?;
    e.one(
        Counter,
        "put_barriers",
        "Misses that first waited for other clients' pipelined puts to be applied.",
        None,
        s.put_barriers,
    )?;
    spill(e, s)
}

/// Spilling to disk (`--spill-dir`; all 0 without it).
fn spill(e: &mut Families<'_, '_>, s: &vovp::StoreStats) -> Result<(), FmtError> {
    let bytes = Some(&Unit::Bytes);
    e.one(
        Gauge,
        "spilled_objects",
        "Objects on disk only now (spilled; the next get restores them).",
        None,
        s.spilled_objects,
    )?;
    e.one(
        Gauge,
        "spilled",
        "Data bytes of the objects on disk only now.",
        bytes,
        s.spilled_bytes,
    )?;
    e.one(
        Counter,
        "spills",
        "Objects written to disk to make room instead of being evicted.",
        None,
        s.spills,
    )?;
    e.one(
        Counter,
        "spill_written",
        "Data bytes of the objects written to disk to make room.",
        bytes,
        s.spill_bytes,
    )?;
    e.one(
        Counter,
        "restores",
        "Spilled objects read back into memory by a get.",
        None,
        s.restores,
    )?;
    e.one(
        Counter,
        "restore_read",
        "Data bytes of the spilled objects read back into memory.",
        bytes,
        s.restore_bytes,
    )?;
    e.one(
        Counter,
        "spill_failures",
        "Objects evicted although spilling was on (--spill-max reached, the disk full, a \
         write failed).",
        None,
        s.spill_failures,
    )?;
    e.one(
        Counter,
        "restore_failures",
        "Restores that found the spill file damaged, truncated or gone (the object was lost).",
        None,
        s.restore_failures,
    )
}

/// The connection layer's counters.
fn server(e: &mut Families<'_, '_>, s: &ServerSnapshot) -> Result<(), FmtError> {
    let bytes = Some(&Unit::Bytes);
    e.one(
        Gauge,
        "connections",
        "Client connections served now.",
        None,
        s.connections,
    )?;
    e.one(
        Gauge,
        "connections_half_closed",
        "Connections whose client shut down its sending side; kept, with their references, \
         until it closes.",
        None,
        s.half_closed,
    )?;
    e.one(
        Counter,
        "connections_opened",
        "Client connections accepted.",
        None,
        s.connections_opened,
    )?;
    e.one(
        Counter,
        "connections_closed",
        "Client connections ended (everything they held released).",
        None,
        s.connections_closed,
    )?;
    e.each(
        Counter,
        "connections_refused",
        "Connections refused: uid (not an allowed uid) or limit (--max-connections).",
        None,
        "reason",
        &[("uid", s.refused_uid), ("limit", s.refused_limit)],
    )?;
    e.one(
        Counter,
        "socket_received",
        "Bytes read from client sockets.",
        bytes,
        s.socket_received_bytes,
    )?;
    e.one(
        Counter,
        "socket_sent",
        "Bytes written to client sockets.",
        bytes,
        s.socket_sent_bytes,
    )?;
    let mut requests = e.0.encode_descriptor(
        "request_duration",
        "Time the daemon took to answer a request, by opcode (PROTOCOL.md name): from its \
         frame read whole to its reply ready to write; a GET's wait for a seal included. \
         _count is the number of requests.",
        Some(&Unit::Seconds),
        MetricType::Histogram,
    )?;
    for r in &s.requests {
        let buckets: Vec<(f64, u64)> = LATENCY_BUCKETS
            .iter()
            .copied()
            .chain([f64::INFINITY])
            .zip(r.buckets)
            .collect();
        requests
            .encode_family(&[("op", r.op)])?
            .encode_histogram::<NoLabelSet>(r.sum_seconds, r.count(), &buckets, None)?;
    }
    let errors: Vec<(&str, u64)> = s.errors.iter().map(|(st, n)| (st.name(), *n)).collect();
    e.each(
        Counter,
        "request_errors",
        "Error replies, by status (PROTOCOL.md name).",
        None,
        "status",
        &errors,
    )
}

/// The shapes of family this daemon writes, over prometheus-client's encoder.
struct Families<'e, 'a>(&'e mut DescriptorEncoder<'a>);

impl Families<'_, '_> {
    fn info(&mut self, name: &str, help: &str, labels: &[(&str, &str)]) -> Result<(), FmtError> {
        self.0
            .encode_descriptor(name, help, None, MetricType::Info)?
            .encode_info(&labels)
    }

    /// One sample of a counter or gauge.
    fn one(
        &mut self,
        kind: MetricType,
        name: &str,
        help: &str,
        unit: Option<&Unit>,
        v: u64,
    ) -> Result<(), FmtError> {
        let m = self.0.encode_descriptor(name, help, unit, kind)?;
        encode_value(kind, v, m)
    }

    /// A counter or gauge with one sample per value of `label`.
    fn each(
        &mut self,
        kind: MetricType,
        name: &str,
        help: &str,
        unit: Option<&Unit>,
        label: &str,
        values: &[(&str, u64)],
    ) -> Result<(), FmtError> {
        let mut m = self.0.encode_descriptor(name, help, unit, kind)?;
        for (value, v) in values {
            encode_value(kind, *v, m.encode_family(&[(label, *value)])?)?;
        }
        Ok(())
    }
}

/// `v` as a counter's or a gauge's value.
fn encode_value(kind: MetricType, v: u64, m: MetricEncoder<'_>) -> Result<(), FmtError> {
    match kind {
        Counter => ConstCounter::new(v).encode(m),
        _ => ConstGauge::new(v).encode(m),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::ServerCounters;
    use vovp_proto::{Opcode, Status};

    fn sample() -> Snapshot {
        let counters = ServerCounters::default();
        counters.answered(
            Opcode::Get.code(),
            std::time::Duration::from_micros(3),
            None,
        );
        counters.answered(
            Opcode::Seal.code(),
            std::time::Duration::from_micros(30),
            Some(Status::NotCreator),
        );
        counters.received(100);
        Snapshot {
            store: vovp::StoreStats {
                capacity: 1 << 20,
                used_bytes: 4096,
                sealed: 2,
                evicted_bytes: 128,
                ..Default::default()
            },
            server: counters.snapshot(1, 0),
            table: TableSnapshot {
                resident_bytes: 8192,
                live_lends: 1,
                activity: vovp::StoreActivity {
                    seals: vovp::Counted {
                        count: 3,
                        bytes: 300,
                    },
                    socket_misses: 2,
                    shared_gets: vovp::Counted {
                        count: 5,
                        bytes: 50,
                    },
                    ..Default::default()
                },
            },
            clients: vec![ClientUsage {
                pid: 42,
                references: 3,
                bytes: 2048,
            }],
        }
    }

    #[test]
    fn families_follow_prometheus_naming() {
        let text = encode_text(sample());
        for line in [
            "# TYPE vovp_capacity_bytes gauge",
            "vovp_capacity_bytes 1048576",
            "vovp_used_bytes 4096",
            "vovp_objects{state=\"sealed\"} 2",
            "# TYPE vovp_evicted_bytes_total counter",
            "vovp_evicted_bytes_total 128",
            "vovp_socket_received_bytes_total 100",
            "# TYPE vovp_request_duration_seconds histogram",
            "vovp_request_duration_seconds_bucket{op=\"GET\",le=\"2.5e-06\"} 0",
            "vovp_request_duration_seconds_bucket{op=\"GET\",le=\"5e-06\"} 1",
            "vovp_request_duration_seconds_bucket{op=\"GET\",le=\"+Inf\"} 1",
            "vovp_request_duration_seconds_count{op=\"GET\"} 1",
            "vovp_request_errors_total{status=\"NOT_CREATOR\"} 1",
            "vovp_connections_refused_total{reason=\"limit\"} 0",
            "vovp_build_info{version=\"0.1.0\"} 1",
            "vovp_resident_bytes 8192",
            "vovp_lends 1",
            "vovp_seals_total 3",
            "vovp_sealed_bytes_total 300",
            "vovp_socket_gets_total{result=\"miss\"} 2",
            "vovp_shared_gets_total 5",
            "vovp_shared_get_bytes_total 50",
            "vovp_lends_made_total 0",
            "vovp_client_held_bytes{pid=\"42\"} 2048",
            "vovp_client_references{pid=\"42\"} 3",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
        // Every family has its HELP and TYPE before its samples.
        let families = text.lines().filter(|l| l.starts_with("# TYPE ")).count();
        assert_eq!(
            text.lines().filter(|l| l.starts_with("# HELP ")).count(),
            families
        );
    }
}
