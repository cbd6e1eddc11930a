//! `vovp-bench`: runs the benchmark suite and reports vovp against Plasma and the machine.
//!
//!     cargo build --release --workspace --bins
//!     cargo run --release -p vovp-bench -- --quick     # CI: a few minutes
//!     cargo run --release -p vovp-bench -- --full      # for BENCHMARKS.md
//!
//! Exit status: 0 when every workload ran and every functional check passed (performance
//! targets are reported as PASS/FAIL but never fail the run), 1 when a store failed or a check
//! did, 2 when the run could not start (missing binaries, setup failure, bad arguments).

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant, SystemTime};

use serde_json::{json, Value};
use vovp_bench::procs::{self, Daemon};
use vovp_bench::report::{Check, Peers, Report, Row};
use vovp_bench::rust_level::{self, RustConfig, Stores};
use vovp_bench::{probes, soak, GIB};

const USAGE: &str =
    "usage: vovp-bench --quick|--full [--skip-python] [--skip-rust] [--only LIST] [--cpus LIST]
                  [--peers LIST] [--soak-only|--skip-soak]
       vovp-bench --cluster
       vovp-bench --weights [--quick]
       vovp-bench --transfer [--quick|--full]
       vovp-bench --metrics-cost [--quick|--full] [--baseline-engine PATH]
       vovp-bench --spill [--quick|--full]

  --quick        short run (CI): no 1 GiB objects, fewer repetitions
  --full         the run behind BENCHMARKS.md (about 10 minutes on 2 cores)
  --skip-python  only the Rust-level workloads (no Plasma, no Python driver)
  --skip-rust    only the Python-level workloads
  --only LIST    only these Python-level workloads, e.g. `--only torch,loader` (names: small,
                 large, get, handoff, mp, evict, dropin, peers, torch, loader; default all)
  --peers LIST   the stores the `peers` workload (vovp against every peer, side by side in
                 one run: benches/peers.py) compares vovp with, e.g. `--peers ray,shm`
                 (names: plasma, ray, vineyard, shm, torch; default all). A peer that cannot
                 start is reported with its reason and the others run; `--peers ''` runs
                 vovp's own columns only
  --cpus LIST    run everything (harness, daemons, driver) on these CPUs, e.g. `--cpus 0`:
                 a diagnosis aid, the placement of clients and daemons decides small-op latency
  --soak-only    only the reliability section: the soak (30 s quick, 10 min full) and the
                 probes run on both stores (no Plasma probes with --skip-python)
  --skip-soak    no reliability section
  --cluster      vovp.cluster against Ray's own transfer on a local 3-node Ray cluster
                 (benches/cluster.py, run by the test venv's python: .venv or $VOVP_VENV,
                 which ./scripts/test.sh creates with Ray); writes target/bench/cluster.json
  --weights      only the weight-sync benchmark (benches/weights.py): a writer replaces a
                 64 / 256 MiB state (1 / 16 MiB with --quick), N readers follow it; vovp's
                 replace against delete + put and against Ray (the test venv's python, as for
                 --cluster); writes target/bench/weights.json. --full runs it too (with Ray
                 when the test venv exists), --quick runs its vovp variants at the quick sizes
  --transfer     only the engine-to-engine section: FETCH of 1 / 64 / 256 MiB between two
                 daemons on loopback against the loopback TCP limit measured beside it (one
                 stream and 4), and the receiving daemon's small-get p99 during a 256 MiB
                 (quick) or 1 GiB (full) fetch; --quick and --full run it too. Writes
                 target/bench/transfer.json
  --metrics-cost only what the metrics cost: the Rust client's 64 B put/contains/get/delete
                 against daemons without and with --metrics (scraped every second), in one
                 run, interleaved; with --baseline-engine PATH also against that build (e.g.
                 the commit before the metrics). Writes target/bench/metrics_cost.json.
                 --quick and --full runs include it (5 x 1000 ops quick, 21 x 5000 full)
  --spill        spilling (--spill-dir) against the disk's own sequential write and read, a
                 get of a spilled 64 MiB object against a fresh file read, other clients'
                 GET p99 meanwhile (a 256 MiB store with --quick, 1 GiB with --full), and
                 the 3x-memory workload against Ray's object store with the same memory
                 (benches/spill.py, with the test venv's python when it has Ray). Writes
                 target/bench/spill.json and spill_ray.json

Needs `cargo build --release --workspace --bins` first. Writes target/bench/results.json,
target/bench/results.md, target/bench/throughput.png and (with the peers workload)
target/bench/peers.png.";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Quick,
    Full,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Quick => "quick",
            Mode::Full => "full",
        }
    }

    /// Memory limit of both daemons (and of the embedded engine). Full mode needs room for a
    /// 1 GiB object next to leftovers; quick mode's largest object is 256 MiB.
    fn capacity(self) -> u64 {
        match self {
            Mode::Quick => GIB,
            Mode::Full => 2 * GIB,
        }
    }

    /// The whole run is killed after this (a hung store must not hang CI).
    fn deadline(self) -> Duration {
        match self {
            Mode::Quick => Duration::from_secs(10 * 60),
            Mode::Full => Duration::from_secs(45 * 60),
        }
    }
}

