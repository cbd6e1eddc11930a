//! Reliability probes run on both stores (`benches/probes.py`): a client SIGKILLed mid-create,
//! while holding an object, while blocked in a get; the store full of held objects; a flood of
//! connections; bad input in each store's own framing. Each probe runs on a fresh daemon of
//! each store (same memory limit, same `ulimit -n 1024`, the default of many systems, so a
//! flood reaches the limit), and the harness watches whether the daemon survived it.
//!
//! vovp's results are functional checks (a failed one fails the run); Plasma's are reported
//! beside them.

use std::fmt::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::procs::{self, Daemon};
use crate::report::Report;
use crate::MIB;

/// (probe name in probes.py, what it does, Plasma's test it follows, when there is one).
pub const PROBES: &[(&str, &str, &str)] = &[
    (
        "kill_mid_create",
        "client SIGKILLed between create and seal (60 % of the store, half written)",
        "",
    ),
    (
        "kill_holding",
        "client SIGKILLed while it holds a got object (60 % of the store)",
        "",
    ),
    (
        "kill_in_get",
        "client SIGKILLed while blocked in a get of a missing object",
        "test_client_death_during_get",
    ),
    (
        "store_full",
        "store full of held objects, one more create",
        "test_store_full",
    ),
    (
        "connection_flood",
        "1500 clients connect and stay (daemon under ulimit -n 1024)",
        "",
    ),
    (
        "unknown_message",
        "one frame of an unknown message type",
        "",
    ),
    ("garbage", "1 KiB of random bytes on a connection", ""),
    ("bad_length", "a frame header claiming a huge payload", ""),
];

const CAPACITY: u64 = 64 * MIB;
const NOFILE: u32 = 1024;

struct Outcome {
    ok: bool,
    text: String,
    survived: bool,
    json: Value,
}

fn run_one(
    root: &Path,
    python: &Path,
    store: &str,
    program: &Path,
    probe: &str,
    run_dir: &Path,
    out_dir: &Path,
) -> Outcome {
    let socket = run_dir.join(format!("probe-{store}.sock"));
    let log = out_dir.join(format!("probe-{store}-{probe}.log"));
    // The same fd limit for both daemons: `prlimit` sets soft and hard before exec.
    let mut args = vec![
        format!("--nofile={NOFILE}:{NOFILE}"),
        program.display().to_string(),
        "-m".into(),
        CAPACITY.to_string(),
        "-s".into(),
        socket.display().to_string(),
    ];
    if store == "vovp" {
        args.extend(["--log-level".into(), "warn".into()]);
    }
    let name = if store == "vovp" {
        "vovp-engine (probe)"
    } else {
        "plasma-store-server (probe)"
    };
    let mut daemon = match Daemon::start(name, Path::new("prlimit"), &args, &socket, &log) {
        Ok(d) => d,
        Err(e) => {
            return Outcome {
                ok: false,
                text: format!("daemon did not start: {e}"),
                survived: false,
                json: Value::Null,
            }
        }
    };
    let out = out_dir.join(format!("probe-{store}-{probe}.json"));
    let mut pythonpath = root.join("python").into_os_string();
    if let Some(old) = std::env::var_os("PYTHONPATH") {
        pythonpath.push(":");
        pythonpath.push(old);
    }
    let stdout = std::fs::File::create(&out);
    let mut cmd = Command::new(python);
    cmd.arg(root.join("benches/probes.py"))
        .args(["--store", store, "--probe", probe])
        .arg("--socket")
        .arg(&socket)
        .args(["--capacity", &CAPACITY.to_string()])
        .env("PYTHONPATH", pythonpath)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit());
    if let Ok(f) = stdout {
        cmd.stdout(f);
    }
    let status = procs::run_with_timeout(&mut cmd, Duration::from_secs(90));
    // Give a crashing daemon a moment to be seen dead.
    std::thread::sleep(Duration::from_millis(200));
    let died = daemon.exited();
    let v: Value = std::fs::read_to_string(&out)
        .ok()
        .and_then(|t| serde_json::from_str(t.lines().last()?).ok())
        .unwrap_or(Value::Null);
    let mut text = v["outcome"].as_str().unwrap_or("").to_string();
    if text.is_empty() {
        text = match &status {
            Ok(s) => format!("probe gave no result (exit {s})"),
            Err(e) => format!("probe gave no result: {e}"),
        };
    }
    if let Some(s) = died {
        // Its last words: an assertion or an uncaught exception, else its last line.
        let log = std::fs::read_to_string(&daemon.log).unwrap_or_default();
        let last = log
            .lines()
            .find(|l| {
                ["Check failed", "what()", "panicked", "ERROR"]
                    .iter()
                    .any(|k| l.contains(k))
            })
            .or_else(|| log.lines().rev().find(|l| !l.trim().is_empty()))
            .unwrap_or("");
        let _ = write!(text, "; THE DAEMON DIED ({s}): {}", last.trim());
    }
    Outcome {
        ok: v["ok"].as_bool().unwrap_or(false) && died.is_none(),
        text,
        survived: died.is_none(),
        json: v,
    }
}

/// Runs every probe on both stores; vovp's results become checks in `report`. Writes
/// `probes.json` and returns its content.
pub fn run(
    root: &Path,
    python: &Path,
    engine_bin: &Path,
    plasma_bin: &Path,
    run_dir: &Path,
    out_dir: &Path,
    report: &mut Report,
) -> Value {
    let t = Instant::now();
    let mut rows = Vec::new();
    for &(probe, what, anchor) in PROBES {
        let v = run_one(root, python, "vovp", engine_bin, probe, run_dir, out_dir);
        let p = run_one(root, python, "plasma", plasma_bin, probe, run_dir, out_dir);
        eprintln!(
            "vovp-bench: probe {probe}: vovp: {}; Plasma: {}",
            v.text, p.text
        );
        report.check(
            format!("Probe (vovp): {what}"),
            v.ok,
            format!("vovp: {}. Plasma: {}", v.text, p.text),
        );
        rows.push(json!({
            "probe": probe, "what": what, "plasma_test": anchor,
            "vovp": {"ok": v.ok, "outcome": v.text, "daemon_survived": v.survived, "raw": v.json},
            "plasma": {"ok": p.ok, "outcome": p.text, "daemon_survived": p.survived, "raw": p.json},
        }));
    }
    let result = json!({
        "capacity_bytes": CAPACITY,
        "nofile": NOFILE,
        "seconds": t.elapsed().as_secs_f64(),
        "probes": rows,
    });
    let path = out_dir.join("probes.json");
    if let Err(e) = std::fs::write(
        &path,
        serde_json::to_string_pretty(&result).unwrap_or_default(),
    ) {
        report.errors.push(format!("{}: {e}", path.display()));
    }
    eprintln!("vovp-bench: probes took {:.0} s", t.elapsed().as_secs_f64());
    result
}
