//! The soak's spill phase (issue 45): after the crowd, a daemon of the soak's size with
//! `--spill-dir` takes three times its memory from two writer threads, while four reader
//! threads keep getting every name written so far in their own random order; every read is
//! checked byte for byte against what its name promises, the memfds' pages are sampled all
//! along (they must stay within `-m` + 64 pages, as in the soak), and nothing may be evicted
//! or lost. The daemon's SIGTERM must leave the spill directory without a spill file.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use vovp::Store;
use vovp_client::Client;
use vovp_tests::memfd::object_memfd_bytes;
use vovp_tests::{fnv, pattern};

use super::harness::Places;
use super::SoakConfig;
use crate::report::Report;

const PAGE: u64 = 4096;
const SLACK_PAGES: u64 = 64;

/// Runs the phase; adds its checks to `report` and returns its summary.
pub(super) fn run(
    cfg: &SoakConfig,
    places: &Places<'_>,
    report: &mut Report,
) -> Result<Value, String> {
    let dir = places.run_dir.join("soak-spill");
    let _ = std::fs::remove_dir_all(&dir);
    let spill_dir = ["--spill-dir".into(), dir.display().to_string()];
    let (mut daemon, socket) = places.start_daemon(
        cfg,
        "soak-spill",
        "vovp-engine (soak, spilling)",
        &spill_dir,
    )?;
    let pid = daemon.pid();
    let started = Instant::now();
    let sizes = [cfg.max_size, cfg.max_size / 3, 48 << 10, 1 << 10];
    let names: Arc<Mutex<Vec<(String, usize, u32)>>> = Arc::default();
    let (bad, reads, errors) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(Mutex::new(Vec::<String>::new())),
    );
    let writing = Arc::new(AtomicBool::new(true));
    let target = 3 * cfg.capacity;
    let written = Arc::new(AtomicU64::new(0));
    let writers: Vec<_> = (0..2u32)
        .map(|w| {
            let (socket, names, written, errors) = (
                socket.clone(),
                names.clone(),
                written.clone(),
                errors.clone(),
            );
            std::thread::spawn(move || {
                let Some(c) = connect(&socket, &errors) else {
                    return;
                };
                let mut i = 0u32;
                while written.load(Ordering::Relaxed) < target {
                    let size = sizes[(i as usize + w as usize) % sizes.len()];
                    let seed = w * 1_000_000 + i;
                    let name = format!("spill/{w}/{i}");
                    if let Err(e) = c
                        .put(&name, &pattern(size, seed), b"", Default::default())
                        .and_then(|()| c.sync())
                    {
                        record(&errors, format!("put {name}: {e}"));
                        return;
                    }
                    written.fetch_add(size as u64, Ordering::Relaxed);
                    let _ = names.lock().map(|mut v| v.push((name, size, seed)));
                    i += 1;
                }
            })
        })
        .collect();
    let readers: Vec<_> = (0..4u64)
        .map(|r| {
            let (socket, names, writing, bad, reads, errors) = (
                socket.clone(),
                names.clone(),
                writing.clone(),
                bad.clone(),
                reads.clone(),
                errors.clone(),
            );
            std::thread::spawn(move || {
                let Some(c) = connect(&socket, &errors) else {
                    return;
                };
                let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (r + 1);
                // While the writers write, then one last pass over every name.
                let mut last = false;
                loop {
                    let known = names.lock().map(|v| v.clone()).unwrap_or_default();
                    let mut order: Vec<usize> = (0..known.len()).collect();
                    for i in (1..order.len()).rev() {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        order.swap(i, (x % (i as u64 + 1)) as usize);
                    }
                    for &k in &order {
                        let (name, size, seed) = &known[k];
                        match c.get_one(name, None) {
                            Ok(v) => {
                                if v.len() != *size || fnv(&v) != fnv(&pattern(*size, *seed)) {
                                    bad.fetch_add(1, Ordering::Relaxed);
                                }
                                reads.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => {
                                record(&errors, format!("get {name}: {e}"));
                                bad.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    if last {
                        return;
                    }
                    last = !writing.load(Ordering::Relaxed);
                }
            })
        })
        .collect();
    // Sample the memfds' pages while it runs.
    let (mut peak, mut samples) = (0u64, 0);
    join_sampling(writers, pid, &mut peak, &mut samples);
    writing.store(false, Ordering::Relaxed);
    join_sampling(readers, pid, &mut peak, &mut samples);
    let stats = Client::connect(&socket)
        .and_then(|c| c.stats())
        .map_err(|e| format!("spill phase stats: {e}"))?;
    let term = daemon.stop();
    let left = std::fs::read_dir(&dir)
        .map(|rd| {
            rd.filter(|e| {
                e.as_ref()
                    .is_ok_and(|e| e.file_name().to_string_lossy().ends_with(".spill"))
            })
            .count()
        })
        .unwrap_or(0);
    let _ = std::fs::remove_dir_all(&dir);
    let errors = errors.lock().map(|v| v.clone()).unwrap_or_default();
    let (bad, reads) = (bad.load(Ordering::Relaxed), reads.load(Ordering::Relaxed));
    let objects = names.lock().map(|v| v.len()).unwrap_or(0);
    let bound = cfg.capacity + SLACK_PAGES * PAGE;
    let mut check = |name: &str, ok: bool, detail: String| {
        report.check(format!("Soak: spill phase: {name}"), ok, detail)
    };
    check(
        "three times the memory written, every read bit-exact, nothing lost",
        bad == 0 && errors.is_empty() && stats.spills > 0 && stats.restores > 0,
        format!(
            "{objects} objects ({} MiB) into {} MiB; {reads} reads, {bad} wrong or failed; {} \
             spills, {} restores{}",
            written.load(Ordering::Relaxed) >> 20,
            cfg.capacity >> 20,
            stats.spills,
            stats.restores,
            errors
                .first()
                .map(|e| format!("; first error: {e}"))
                .unwrap_or_default()
        ),
    );
    check(
        "nothing evicted, no spill or restore failure",
        stats.evicted_objects == 0 && stats.spill_failures == 0 && stats.restore_failures == 0,
        format!(
            "evicted {}, spill failures {}, restore failures {}",
            stats.evicted_objects, stats.spill_failures, stats.restore_failures
        ),
    );
    check(
        "the memfds' pages stayed within -m + 64 pages while spilling",
        peak <= bound,
        format!("peak {peak} bytes over {samples} samples; bound {bound}"),
    );
    check(
        "a clean stop left no spill file",
        term.is_some_and(|s| s.success()) && left == 0,
        format!("exit {term:?}, {left} spill files left"),
    );
    Ok(json!({
        "seconds": started.elapsed().as_secs_f64(),
        "objects": objects,
        "reads": reads,
        "bad": bad,
        "spills": stats.spills,
        "restores": stats.restores,
        "peak_memfd_bytes": peak,
        "memfd_bound": bound,
    }))
}

/// The errors the phase's threads ran into, for its report.
type Errors = Arc<Mutex<Vec<String>>>;

fn record(errors: &Errors, e: String) {
    let _ = errors.lock().map(|mut v| v.push(e));
}

/// A client of the phase's daemon, or `None` with the error recorded.
fn connect(socket: &Path, errors: &Errors) -> Option<Client> {
    Client::connect(socket)
        .map_err(|e| record(errors, format!("connect: {e}")))
        .ok()
}

/// Waits for `threads`, sampling the daemon's memfd pages every 100 ms meanwhile.
fn join_sampling(threads: Vec<JoinHandle<()>>, pid: u32, peak: &mut u64, samples: &mut u64) {
    while threads.iter().any(|t| !t.is_finished()) {
        *peak = (*peak).max(object_memfd_bytes(pid));
        *samples += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    for t in threads {
        let _ = t.join();
    }
}
