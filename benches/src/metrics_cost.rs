//! `vovp-bench --metrics-cost`: what the metrics cost the small operations. The Rust
//! client's small-op batch ([`crate::rust_level::small_batch`]: 64 B put, contains,
//! get+release, delete) against daemons that differ only in the metrics, in one run,
//! repetitions interleaved (the order rotates) so a slow patch of the machine hits all alike:
//!
//! * `off`: no `--metrics` (the connection layer still counts: its counters are always on);
//! * `on`: `--metrics 127.0.0.1:0`, scraped every second by a thread of this process for the
//!   whole run (what a Prometheus server does, 15 times more often);
//! * `before` (with `--baseline-engine PATH`): another build, e.g. the commit before the
//!   metrics, which counts nothing: `off` against it is the counters' own cost.
//!
//! Each daemon gets two clients: one with the shared directory (its gets take no message) and
//! one without (every get a GET over the socket, through the request counters).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use vovp_client::{Client, ClientOptions};

use crate::procs::Daemon;
use crate::report::median;
use crate::rust_level::small_batch;

/// The operations of one batch, in [`small_batch`]'s order, and the socket client's get.
const OPS: [&str; 5] = [
    "put 64 B",
    "contains",
    "get+release 64 B (shared directory)",
    "delete",
    "get+release 64 B (GET over the socket)",
];

/// One daemon under test.
struct Variant {
    name: &'static str,
    daemon: Daemon,
    /// Shared-directory client, socket-only client.
    clients: [Client; 2],
    /// [op] -> samples, µs per op.
    samples: Vec<Vec<f64>>,
}

/// What `--metrics-cost` runs.
#[derive(Debug, Clone)]
pub struct CostConfig {
    pub engine: PathBuf,
    pub baseline: Option<PathBuf>,
    pub reps: usize,
    pub ops: usize,
    pub out: PathBuf,
}