struct Args {
    mode: Mode,
    python: bool,
    rust: bool,
    cpus: Option<Vec<usize>>,
    /// The performance workloads (off with --soak-only).
    perf: bool,
    /// The reliability section: soak and probes (off with --skip-soak).
    soak: bool,
    only: Option<String>,
    /// --peers: the peers workload's stores besides vovp (None: all).
    peers: Option<String>,
    /// --cluster: only the cluster benchmark.
    cluster: bool,
    /// --weights: only the weight-sync benchmark.
    weights: bool,
    /// --metrics-cost: only the metrics' cost.
    metrics_cost: bool,
    /// --transfer: only the engine-to-engine section.
    transfer: bool,
    /// --baseline-engine: the build `--metrics-cost` also compares with.
    baseline_engine: Option<PathBuf>,
    /// --spill: only the spilling measurements.
    spill: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut mode = None;
    let (mut python, mut rust) = (true, true);
    let mut cpus = None;
    let (mut perf, mut soak) = (true, true);
    let mut only = None;
    let mut peers = None;
    let mut cluster = false;
    let mut weights = false;
    let mut metrics_cost = false;
    let mut transfer = false;
    let mut baseline_engine = None;
    let mut spill = false;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--cpus" => {
                let list = it.next().ok_or("--cpus needs a list like 0 or 0,1")?;
                let parsed: Result<Vec<usize>, _> =
                    list.split(',').map(|c| c.trim().parse::<usize>()).collect();
                cpus = Some(parsed.map_err(|_| format!("--cpus {list:?}: say e.g. 0 or 0,1"))?);
            }
            "--only" => only = Some(it.next().ok_or("--only needs a list like torch,loader")?),
            "--peers" => {
                let list = it
                    .next()
                    .ok_or("--peers needs a list like ray,vineyard,shm")?;
                let unknown: Vec<&str> = list
                    .split(',')
                    .filter(|p| !p.is_empty() && !PEERS.contains(p))
                    .collect();
                if !unknown.is_empty() {
                    return Err(format!(
                        "--peers: unknown {unknown:?}; say some of {}",
                        PEERS.join(",")
                    ));
                }
                peers = Some(list);
            }
            "--quick" => mode = Some(Mode::Quick),
            "--full" => mode = Some(Mode::Full),
            "--skip-python" => python = false,
            "--skip-rust" => rust = false,
            "--soak-only" => perf = false,
            "--skip-soak" => soak = false,
            "--cluster" => cluster = true,
            "--weights" => weights = true,
            "--metrics-cost" => metrics_cost = true,
            "--transfer" => transfer = true,
            "--spill" => spill = true,
            "--baseline-engine" => {
                baseline_engine = Some(PathBuf::from(
                    it.next()
                        .ok_or("--baseline-engine needs a vovp-engine binary")?,
                ))
            }
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    // --cluster has one size of its own; --weights alone is the full-size run.
    let mode = mode
        .or(cluster.then_some(Mode::Quick))
        .or(weights.then_some(Mode::Full))
        .or(metrics_cost.then_some(Mode::Quick))
        .or(transfer.then_some(Mode::Quick))
        .or(spill.then_some(Mode::Quick))
        .ok_or("say --quick or --full")?;
    Ok(Args {
        mode,
        python,
        rust,
        cpus,
        perf,
        soak,
        only,
        peers,
        cluster,
        weights,
        metrics_cost,
        transfer,
        baseline_engine,
        spill,
    })
}

/// The peers `--peers` names (benches/peers.py, PEER_NAMES).
const PEERS: [&str; 5] = ["plasma", "ray", "vineyard", "shm", "torch"];

/// The test venv's python (.venv, or $VOVP_VENV): the one with Ray, which the benchmark venv
/// with pyarrow 11 does not carry.
fn test_venv_python(paths: &Paths) -> PathBuf {
    let venv = std::env::var_os("VOVP_VENV")
        .map(PathBuf::from)
        .map(|v| {
            if v.is_absolute() {
                v
            } else {
                paths.root.join(v)
            }
        })
        .unwrap_or_else(|| paths.root.join(".venv"));
    venv.join("bin").join("python")
}

