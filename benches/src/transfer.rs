//! Engine to engine: FETCH between two daemons on loopback, against the machine's loopback TCP
//! limit measured in the same repetitions (a plain Rust sender and receiver into touched
//! memory, one stream and as many as the engines use), and how the receiving daemon answers a
//! socket client while a big fetch runs (a small get's p99, against the same daemon idle).
//!
//! The fetch is timed from the call to the view in hand: the control round trip, the object's
//! creation (fresh pages in the receiving store), the streams and the seal. Each repetition
//! fetches a new version (the holder replaces the object first, untimed), as weight sync does.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use vovp::{PutOptions, Store};
use vovp_client::{Client, FetchOptions};

use crate::procs::Daemon;
use crate::report::{Check, Limit, Report, Row};
use crate::{size_label, SourceBuf, GIB, MIB};

/// Streams the engines use for big objects (their default), and the loopback limit's second
/// measurement.
pub const STREAMS: usize = 4;

/// How much each size repeats.
#[derive(Debug, Clone)]
pub struct TransferConfig {
    /// (object size, timed repetitions).
    pub sizes: Vec<(u64, usize)>,
    /// The size of the fetch during which small gets are timed (0: none).
    pub busy_fetch: u64,
}

impl TransferConfig {
    pub fn quick() -> Self {
        TransferConfig {
            sizes: vec![(MIB, 10), (64 * MIB, 5), (256 * MIB, 3)],
            busy_fetch: 256 * MIB,
        }
    }

    pub fn full() -> Self {
        TransferConfig {
            sizes: vec![(MIB, 30), (64 * MIB, 11), (256 * MIB, 7)],
            busy_fetch: GIB,
        }
    }

    fn largest(&self) -> u64 {
        self.sizes
            .iter()
            .map(|s| s.0)
            .chain([self.busy_fetch])
            .max()
            .unwrap_or(0)
    }
}

type Res<T> = Result<T, String>;

/// A buffer of `len` bytes whose every page is touched (written), as a receiving store's
/// backed object is, so the limit pays no first-touch faults the engines do not pay either.
fn touched(len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    for page in v.chunks_mut(4096) {
        page[0] = 1;
    }
    v
}

/// GB/s of `src` sent over `streams` loopback TCP connections (each its part, one thread a
/// side) into `dst`, timed from the first connect to the last byte received.
pub fn tcp_loopback_gbps(src: &[u8], dst: &mut [u8], streams: usize) -> std::io::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let part = src.len().div_ceil(streams.max(1)).max(1);
    let started = Instant::now();
    std::thread::scope(|s| -> std::io::Result<()> {
        let senders: Vec<_> = src
            .chunks(part)
            .map(|chunk| {
                s.spawn(move || -> std::io::Result<()> {
                    let mut out = TcpStream::connect(addr)?;
                    out.set_nodelay(true)?;
                    out.write_all(chunk)
                })
            })
            .collect();
        let mut receivers = Vec::new();
        for chunk in dst.chunks_mut(part) {
            let (mut inp, _) = listener.accept()?;
            receivers.push(s.spawn(move || inp.read_exact(chunk)));
        }
        for t in senders {
            t.join()
                .map_err(|_| std::io::Error::other("sender panicked"))??;
        }
        for t in receivers {
            t.join()
                .map_err(|_| std::io::Error::other("receiver panicked"))??;
        }
        Ok(())
    })?;
    Ok(src.len() as f64 / started.elapsed().as_secs_f64() / 1e9)
}

/// The machine's loopback limit for `len` bytes: the median GB/s of `reps` sends over
/// [`STREAMS`] loopback connections into touched memory (after one untimed), what `--cluster`
/// reports its engine-to-engine fetches against.
pub fn loopback_limit_gbps(len: usize, reps: usize) -> Res<f64> {
    let src = SourceBuf::new(len, len as u64).map_err(|e| e.to_string())?;
    let mut dst = touched(len);
    let mut runs = Vec::with_capacity(reps);
    for rep in 0..=reps {
        let gbps = tcp_loopback_gbps(&src[..], &mut dst, STREAMS).map_err(|e| e.to_string())?;
        if rep > 0 {
            runs.push(gbps);
        }
    }
    runs.sort_by(f64::total_cmp);
    runs.get(runs.len() / 2)
        .copied()
        .ok_or_else(|| "no repetitions".to_string())
}

