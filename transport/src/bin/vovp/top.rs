//! `vovp top`: a live view of a daemon, one frame a second: memory, objects, references,
//! connections, traffic, request rates and latency percentiles, the clients holding the most
//! and the largest objects.
//!
//! Where the numbers come from: STATS (memory, objects, references, connections), LIST (the
//! largest objects) and METRICS (request counts and latency histograms, errors, bytes, and the
//! clients holding the most), over a client connection of its own that holds nothing
//! ([`Inspector`]). Rates and percentiles are over the last interval (the
//! difference of two METRICS replies); the first frame's are since the daemon started.
//!
//! On a terminal each frame replaces the last; otherwise (a pipe, a file, a test) frames are
//! printed one after another. `--once` / `-n N` stop after one or N frames; Ctrl-C stops at
//! once, cleanly.

use std::fmt::Write as _;
use std::io::{IsTerminal, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use vovp_client::{Client, ClientOptions, Error, ObjectInfo, StoreStats};
use vovp_proto::{Status, LIST_END};
use vovp_transport::metrics::read::{Exposition, Histogram};

use super::{human_bytes, state_of};

/// How `top` runs.
#[derive(Debug, Clone)]
pub struct TopOptions {
    /// Frames to show; `None`: until Ctrl-C.
    pub frames: Option<u64>,
    pub interval: Duration,
    /// Rows of each list (requests, holders, objects).
    pub rows: usize,
}

/// Above this many objects the object list is read every [`LIST_EVERY`] frames only: a LIST
/// of a big store is work for the daemon.
const LIST_EVERY_ABOVE: u64 = 100_000;
const LIST_EVERY: u64 = 10;

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

/// Ctrl-C (and SIGTERM) end the loop between frames instead of killing the process mid-write.
fn catch_interrupts() {
    // SAFETY: the handler only stores to an atomic (async-signal-safe).
    unsafe {
        let handler = on_interrupt as extern "C" fn(libc::c_int) as libc::sighandler_t;
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

/// Runs the view until its frames are shown or it is interrupted.
pub fn run(socket: &Path, options: &TopOptions, out: &mut impl Write) -> Result<(), Error> {
    catch_interrupts();
    let mut inspector = Inspector::connect(socket)?;
    let live = std::io::stdout().is_terminal();
    let io = |e: std::io::Error| Error::Internal(e.to_string());
    let mut previous: Option<Frame> = None;
    let mut objects: Vec<ObjectInfo> = Vec::new();
    let mut shown = 0u64;
    while !STOP.load(Ordering::Relaxed) {
        let (stats, connections) = inspector.stats()?;
        if stats.objects <= LIST_EVERY_ABOVE || shown.is_multiple_of(LIST_EVERY) {
            objects = inspector.largest(options.rows)?;
        }
        let frame = Frame {
            at: Instant::now(),
            stats,
            connections,
            metrics: inspector.metrics()?,
        };
        let text = render(socket, &frame, previous.as_ref(), &objects, options);
        if live {
            // Home, clear, then the frame.
            write!(out, "\x1b[H\x1b[2J{text}").map_err(io)?;
        } else {
            writeln!(out, "{text}").map_err(io)?;
        }
        out.flush().map_err(io)?;
        shown += 1;
        if options.frames.is_some_and(|n| shown >= n) {
            break;
        }
        previous = Some(frame);
        let until = Instant::now() + options.interval;
        while Instant::now() < until && !STOP.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(20).min(options.interval));
        }
    }
    Ok(())
}

/// What one frame shows, as read.
#[derive(Debug, Clone)]
pub struct Frame {
    pub at: Instant,
    pub stats: StoreStats,
    pub connections: u64,
    /// `None` from a daemon without METRICS.
    pub metrics: Option<Exposition>,
}

/// `top`'s own connection: a client that maps neither the shared directory nor a lend, so it
/// holds nothing and counts as no holder; it asks STATS, LIST and METRICS in turn.
pub struct Inspector {
    client: Client,
}

impl Inspector {
    pub fn connect(path: &Path) -> Result<Self, Error> {
        let options = ClientOptions {
            no_shared_reads: true,
            no_lend_puts: true,
            ..Default::default()
        };
        Ok(Inspector {
            client: Client::connect_with(path, options)?,
        })
    }

    pub fn stats(&mut self) -> Result<(StoreStats, u64), Error> {
        self.client.stats_and_connections()
    }

    /// The `n` largest objects, largest first (every LIST page read, `n` kept).
    pub fn largest(&mut self, n: usize) -> Result<Vec<ObjectInfo>, Error> {
        let mut kept: Vec<ObjectInfo> = Vec::new();
        let mut start = 0;
        loop {
            let (entries, next) = self.client.list_page(start)?;
            kept.extend(entries);
            kept.sort_by(|a, b| b.size.cmp(&a.size).then(a.name.cmp(&b.name)));
            kept.truncate(n);
            if next == LIST_END {
                return Ok(kept);
            }
            start = next;
        }
    }

    /// The daemon's exposition; `None` when it has no METRICS (an older daemon).
    pub fn metrics(&mut self) -> Result<Option<Exposition>, Error> {
        match self.client.metrics() {
            Ok(text) => Ok(Some(Exposition::parse(&text))),
            // The daemon's UNKNOWN_OPCODE reply, as the client hands it on.
            Err(Error::Protocol(m)) if m.starts_with(Status::UnknownOpcode.name()) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

const DURATION: &str = "vovp_request_duration_seconds";

/// One frame's text. `previous` (the frame before) turns counters into rates.
pub fn render(
    socket: &Path,
    now: &Frame,
    previous: Option<&Frame>,
    largest: &[ObjectInfo],
    options: &TopOptions,
) -> String {
    let s = &now.stats;
    let mut t = String::new();
    let secs = previous.map(|p| now.at.duration_since(p.at).as_secs_f64().max(1e-3));
    let _ = writeln!(
        t,
        "vovp top  {}  every {:.1} s",
        socket.display(),
        options.interval.as_secs_f64()
    );
    let used = match s.capacity {
        0 => 0.0,
        c => s.used_bytes as f64 / c as f64,
    };
    let _ = writeln!(
        t,
        "memory   [{}]  {:.1} %  {} of {}",
        bar(used, 40),
        used * 100.0,
        human_bytes(s.used_bytes),
        human_bytes(s.capacity)
    );
    let _ = writeln!(
        t,
        "objects  {}: {} sealed, {} unsealed; {} deleted, waiting for their last holder",
        s.objects, s.sealed, s.unsealed, s.pending_delete
    );
    let _ = writeln!(
        t,
        "refs     {} held by {} holders ({} through hold tables); {} GETs waiting",
        s.references, s.holders, s.shared_holds, s.waiting_gets
    );
    let _ = writeln!(
        t,
        "clients  {} connections ({} half-closed)",
        now.connections, s.half_closed
    );
    let rate = |now_v: f64, then_v: Option<f64>| match (secs, then_v) {
        (Some(dt), Some(then)) if now_v >= then => format!("{:.1}/s", (now_v - then) / dt),
        _ => "-".to_string(),
    };
    let prev_stats = previous.map(|p| &p.stats);
    let _ = writeln!(
        t,
        "churn    creates {} ({}), evicted {} objects ({}), {} ({})",
        s.creates,
        rate(s.creates as f64, prev_stats.map(|p| p.creates as f64)),
        s.evicted_objects,
        rate(
            s.evicted_objects as f64,
            prev_stats.map(|p| p.evicted_objects as f64)
        ),
        human_bytes(s.evicted_bytes),
        rate_bytes(s.evicted_bytes, prev_stats.map(|p| p.evicted_bytes), secs),
    );
    match &now.metrics {
        None => {
            let _ = writeln!(
                t,
                "\n(this daemon does not answer METRICS: no request rates or latencies)"
            );
        }
        Some(m) => {
            let before = previous.and_then(|p| p.metrics.as_ref());
            traffic(&mut t, m, before, secs);
            requests(&mut t, m, before, secs, options.rows);
            holders(&mut t, m, options.rows);
        }
    }
    let _ = writeln!(t, "\nLARGEST OBJECTS");
    if largest.is_empty() {
        let _ = writeln!(t, "(none)");
    }
    for o in largest {
        let _ = writeln!(
            t,
            "{:<40}  {:>10}  {:>4} refs  {}",
            o.name.as_str(),
            human_bytes(o.size),
            o.refcount,
            state_of(o)
        );
    }
    t
}

fn bar(fraction: f64, width: usize) -> String {
    let full = ((fraction.clamp(0.0, 1.0) * width as f64).round() as usize).min(width);
    format!("{}{}", "#".repeat(full), ".".repeat(width - full))
}

fn rate_bytes(now: u64, then: Option<u64>, secs: Option<f64>) -> String {
    match (secs, then) {
        (Some(dt), Some(then)) if now >= then => {
            format!("{}/s", human_bytes(((now - then) as f64 / dt) as u64))
        }
        _ => "-".into(),
    }
}

fn traffic(t: &mut String, m: &Exposition, before: Option<&Exposition>, secs: Option<f64>) {
    let bytes = |e: &Exposition, name: &str| e.value(name, &[]).map(|v| v as u64);
    let mut line = String::from("socket  ");
    for (label, name) in [
        ("in", "vovp_socket_received_bytes_total"),
        ("out", "vovp_socket_sent_bytes_total"),
    ] {
        let now = bytes(m, name).unwrap_or(0);
        let _ = write!(
            line,
            " {label} {} ({})",
            human_bytes(now),
            rate_bytes(now, before.and_then(|b| bytes(b, name)), secs)
        );
    }
    let _ = writeln!(t, "{line}");
    // Gets by path: over the socket (hits and misses) and through the shared directory.
    let count = |e: &Exposition, name: &str, labels: &[(&str, &str)]| e.value(name, labels);
    let mut gets = String::from("gets    ");
    for (label, name, labels) in [
        (
            "socket hits",
            "vovp_socket_gets_total",
            &[("result", "hit")][..],
        ),
        (
            "misses",
            "vovp_socket_gets_total",
            &[("result", "miss")][..],
        ),
        ("shared", "vovp_shared_gets_total", &[][..]),
    ] {
        let now = count(m, name, labels).unwrap_or(0.0);
        let then = before.and_then(|b| count(b, name, labels));
        let recent = match then {
            Some(then) => rate_of(now, then, secs),
            None => "-".into(),
        };
        let _ = write!(gets, " {label} {now} ({recent})");
    }
    let _ = writeln!(t, "{gets}");
    const ERRORS: &str = "vovp_request_errors_total";
    let errors: Vec<String> = m
        .all(ERRORS)
        .filter(|(_, n)| *n > 0.0)
        .filter_map(|(labels, n)| {
            let status = labels.get("status")?;
            let then = before.and_then(|b| b.value(ERRORS, &[("status", status)]));
            let recent = match (secs, then) {
                (Some(_), Some(then)) => format!(", {}", rate_of(n, then, secs)),
                _ => String::new(),
            };
            Some(format!("{status} {n}{recent}"))
        })
        .collect();
    let _ = writeln!(
        t,
        "errors   {}",
        if errors.is_empty() {
            "none".to_string()
        } else {
            errors.join("; ")
        }
    );
}

fn rate_of(now: f64, then: f64, secs: Option<f64>) -> String {
    match secs {
        Some(dt) if now >= then => format!("{:.1}/s", (now - then) / dt),
        _ => "-".into(),
    }
}

/// The request table: the busiest kinds, their rate and latency percentiles.
fn requests(
    t: &mut String,
    m: &Exposition,
    before: Option<&Exposition>,
    secs: Option<f64>,
    rows: usize,
) {
    let count = format!("{DURATION}_count");
    struct Row {
        op: String,
        total: f64,
        recent: f64,
        latencies: Option<Histogram>,
    }
    let mut table: Vec<Row> = m
        .all(&count)
        .filter(|(_, n)| *n > 0.0)
        .filter_map(|(labels, total)| {
            let op = labels.get("op")?.to_owned();
            let labels = [("op", op.as_str())];
            let now = m.histogram(DURATION, &labels)?;
            let then = before.and_then(|b| b.histogram(DURATION, &labels));
            let recent = then.as_ref().map_or(now.clone(), |then| now.since(then));
            Some(Row {
                total,
                recent: recent.count(),
                latencies: Some(recent),
                op,
            })
        })
        .collect();
    table.sort_by(|a, b| {
        b.recent
            .total_cmp(&a.recent)
            .then(b.total.total_cmp(&a.total))
    });
    let _ = writeln!(
        t,
        "\n{:<14} {:>10} {:>12} {:>10} {:>10} {:>10}",
        "REQUEST", "RATE", "TOTAL", "p50", "p90", "p99"
    );
    if table.is_empty() {
        let _ = writeln!(t, "(none yet)");
    }
    for r in table.iter().take(rows) {
        let rate = secs.map_or("-".to_string(), |dt| format!("{:.1}/s", r.recent / dt));
        let q = |q: f64| {
            r.latencies
                .as_ref()
                .and_then(|h| h.quantile(q))
                .map_or("-".into(), seconds)
        };
        let _ = writeln!(
            t,
            "{:<14} {:>10} {:>12} {:>10} {:>10} {:>10}",
            r.op,
            rate,
            r.total,
            q(0.5),
            q(0.9),
            q(0.99)
        );
    }
    let _ = writeln!(
        t,
        "(latency: the daemon's, from a request read to its reply ready; {})",
        if secs.is_some() {
            "over the last interval"
        } else {
            "since the daemon started"
        }
    );
}

/// The clients holding the most, by bytes and by references, when the daemon reports them
/// (`vovp_client_held_bytes{pid}`, `vovp_client_references{pid}`).
fn holders(t: &mut String, m: &Exposition, rows: usize) {
    let top = |name: &str| {
        let mut v: Vec<(String, f64)> = m
            .all(name)
            .filter_map(|(labels, n)| Some((labels.get("pid")?.to_owned(), n)))
            .collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1));
        v.truncate(rows);
        v
    };
    let bytes = top("vovp_client_held_bytes");
    let refs = top("vovp_client_references");
    let _ = writeln!(
        t,
        "\n{:<34} TOP HOLDERS BY REFERENCES",
        "TOP HOLDERS BY BYTES"
    );
    if bytes.is_empty() && refs.is_empty() {
        let _ = writeln!(t, "(not reported by this daemon)");
        return;
    }
    for i in 0..bytes.len().max(refs.len()) {
        let left = bytes.get(i).map_or(String::new(), |(pid, b)| {
            format!("pid {pid:<8} {:>12}", human_bytes(*b as u64))
        });
        let right = refs
            .get(i)
            .map_or(String::new(), |(pid, n)| format!("pid {pid:<8} {n:>8}"));
        let _ = writeln!(t, "{left:<34} {right}");
    }
}

/// `4.1 µs`, `12.0 ms`, `1.50 s`.
fn seconds(s: f64) -> String {
    if s < 1e-3 {
        format!("{:.1} µs", s * 1e6)
    } else if s < 1.0 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(at: Instant, gets: u64, sum: f64, used: u64) -> Frame {
        let text = format!(
            "# TYPE vovp_request_duration_seconds histogram\n\
             vovp_request_duration_seconds_bucket{{op=\"GET\",le=\"1e-05\"}} {gets}\n\
             vovp_request_duration_seconds_bucket{{op=\"GET\",le=\"+Inf\"}} {gets}\n\
             vovp_request_duration_seconds_sum{{op=\"GET\"}} {sum}\n\
             vovp_request_duration_seconds_count{{op=\"GET\"}} {gets}\n\
             vovp_request_errors_total{{status=\"NOT_FOUND\"}} 2\n\
             vovp_shared_gets_total {gets}\n\
             vovp_client_held_bytes{{pid=\"42\"}} 2048\n\
             vovp_client_references{{pid=\"42\"}} 3\n"
        );
        Frame {
            at,
            stats: StoreStats {
                capacity: 1 << 20,
                used_bytes: used,
                objects: 1,
                sealed: 1,
                ..Default::default()
            },
            connections: 2,
            metrics: Some(Exposition::parse(&text)),
        }
    }

    #[test]
    fn a_frame_shows_memory_rates_latencies_and_holders() {
        let options = TopOptions {
            frames: Some(2),
            interval: Duration::from_secs(1),
            rows: 5,
        };
        let t0 = Instant::now();
        let first = frame(t0, 100, 0.0005, 1 << 19);
        let second = frame(t0 + Duration::from_secs(2), 300, 0.0015, 1 << 19);
        let text = render(Path::new("/s"), &second, Some(&first), &[], &options);
        assert!(
            text.contains(&format!("[{}{}]", "#".repeat(20), ".".repeat(20))),
            "{text}"
        );
        assert!(text.contains("50.0 %"), "{text}");
        let get = text.lines().find(|l| l.starts_with("GET")).unwrap();
        // 200 GETs in 2 s, all under 10 µs: p50 interpolated to 5 µs.
        assert!(get.contains("100.0/s") && get.contains("5.0 µs"), "{get}");
        assert!(text.contains("NOT_FOUND 2"), "{text}");
        assert!(text.contains("shared 300 (100.0/s)"), "{text}");
        assert!(
            text.contains("pid 42") && text.contains("2.0 KiB"),
            "{text}"
        );
        let once = render(Path::new("/s"), &first, None, &[], &options);
        assert!(once.contains("since the daemon started"), "{once}");
        assert!(
            once.lines()
                .any(|l| l.starts_with("GET") && l.contains(" - ")),
            "{once}"
        );
    }
}