/// The test venv's python for `option`, or the reason it cannot run (printed; exit code 2).
fn test_venv_python_for(paths: &Paths, option: &str) -> Result<PathBuf, ExitCode> {
    let python = test_venv_python(paths);
    if !python.is_file() {
        eprintln!(
            "vovp-bench: {option} needs {} with ray, numpy and vovp installed: run \
             ./scripts/test.sh once, or set VOVP_VENV",
            python.display()
        );
        return Err(ExitCode::from(2));
    }
    Ok(python)
}

/// `--cluster`: benches/cluster.py under the test venv's python (it needs Ray).
fn run_cluster(paths: &Paths, engine_bin: &Path) -> ExitCode {
    let python = match test_venv_python_for(paths, "--cluster") {
        Ok(p) => p,
        Err(code) => return code,
    };
    // The loopback limit of this machine, measured in the same run: the engines' 256 MiB
    // fetches between nodes are reported against it (issue 44's 70 % target).
    let loopback = match vovp_bench::transfer::loopback_limit_gbps(256 << 20, 5) {
        Ok(gbps) => gbps,
        Err(e) => {
            eprintln!("vovp-bench: the loopback limit could not be measured: {e}");
            return ExitCode::FAILURE;
        }
    };
    let status = std::process::Command::new(&python)
        .arg(paths.root.join("benches").join("cluster.py"))
        .arg("--engine")
        .arg(engine_bin)
        .arg("--out")
        .arg(paths.out.join("cluster.json"))
        .arg("--loopback-gbps")
        .arg(format!("{loopback:.3}"))
        .status();
    match status {
        Ok(s) if s.success() => ExitCode::SUCCESS,
        Ok(s) => {
            eprintln!("vovp-bench: benches/cluster.py failed ({s})");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("vovp-bench: cannot run {}: {e}", python.display());
            ExitCode::FAILURE
        }
    }
}

/// benches/weights.py, the weight-sync benchmark: under `python` (with Ray unless `ray` is
/// false), its JSON (target/bench/weights.json) back. The script starts a daemon of its own.
fn run_weights(
    paths: &Paths,
    python: &Path,
    engine_bin: &Path,
    mode: Mode,
    ray: bool,
) -> Result<Value, String> {
    let out = paths.out.join("weights.json");
    let _ = std::fs::remove_file(&out);
    // The working tree's client first, whatever the venv has installed.
    let mut pythonpath = paths.root.join("python").into_os_string();
    if let Some(old) = std::env::var_os("PYTHONPATH") {
        pythonpath.push(":");
        pythonpath.push(old);
    }
    let mut cmd = Command::new(python);
    cmd.arg(paths.root.join("benches/weights.py"))
        .args(["--mode", mode.name()])
        .arg("--engine")
        .arg(engine_bin)
        .arg("--out")
        .arg(&out)
        .env("PYTHONPATH", pythonpath)
        .stdin(Stdio::null());
    if !ray {
        cmd.arg("--no-ray");
    }
    let limit = match mode {
        Mode::Quick => Duration::from_secs(2 * 60),
        Mode::Full => Duration::from_secs(15 * 60),
    };
    let status = procs::run_with_timeout(&mut cmd, limit)?;
    let text = std::fs::read_to_string(&out).map_err(|e| {
        format!(
            "no {} ({e}); weights.py exited with {status}",
            out.display()
        )
    })?;
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("weights.json: {e}"))?;
    if let Some(e) = v["error"].as_str() {
        return Err(e.to_string());
    }
    if !status.success() && v["checks"].as_array().is_none_or(|c| c.is_empty()) {
        return Err(format!("weights.py exited with {status}"));
    }
    Ok(v)
}