/// Two daemons serving transfers on loopback with one key (in `dir`).
fn start_engines(engine_bin: &Path, dir: &Path, out: &Path, memory: u64) -> Res<(Daemon, Daemon)> {
    use std::os::unix::fs::PermissionsExt;
    let key = dir.join("transfer.key");
    std::fs::write(&key, "6b".repeat(32)).map_err(|e| format!("{}: {e}", key.display()))?;
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| e.to_string())?;
    let start = |name: &'static str| {
        let socket = dir.join(format!("{name}.sock"));
        let args: Vec<String> = [
            "-m",
            &memory.to_string(),
            "-s",
            &socket.display().to_string(),
            "--transfer",
            "127.0.0.1:0",
            "--transfer-key-file",
            &key.display().to_string(),
            "--log-level",
            "warn",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        Daemon::start(
            name,
            engine_bin,
            &args,
            &socket,
            &out.join(format!("{name}.log")),
        )
    };
    Ok((start("transfer-holder")?, start("transfer-receiver")?))
}

/// The section: rows `rust.fetch.{size}` against `limit.tcp_loopback*`, the busy-daemon
/// latency, and the 70 % target at 256 MiB.
pub fn run(
    cfg: &TransferConfig,
    engine_bin: &Path,
    dir: &Path,
    out: &Path,
    report: &mut Report,
) -> Res<()> {
    let memory = (3 * cfg.largest()).max(256 * MIB);
    let (holder_d, receiver_d) = start_engines(engine_bin, dir, out, memory)?;
    let holder = Client::connect(&holder_d.socket).map_err(|e| e.to_string())?;
    let receiver = Client::connect(&receiver_d.socket).map_err(|e| e.to_string())?;
    let address = holder
        .transfer_address()
        .map_err(|e| e.to_string())?
        .ok_or("the holder serves no transfer port")?;
    let replace = PutOptions {
        replace: true,
        ..PutOptions::default()
    };
    for &(size, reps) in &cfg.sizes {
        let len = size as usize;
        let src = SourceBuf::new(len, size).map_err(|e| e.to_string())?;
        let mut dst = touched(len);
        let name = format!("fetch-{size}");
        let (mut one, mut many, mut fetch) = (Vec::new(), Vec::new(), Vec::new());
        let mut intact = true;
        // Repetition 0 warms both sides up and is not counted.
        for rep in 0..=reps {
            let one_gbps = tcp_loopback_gbps(&src[..], &mut dst, 1).map_err(|e| e.to_string())?;
            let many_gbps =
                tcp_loopback_gbps(&src[..], &mut dst, STREAMS).map_err(|e| e.to_string())?;
            let version = holder
                .put_and_view(&name, &src[..], b"", replace)
                .map_err(|e| format!("put {name}: {e}"))?
                .version();
            let t = Instant::now();
            let got = receiver
                .fetch_from(&address, &name, version, &FetchOptions::default())
                .map_err(|e| format!("fetch {name}@{version}: {e}"))?;
            let secs = t.elapsed().as_secs_f64();
            if rep == 0 {
                intact &= got.version() == version && got[..] == src[..];
            }
            drop(got);
            if rep > 0 {
                one.push(one_gbps);
                many.push(many_gbps);
                fetch.push(size as f64 / secs / 1e9);
            }
        }
        let sl = size_label(size);
        report.limits.push(Limit {
            key: format!("limit.tcp_loopback.{size}"),
            name: format!("loopback TCP, one stream, into touched memory, {sl}"),
            unit: "GB/s".into(),
            size: Some(size),
            samples: one.clone(),
        });
        report.limits.push(Limit {
            key: format!("limit.tcp_loopback_streams.{size}"),
            name: format!("loopback TCP, {STREAMS} streams, into touched memory, {sl}"),
            unit: "GB/s".into(),
            size: Some(size),
            samples: many.clone(),
        });
        // The limit a fetch is held against: the better of the two, repetition by repetition.
        let limit: Vec<f64> = one.iter().zip(&many).map(|(a, b)| a.max(*b)).collect();
        report.rows.push(Row {
            key: format!("rust.fetch.{size}"),
            group: "Engine to engine (FETCH over loopback)".into(),
            name: format!("fetch {sl}, call to view in hand"),
            unit: "GB/s".into(),
            higher_is_better: true,
            size: Some(size),
            vovp: fetch,
            base_label: "loopback TCP limit".into(),
            base: limit,
        });
        report.checks.push(Check {
            name: format!("engine-to-engine fetch of {sl}: bit-exact, at the holder's version"),
            ok: intact,
            detail: String::new(),
        });
        // The holder's old versions go as they are replaced; the receiver's with the views.
        let _ = receiver.delete(&name);
        let _ = holder.delete(&name);
        eprintln!("vovp-bench: engine-to-engine {sl} done");
    }
    if cfg.busy_fetch > 0 {
        busy_daemon(cfg.busy_fetch, &holder, &receiver, &address, report)?;
    }
    Ok(())
}

