//! `vovp-bench --metrics-cost`: what the metrics cost the small operations. The Rust
//! client's small-op batch ([`crate::rust_level::small_batch`]: 64 B put, contains,
//! get+release, delete) against daemons that differ only in the metrics, in one run,
//! repetitions interleaved (the order rotates and reverses) so a slow patch of the machine hits
//! all alike:
//!
//! * `off`: no `--metrics` (the connection layer still counts: its counters are always on);
//! * `on`: `--metrics 127.0.0.1:0`, scraped every second by a thread of this process for the
//!   whole run (what a Prometheus server does, 15 times more often);
//! * `off again`: a second daemon exactly like `off`, the control: `off again / off` is what
//!   two identical daemons differ by in this run (the noise floor of the other ratios);
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
/// `metrics_cost.json` in `cfg.out`).
pub fn run(cfg: &CostConfig) -> Result<String, String> {
    let mut plan: Vec<(&'static str, &Path, Vec<String>)> = vec![
        ("off", &cfg.engine, vec![]),
        (
            "on",
            &cfg.engine,
            vec!["--metrics".into(), "127.0.0.1:0".into()],
        ),
        ("off again", &cfg.engine, vec![]),
    ];
    if let Some(b) = &cfg.baseline {
        plan.push(("before", b, vec![]));
    }
    let mut variants = Vec::new();
    for (name, program, extra) in plan {
        let file = name.replace(' ', "-");
        let socket = cfg.out.join(format!("metrics-cost-{file}.sock"));
        let log = cfg.out.join(format!("metrics-cost-{file}.log"));
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
    // Repetition -1 warms up connections and caches; it is not recorded. The order rotates,
    // and reverses every other cycle, so no variant always follows the same one.
    let n = variants.len() as i64;
    for rep in -1..cfg.reps as i64 {
        let mut order: Vec<usize> = (0..variants.len()).collect();
        order.rotate_left(rep.rem_euclid(n) as usize);
        if rep.div_euclid(n) % 2 == 1 {
            order.reverse();
        }
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
    // (column, numerator, denominator) by variant index: on/off, the control, off/before.
    let mut ratios = vec![("on/off", 1, 0), ("off again/off", 2, 0)];
    if variants.len() > 3 {
        ratios.push(("off/before", 0, 3));
    }
    let mut t = String::from("| op (µs, median) |");
    for v in variants {
        t.push_str(&format!(" {} |", v.name));
    }
    for (name, _, _) in &ratios {
        t.push_str(&format!(" {name} |"));
    }
    t.push('\n');
    t.push_str(&"|---".repeat(1 + variants.len() + ratios.len()));
    t.push_str("|\n");
    for (i, op) in OPS.iter().enumerate() {
        let m: Vec<Option<f64>> = variants.iter().map(|v| median(&v.samples[i])).collect();
        t.push_str(&format!("| {op} |"));
        for x in &m {
            t.push_str(&x.map_or(" - |".into(), |x| format!(" {x:.2} |")));
        }
        for &(_, a, b) in &ratios {
            t.push_str(&match (m[a], m[b]) {
                (Some(a), Some(b)) if b > 0.0 => format!(" {:.2}x |", a / b),
                _ => " - |".into(),
            });
        }
        t.push('\n');
    }
    t.push_str(&format!(
        "\n`on` was scraped {scrapes} times (every second) during the run.\n"
    ));
    t
}