/// `--weights`: the weight-sync benchmark alone, with Ray (the test venv's python).
fn run_weights_alone(paths: &Paths, engine_bin: &Path, mode: Mode) -> ExitCode {
    let python = match test_venv_python_for(paths, "--weights") {
        Ok(p) => p,
        Err(code) => return code,
    };
    if let Err(e) = std::fs::create_dir_all(&paths.out) {
        eprintln!("vovp-bench: {}: {e}", paths.out.display());
        return ExitCode::from(2);
    }
    match run_weights(paths, &python, engine_bin, mode, true) {
        Ok(v) if python_checks(&v).iter().all(|c| c.ok) => ExitCode::SUCCESS,
        Ok(_) => {
            eprintln!("vovp-bench: FAILED: a weight-sync check failed (see above)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("vovp-bench: benches/weights.py failed: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `--metrics-cost`: the table on stdout, the samples in target/bench/metrics_cost.json.
fn run_metrics_cost(paths: &Paths, engine_bin: &Path, args: &Args) -> ExitCode {
    if let Err(e) = std::fs::create_dir_all(&paths.out) {
        eprintln!("vovp-bench: {}: {e}", paths.out.display());
        return ExitCode::from(2);
    }
    match vovp_bench::metrics_cost::run(&cost_config(paths, engine_bin, args, (9, 2000))) {
        Ok(table) => {
            println!("{table}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("vovp-bench: --metrics-cost: {e}");
            ExitCode::FAILURE
        }
    }
}

fn transfer_config(mode: Mode) -> vovp_bench::transfer::TransferConfig {
    match mode {
        Mode::Quick => vovp_bench::transfer::TransferConfig::quick(),
        Mode::Full => vovp_bench::transfer::TransferConfig::full(),
    }
}

/// `--transfer`: the engine-to-engine section alone, its limits, rows and targets printed.
fn run_transfer_alone(paths: &Paths, engine_bin: &Path, mode: Mode) -> ExitCode {
    let run_dir = std::env::temp_dir().join(format!("vovp-bench-{}", std::process::id()));
    if let Err(e) = std::fs::create_dir_all(&paths.out).and(std::fs::create_dir_all(&run_dir)) {
        eprintln!("vovp-bench: {e}");
        return ExitCode::from(2);
    }
    let mut report = Report::default();
    let cfg = transfer_config(mode);
    if let Err(e) = vovp_bench::transfer::run(&cfg, engine_bin, &run_dir, &paths.out, &mut report) {
        report.errors.push(format!("engine to engine: {e}"));
    }
    let _ = std::fs::remove_dir_all(&run_dir);
    report.evaluate_targets();
    // The other sections' targets are not measured here.
    report.targets.retain(|t| t.pass.is_some());
    println!("{}", report.markdown());
    let path = paths.out.join("transfer.json");
    let text = serde_json::to_string_pretty(&report.to_json(json!({ "mode": mode.name() })));
    if let Err(e) = std::fs::write(&path, text.unwrap_or_default()) {
        eprintln!("vovp-bench: {}: {e}", path.display());
    }
    if report.failed() {
        for e in &report.errors {
            eprintln!("vovp-bench: {e}");
        }
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

/// `--spill`: the targets on stdout (PASS/FAIL), the numbers in target/bench/spill.json; the
/// Ray comparison in spill_ray.json when the test venv has Ray.
fn run_spill(paths: &Paths, engine_bin: &Path, mode: Mode) -> ExitCode {
    if let Err(e) = std::fs::create_dir_all(&paths.out) {
        eprintln!("vovp-bench: {}: {e}", paths.out.display());
        return ExitCode::from(2);
    }
    let (memory, object) = match mode {
        Mode::Quick => (256 * vovp_bench::MIB, 16 * vovp_bench::MIB),
        Mode::Full => (GIB, 64 * vovp_bench::MIB),
    };
    let cfg = vovp_bench::spill::SpillBenchConfig {
        engine: engine_bin.to_owned(),
        memory,
        object,
        reps: 3,
        out: paths.out.clone(),
    };
    let mut failed = false;
    match vovp_bench::spill::run(&cfg) {
        Ok((table, _)) => println!("{table}"),
        Err(e) => {
            eprintln!("vovp-bench: --spill: {e}");
            failed = true;
        }
    }
    let python = test_venv_python(paths);
    let has_ray = python.is_file()
        && Command::new(&python)
            .args(["-c", "import ray, vovp"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
    if !has_ray {
        println!(
            "3x-memory workload against Ray: not run ({} has no Ray; ./scripts/test.sh makes \
             one)",
            python.display()
        );
    } else {
        let root = paths.out.join("spill-ray");
        let _ = std::fs::create_dir_all(&root);
        let out = paths.out.join("spill_ray.json");
        let status = Command::new(&python)
            .arg(paths.root.join("benches/spill.py"))
            .args([memory.to_string(), (16 * vovp_bench::MIB).to_string()])
            .arg(&root)
            .arg(&out)
            .env("VOVP_ENGINE_BIN", engine_bin)
            .status();
        let _ = std::fs::remove_dir_all(&root);
        let v: Value = std::fs::read(&out)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or(Value::Null);
        let (vt, rt) = (v["vovp"]["total_s"].as_f64(), v["ray"]["total_s"].as_f64());
        let lost = |s: &str| v[s]["objects"].as_u64() != v[s]["intact"].as_u64();
        match (status, vt, rt) {
            (Ok(st), Some(vt), Some(rt)) if st.success() => {
                let pass = vt <= 0.5 * rt && !lost("vovp") && !lost("ray");
                println!(
                    "| 3x memory put then get all: vovp / Ray total time | {:.2}× ({vt:.2} vs \
                     {rt:.2} s; intact {}/{} and {}/{}) | ≤ 0.50× | {} |",
                    vt / rt,
                    v["vovp"]["intact"],
                    v["vovp"]["objects"],
                    v["ray"]["intact"],
                    v["ray"]["objects"],
                    if pass { "PASS" } else { "FAIL" }
                );
                failed |= lost("vovp");
            }
            _ => println!("3x-memory workload against Ray did not complete: {v}"),
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// What `--metrics-cost` runs: `quick` (repetitions, ops per repetition) in quick mode, 21 of
/// 5000 in full mode.
fn cost_config(
    paths: &Paths,
    engine_bin: &Path,
    args: &Args,
    quick: (usize, usize),
) -> vovp_bench::metrics_cost::CostConfig {
    let (reps, ops) = match args.mode {
        Mode::Quick => quick,
        Mode::Full => (21, 5000),
    };
    vovp_bench::metrics_cost::CostConfig {
        engine: engine_bin.to_owned(),
        baseline: args.baseline_engine.clone(),
        reps,
        ops,
        out: paths.out.clone(),
    }
}

/// The checks of a Python driver's JSON (`checks`: name, ok, detail), as the report's.
fn python_checks(v: &Value) -> Vec<Check> {
    v["checks"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| Check {
            name: format!("Python: {}", c["name"].as_str().unwrap_or("?")),
            ok: c["ok"].as_bool().unwrap_or(false),
            detail: c["detail"].as_str().unwrap_or("").into(),
        })
        .collect()
}

/// Paths of this checkout.
struct Paths {
    root: PathBuf,
    release: PathBuf,
    out: PathBuf,
}

impl Paths {
    fn new() -> Paths {
        // benches/ is one level below the workspace root.
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("benches/ has a parent")
            .to_owned();
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .map(|t| if t.is_absolute() { t } else { root.join(t) })
            .unwrap_or_else(|| root.join("target"));
        Paths {
            release: target.join("release"),
            out: root.join("target").join("bench"),
            root,
        }
    }
}

fn main() -> ExitCode {
    // The soak's worker processes are this binary re-executed.
    if std::env::args().nth(1).as_deref() == Some(soak::WORKER_FLAG) {
        return soak::worker_main(std::env::args().skip(2).collect());
    }
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("vovp-bench: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    if let Some(cpus) = &args.cpus {
        // Before any thread or child exists: all of them inherit the mask.
        if let Err(e) = set_process_cpus(cpus) {
            eprintln!("vovp-bench: --cpus: {e}");
            return ExitCode::from(2);
        }
    }
    let started = Instant::now();
    let paths = Paths::new();
    let engine_bin = paths.release.join("vovp-engine");
    if !engine_bin.is_file() {
        eprintln!(
            "vovp-bench: {} not found. The harness builds nothing itself; build the daemon \
             first:\n\n    cargo build --release --workspace --bins\n",
            engine_bin.display()
        );
        return ExitCode::from(2);
    }
    warn_if_stale(&engine_bin, &paths.root);
    if args.cluster {
        return run_cluster(&paths, &engine_bin);
    }
    if args.weights {
        return run_weights_alone(&paths, &engine_bin, args.mode);
    }
    if args.metrics_cost {
        return run_metrics_cost(&paths, &engine_bin, &args);
    }
    if args.transfer {
        return run_transfer_alone(&paths, &engine_bin, args.mode);
    }
    if args.spill {
        return run_spill(&paths, &engine_bin, args.mode);
    }
    if let Err(e) = std::fs::create_dir_all(&paths.out) {
        eprintln!("vovp-bench: {}: {e}", paths.out.display());
        return ExitCode::from(2);
    }

    let mut setup_secs = 0.0;
    let python = if args.python {
        let t = Instant::now();
        match run_setup(&paths.root) {
            Ok(p) => {
                setup_secs = t.elapsed().as_secs_f64();
                Some(p)
            }
            Err(e) => {
                eprintln!("vovp-bench: setup failed: {e}");
                return ExitCode::from(2);
            }
        }
    } else {
        None
    };

    // A hung store must not hang the run: kill the children and fail after the deadline.
    // Counted from here: the first setup installs torch, whose download time says nothing
    // about the stores.
    let deadline = args.mode.deadline();
    std::thread::spawn(move || {
        std::thread::sleep(deadline);
        eprintln!(
            "vovp-bench: the run passed its {} s deadline; killing it",
            deadline.as_secs()
        );
        procs::kill_all();
        std::process::exit(1);
    });

    let mut report = Report::default();
    let capacity = args.mode.capacity();
    // Socket paths must stay short (108 bytes), so not under target/.
    let run_dir = std::env::temp_dir().join(format!("vovp-bench-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&run_dir);
    let vovp_daemon = match Daemon::start(
        "vovp-engine",
        &engine_bin,
        &[
            "-m".into(),
            capacity.to_string(),
            "-s".into(),
            run_dir.join("vovp.sock").display().to_string(),
            "--log-level".into(),
            "warn".into(),
        ],
        &run_dir.join("vovp.sock"),
        &paths.out.join("vovp-engine.log"),
    ) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("vovp-bench: {e}");
            return ExitCode::from(1);
        }
    };
    eprintln!(
        "vovp-bench: {} mode, both stores get {} bytes ({} GiB)",
        args.mode.name(),
        capacity,
        capacity / GIB
    );

    let mut daemons = vec![vovp_daemon];
    if args.rust && args.perf {
        let t = Instant::now();
        if let Err(e) = rust_workloads(args.mode, &daemons[0].socket, capacity, &mut report) {
            report.errors.push(format!("Rust-level workloads: {e}"));
        }
        eprintln!(
            "vovp-bench: Rust-level workloads took {:.0} s",
            t.elapsed().as_secs_f64()
        );
        let t = Instant::now();
        let cfg = transfer_config(args.mode);
        if let Err(e) =
            vovp_bench::transfer::run(&cfg, &engine_bin, &run_dir, &paths.out, &mut report)
        {
            report.errors.push(format!("engine to engine: {e}"));
        }
        eprintln!(
            "vovp-bench: engine-to-engine section took {:.0} s",
            t.elapsed().as_secs_f64()
        );
    }

    // The metrics' cost: the small ops against daemons with --metrics on and off, in one run
    // (a short pass in quick mode, so that CI runs it too).
    let mut metrics_md = String::new();
    if args.rust && args.perf && args.only.is_none() {
        let t = Instant::now();
        match vovp_bench::metrics_cost::run(&cost_config(&paths, &engine_bin, &args, (5, 1000))) {
            Ok(table) => metrics_md = table,
            Err(e) => report.errors.push(format!("metrics cost: {e}")),
        }
        eprintln!(
            "vovp-bench: the metrics' cost took {:.0} s",
            t.elapsed().as_secs_f64()
        );
    }

    let mut driver_info = Value::Null;
    if let Some(py) = python.as_ref().filter(|_| args.perf) {
        match Daemon::start(
            "plasma-store-server",
            &py.plasma,
            &[
                "-m".into(),
                capacity.to_string(),
                "-s".into(),
                run_dir.join("plasma.sock").display().to_string(),
            ],
            &run_dir.join("plasma.sock"),
            &paths.out.join("plasma-store.log"),
        ) {
            Ok(d) => {
                daemons.push(d);
                let t = Instant::now();
                match run_driver(
                    &paths,
                    py,
                    &args,
                    &daemons[0].socket,
                    &daemons[1].socket,
                    capacity,
                    &mut report,
                ) {
                    Ok(info) => driver_info = info,
                    Err(e) => report.errors.push(format!("Python driver: {e}")),
                }
                eprintln!(
                    "vovp-bench: Python-level workloads took {:.0} s",
                    t.elapsed().as_secs_f64()
                );
            }
            Err(e) => report.errors.push(e),
        }
    }

    // Weight sync (versions): quick mode runs the vovp variants under the benchmark venv (Ray's
    // start alone takes 20 s on 2 cores); full mode adds Ray where the test venv has it.
    let mut weights_md = String::new();
    if let Some(py) = python.as_ref().filter(|_| args.perf && args.only.is_none()) {
        let t = Instant::now();
        let test_python = test_venv_python(&paths);
        let (weights_python, ray) = match args.mode {
            Mode::Full if test_python.is_file() => (test_python, true),
            Mode::Full => {
                eprintln!(
                    "vovp-bench: warning: no {}: the weight-sync benchmark runs without Ray",
                    test_python.display()
                );
                (py.python.clone(), false)
            }
            Mode::Quick => (py.python.clone(), false),
        };
        match run_weights(&paths, &weights_python, &engine_bin, args.mode, ray) {
            Ok(v) => {
                report.checks.extend(python_checks(&v));
                weights_md = v["markdown"].as_str().unwrap_or("").to_string();
            }
            Err(e) => report.errors.push(format!("weight-sync benchmark: {e}")),
        }
        eprintln!(
            "vovp-bench: weight-sync benchmark took {:.0} s",
            t.elapsed().as_secs_f64()
        );
    }

    // Reliability: the soak on a daemon of its own, then the probes Plasma can run too.
    if args.soak {
        let t = Instant::now();
        let cfg = match args.mode {
            Mode::Quick => soak::SoakConfig::quick(),
            Mode::Full => soak::SoakConfig::full(),
        };
        if let Err(e) = soak::run(&cfg, &engine_bin, &run_dir, &paths.out, &mut report) {
            report.errors.push(format!("soak: {e}"));
        }
        if let Some(py) = &python {
            let (root, out) = (&paths.root, &paths.out);
            probes::run(
                root,
                &py.python,
                &engine_bin,
                &py.plasma,
                &run_dir,
                out,
                &mut report,
            );
        }
        eprintln!(
            "vovp-bench: reliability section took {:.0} s",
            t.elapsed().as_secs_f64()
        );
    }

    for d in daemons.iter_mut() {
        if let Some(status) = d.exited() {
            report.errors.push(format!(
                "{} died during the run ({status}); its log:\n{}",
                d.name,
                procs::read_tail(&d.log)
            ));
        }
    }
    drop(daemons);
    let _ = std::fs::remove_dir_all(&run_dir);

    report.evaluate_targets();
    let mut markdown = report.markdown();
    if !weights_md.is_empty() {
        markdown.push_str(&format!(
            "\n### Weight sync (versions, benches/weights.py)\n\n{weights_md}"
        ));
    }
    if !metrics_md.is_empty() {
        markdown.push_str(&format!(
            "\n### What the metrics cost (small ops, --metrics on and off)\n\n{metrics_md}"
        ));
    }
    let machine = machine_info();
    let total = started.elapsed().as_secs_f64();
    let mut command = format!(
        "cargo run --release -p vovp-bench -- --{}",
        args.mode.name()
    );
    if let Some(cpus) = &args.cpus {
        let list: Vec<String> = cpus.iter().map(usize::to_string).collect();
        command.push_str(&format!(" --cpus {}", list.join(",")));
    }
    for (on, flag) in [(!args.perf, " --soak-only"), (!args.soak, " --skip-soak")] {
        if on {
            command.push_str(flag);
        }
    }
    if !args.rust {
        command.push_str(" --skip-rust");
    }
    if let Some(only) = &args.only {
        command.push_str(&format!(" --only {only}"));
    }
    if let Some(peers) = &args.peers {
        command.push_str(&format!(" --peers '{peers}'"));
    }
    let run = json!({
        "mode": args.mode.name(),
        "command": command,
        "capacity_bytes": capacity,
        "cpus": args.cpus,
        "machine": machine,
        "setup_seconds": setup_secs,
        "total_seconds": total,
        "driver": driver_info,
        "finished_unix": SystemTime::now().duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs()).unwrap_or(0),
    });
    let results = paths.out.join("results.json");
    let json_text = serde_json::to_string_pretty(&report.to_json(run)).unwrap_or_default();
    if let Err(e) = std::fs::write(&results, json_text) {
        report.errors.push(format!("{}: {e}", results.display()));
    }
    let header = format!(
        "## vovp-bench results ({} mode)\n\nMachine: {}. Both stores: {} GiB memory limit. \
         Command: `{command}`.\nMedians; ratio = vovp / baseline (↑: higher is better, ↓: \
         lower is better).\n\n",
        args.mode.name(),
        machine["summary"].as_str().unwrap_or("?"),
        capacity / GIB,
    );
    let _ = std::fs::write(paths.out.join("results.md"), format!("{header}{markdown}"));
    println!("{header}{markdown}");

    if let Some(py) = python.as_ref().filter(|_| args.perf) {
        plot(&paths, py, &results);
    }
    eprintln!(
        "vovp-bench: done in {total:.0} s (setup {setup_secs:.0} s); results in {}",
        results.display()
    );
    if report.failed() {
        eprintln!("vovp-bench: FAILED: a store failed or a check did (see above)");
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}

/// What `benches/setup.sh` reports.
struct PythonEnv {
    python: PathBuf,
    plasma: PathBuf,
}

fn run_setup(root: &Path) -> Result<PythonEnv, String> {
    let out = Command::new("bash")
        .arg(root.join("benches/setup.sh"))
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run benches/setup.sh: {e}"))?;
    if !out.status.success() {
        return Err(format!("benches/setup.sh exited with {}", out.status));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let field = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(k))
            .map(PathBuf::from)
            .ok_or_else(|| format!("benches/setup.sh did not print {k}"))
    };
    Ok(PythonEnv {
        python: field("VENV_PYTHON=")?,
        plasma: field("PLASMA_STORE=")?,
    })
}

fn rust_workloads(
    mode: Mode,
    socket: &Path,
    capacity: u64,
    report: &mut Report,
) -> Result<(), String> {
    let cfg = match mode {
        Mode::Quick => RustConfig::quick(),
        Mode::Full => RustConfig::full(),
    };
    let client = vovp_client::Client::connect(socket).map_err(|e| e.to_string())?;
    let engine = vovp::Engine::spawn(vovp::Config::with_capacity(capacity))
        .map_err(|e| format!("Engine::spawn: {e}"))?;
    let stores = Stores {
        client: &client,
        engine: &engine,
    };
    let result = rust_level::small_ops(&cfg, &stores, report)
        .and_then(|()| rust_level::large_objects(&cfg, &stores, report));
    engine.shutdown();
    result
}

fn run_driver(
    paths: &Paths,
    py: &PythonEnv,
    args: &Args,
    vovp_sock: &Path,
    plasma_sock: &Path,
    capacity: u64,
    report: &mut Report,
) -> Result<Value, String> {
    let mode = args.mode;
    let out = paths.out.join("driver.json");
    let _ = std::fs::remove_file(&out);
    // The working tree's client first, whatever the venv has installed.
    let mut pythonpath = paths.root.join("python").into_os_string();
    if let Some(old) = std::env::var_os("PYTHONPATH") {
        pythonpath.push(":");
        pythonpath.push(old);
    }
    let mut cmd = Command::new(&py.python);
    cmd.arg(paths.root.join("benches/driver.py"))
        .args(["--mode", mode.name(), "--capacity", &capacity.to_string()])
        .arg("--vovp")
        .arg(vovp_sock)
        .arg("--plasma")
        .arg(plasma_sock)
        .arg("--out")
        .arg(&out)
        .env("PYTHONPATH", pythonpath)
        .stdin(Stdio::null());
    if let Some(only) = &args.only {
        cmd.args(["--only", only]);
    }
    if let Some(peers) = &args.peers {
        cmd.args(["--peers", peers]);
    }
    // The peers workload adds Ray's start (~20 s on 2 cores) and every peer's puts.
    let limit = match mode {
        Mode::Quick => Duration::from_secs(7 * 60),
        Mode::Full => Duration::from_secs(25 * 60),
    };
    let status = procs::run_with_timeout(&mut cmd, limit)?;
    let text = std::fs::read_to_string(&out)
        .map_err(|e| format!("no {} ({e}); driver exited with {status}", out.display()))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("driver.json: {e}"))?;
    for r in v["results"].as_array().into_iter().flatten() {
        report.rows.push(Row::from_json(r)?);
    }
    if v["peers"].is_object() {
        report.peers = Some(Peers::from_json(&v["peers"])?);
    }
    report.checks.extend(python_checks(&v));
    if let Some(e) = v["error"].as_str() {
        return Err(e.to_string());
    }
    if !status.success() {
        return Err(format!("driver exited with {status}"));
    }
    Ok(v["info"].clone())
}

fn plot(paths: &Paths, py: &PythonEnv, results: &Path) {
    let png = paths.out.join("throughput.png");
    let status = Command::new(&py.python)
        .arg(paths.root.join("benches/plot.py"))
        .arg(results)
        .arg(&png)
        .status();
    match status {
        Ok(s) if s.success() => eprintln!("vovp-bench: plot in {}", png.display()),
        Ok(s) => eprintln!("vovp-bench: warning: plot.py exited with {s}"),
        Err(e) => eprintln!("vovp-bench: warning: cannot run plot.py: {e}"),
    }
}

/// Warns when the daemon binary is older than a source file it is built from: the numbers would
/// describe old code.
fn warn_if_stale(bin: &Path, root: &Path) {
    let Ok(built) = bin.metadata().and_then(|m| m.modified()) else {
        return;
    };
    let mut newest: Option<(SystemTime, PathBuf)> = None;
    let mut stack: Vec<PathBuf> = ["engine/src", "actors/src", "transport", "gpu/src"]
        .iter()
        .map(|d| root.join(d))
        .collect();
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if let Ok(m) = e.metadata().and_then(|m| m.modified()) {
                if newest.as_ref().is_none_or(|(t, _)| m > *t) {
                    newest = Some((m, p));
                }
            }
        }
    }
    if let Some((t, p)) = newest {
        if t > built {
            eprintln!(
                "vovp-bench: warning: {} is newer than {}; rebuild with \
                 `cargo build --release --workspace --bins` to measure the current code",
                p.display(),
                bin.display()
            );
        }
    }
}

fn set_process_cpus(cpus: &[usize]) -> std::io::Result<()> {
    // SAFETY: cpu_set_t is plain data; this sets the calling (main) thread's mask, which every
    // thread and process started later inherits.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            libc::CPU_SET(c, &mut set);
        }
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// `nproc`, the CPU model and the memory, for the report.
fn machine_info() -> Value {
    // Online CPUs of the machine (not of this process's mask, which --cpus may narrow).
    // SAFETY: plain sysconf query.
    let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(0);
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).trim().to_string())
        .unwrap_or_else(|| "unknown CPU".into());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_string();
    let mem_gib = mem_kib as f64 / (1u64 << 20) as f64;
    json!({
        "nproc": cpus,
        "cpu": model,
        "memory_bytes": mem_kib * 1024,
        "kernel": kernel,
        "summary": format!("{cpus} CPUs ({model}), {mem_gib:.0} GiB RAM, Linux {kernel}"),
    })
}