/// Small gets over the receiving daemon's socket, idle and during a fetch of `size`: the
/// daemon's thread never moves a transfer's bytes, so the second should look like the first.
fn busy_daemon(
    size: u64,
    holder: &Client,
    receiver: &Client,
    address: &str,
    report: &mut Report,
) -> Res<()> {
    let len = size as usize;
    let src = SourceBuf::new(len, 7).map_err(|e| e.to_string())?;
    let version = holder
        .put_and_view("busy", &src[..], b"", PutOptions::default())
        .map_err(|e| e.to_string())?
        .version();
    receiver
        .put("tiny", b"x", b"", PutOptions::default())
        .map_err(|e| e.to_string())?;
    receiver.sync().map_err(|e| e.to_string())?;
    let small_get = |until: &dyn Fn() -> bool, samples: &mut Vec<f64>| -> Res<()> {
        while !until() {
            let t = Instant::now();
            receiver
                .get_from_store(&["tiny"], None)
                .map_err(|e| e.to_string())?;
            samples.push(t.elapsed().as_secs_f64() * 1e6);
        }
        Ok(())
    };
    let mut idle = Vec::new();
    let idle_until = Instant::now() + Duration::from_millis(500);
    small_get(&|| Instant::now() > idle_until, &mut idle)?;
    let mut busy = Vec::new();
    let fetched = std::thread::scope(|s| -> Res<f64> {
        let fetch = s.spawn(|| {
            let t = Instant::now();
            let other = Client::connect(receiver.socket_path()).map_err(|e| e.to_string())?;
            other
                .fetch_from(address, "busy", version, &FetchOptions::default())
                .map_err(|e| e.to_string())?;
            Ok::<f64, String>(t.elapsed().as_secs_f64())
        });
        small_get(&|| fetch.is_finished(), &mut busy)?;
        fetch.join().map_err(|_| "the fetch panicked".to_string())?
    })?;
    let p99 = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() * 99 / 100).copied().unwrap_or(f64::NAN)
    };
    let (idle_p99, busy_p99) = (p99(&mut idle), p99(&mut busy));
    let sl = size_label(size);
    report.rows.push(Row {
        key: format!("rust.fetch_busy_get.{size}"),
        group: "Engine to engine (FETCH over loopback)".into(),
        name: format!("receiver's small get (socket) p99 during a {sl} fetch"),
        unit: "µs".into(),
        higher_is_better: false,
        size: Some(size),
        vovp: vec![busy_p99],
        base_label: "same daemon idle".into(),
        base: vec![idle_p99],
    });
    eprintln!(
        "vovp-bench: small gets during the {sl} fetch: p99 {busy_p99:.0} µs ({} gets, fetch \
         {:.2} GB/s); idle p99 {idle_p99:.0} µs",
        busy.len(),
        size as f64 / fetched / 1e9
    );
    Ok(())
}