/// Runs the comparison; returns the markdown table (also written, with the samples, to
/// `out/metrics_cost.json`).
pub fn run(cfg: &CostConfig) -> Result<String, String> {
    let mut plan: Vec<(&'static str, &Path, Vec<String>)> = vec![
        ("off", &cfg.engine, vec![]),
        (
            "on",
            &cfg.engine,
            vec!["--metrics".into(), "127.0.0.1:0".into()],
        ),
    ];
    if let Some(b) = &cfg.baseline {
        plan.push(("before", b, vec![]));
    }
    let mut variants = Vec::new();
    for (name, program, extra) in plan {
        let socket = cfg.out.join(format!("metrics-cost-{name}.sock"));
        let log = cfg.out.join(format!("metrics-cost-{name}.log"));
        let mut args: Vec<String> = vec!["-m".into(), "256M".into(), "-s".into()];
        args.push(socket.display().to_string());
        args.extend(extra);
        let daemon = Daemon::start(name, program, &args, &socket, &log)?;
        let connect = |no_shared_reads| {
            Client::connect_with(
                &socket,
                ClientOptions {
                    no_shared_reads,
                    ..Default::default()
                },
            )
            .map_err(|e| format!("{name}: {e}"))
        };
        variants.push(Variant {
            name,
            clients: [connect(false)?, connect(true)?],
            daemon,
            samples: vec![Vec::new(); OPS.len()],
        });
    }
    let scrapes = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let addr = metrics_addr(&variants[1].daemon.log)?;
    let scraper = {
        let (scrapes, stop) = (scrapes.clone(), stop.clone());
        std::thread::spawn(move || scrape_every_second(addr, &scrapes, &stop))
    };
    let names: Vec<String> = (0..cfg.ops).map(|i| format!("cost-{i}")).collect();
    let data = crate::pattern(64, 5);
    // Repetition -1 warms up connections and caches; it is not recorded.
    for rep in -1..cfg.reps as i64 {
        let mut order: Vec<usize> = (0..variants.len()).collect();
        order.rotate_left(rep.rem_euclid(variants.len() as i64) as usize);
        for i in order {
            let v = &mut variants[i];
            let shared = small_batch(&v.clients[0], &names, &data)
                .map_err(|e| format!("{}: {e}", v.name))?;
            let socket = small_batch(&v.clients[1], &names, &data)
                .map_err(|e| format!("{}: {e}", v.name))?;
            if rep >= 0 {
                for (s, x) in v.samples.iter_mut().zip(shared.iter().chain([&socket[2]])) {
                    s.push(*x);
                }
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    let scraped = scraper
        .join()
        .map_err(|_| "the scraper thread panicked".to_string())??;
    let table = markdown(&variants, scraped);
    let json = json!({
        "reps": cfg.reps,
        "ops_per_batch": cfg.ops,
        "scrapes": scraped,
        "variants": variants.iter().map(|v| json!({
            "name": v.name,
            "ops": OPS.iter().zip(&v.samples).map(|(op, s)| json!({
                "op": op, "median_us": median(s), "samples_us": s,
            })).collect::<Vec<Value>>(),
        })).collect::<Vec<Value>>(),
    });
    let path = cfg.out.join("metrics_cost.json");
    std::fs::write(&path, format!("{json:#}")).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(table)
}

/// The `metrics_addr=` a daemon logged at start.
fn metrics_addr(log: &Path) -> Result<SocketAddr, String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(addr) = text
            .split_whitespace()
            .find_map(|w| w.strip_prefix("metrics_addr=")?.parse().ok())
        {
            return Ok(addr);
        }
        if Instant::now() > deadline {
            return Err(format!("no metrics_addr in {}:\n{text}", log.display()));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// GET /metrics once a second until `stop`; every scrape must be a 200.
fn scrape_every_second(
    addr: SocketAddr,
    scrapes: &AtomicU64,
    stop: &AtomicBool,
) -> Result<u64, String> {
    while !stop.load(Ordering::Relaxed) {
        let mut s = TcpStream::connect(addr).map_err(|e| format!("scrape: {e}"))?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
            .map_err(|e| format!("scrape: {e}"))?;
        let mut response = Vec::new();
        s.read_to_end(&mut response)
            .map_err(|e| format!("scrape: {e}"))?;
        if !response.starts_with(b"HTTP/1.1 200") {
            return Err(format!(
                "scrape answered {:?}",
                String::from_utf8_lossy(&response[..response.len().min(80)])
            ));
        }
        scrapes.fetch_add(1, Ordering::Relaxed);
        let until = Instant::now() + Duration::from_secs(1);
        while Instant::now() < until && !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    Ok(scrapes.load(Ordering::Relaxed))
}

fn markdown(variants: &[Variant], scrapes: u64) -> String {
    let mut t = String::from("| op (µs, median) |");
    for v in variants {
        t.push_str(&format!(" {} |", v.name));
    }
    t.push_str(" on/off |");
    if variants.len() > 2 {
        t.push_str(" off/before |");
    }
    t.push('\n');
    t.push_str(&"|---".repeat(variants.len() + 1 + variants.len().saturating_sub(1)));
    t.push_str("|\n");
    for (i, op) in OPS.iter().enumerate() {
        let m: Vec<Option<f64>> = variants.iter().map(|v| median(&v.samples[i])).collect();
        t.push_str(&format!("| {op} |"));
        for x in &m {
            t.push_str(&x.map_or(" - |".into(), |x| format!(" {x:.2} |")));
        }
        let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) if b > 0.0 => format!(" {:.2}x |", a / b),
            _ => " - |".into(),
        };
        t.push_str(&ratio(m[1], m[0]));
        if variants.len() > 2 {
            t.push_str(&ratio(m[0], m[2]));
        }
        t.push('\n');
    }
    t.push_str(&format!(
        "\n`on` was scraped {scrapes} times (every second) during the run.\n"
    ));
    t
}
