//! `vovp-engine`: the standalone store daemon (Plasma-like flags).
//!
//! ```text
//! vovp-engine -m 1G -s /tmp/vovp.sock
//! vovp-engine -m 1000000000 -s /tmp/dgl_socket -d /dev/shm   # Plasma's spelling works too
//! ```
//!
//! Of `plasma-store-server`'s flags, `-m BYTES`, `-s SOCKET` and `-d DIR` are accepted as they
//! are; `-h` (huge pages) is `--huge-pages` here because `-h` is help, and Plasma's `-e`
//! (an external store objects were evicted to) is `--spill-dir DIR` (objects go to files there
//! instead of being evicted, and come back on the next get).
//!
//! The log goes to stderr: colour codes only when stderr is a terminal (and `NO_COLOR` is not
//! set), one JSON object a line with `--log-format json`. `--metrics ADDR` serves Prometheus
//! metrics at `http://ADDR/metrics`.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

#[derive(Parser, Debug)]
#[command(
    name = "vovp-engine",
    version,
    about = "vovp shared-memory tensor store daemon"
)]
struct Args {
    /// Shared memory for objects, in bytes (1000000000, 512M, 1G).
    #[arg(short = 'm', long = "memory", value_parser = parse_size)]
    memory: u64,
    /// Unix socket path to serve.
    #[arg(short = 's', long = "socket")]
    socket: PathBuf,
    /// Back the store with 2 MiB huge pages when the machine has them reserved.
    #[arg(long)]
    huge_pages: bool,
    /// Plasma's `-d DIR` (where Plasma kept its memory-mapped file). vovp's memory is a memfd,
    /// which lives in no directory: a hugetlbfs mount means huge pages (as --huge-pages), any
    /// other directory is accepted and not used.
    #[arg(short = 'd', long = "plasma-directory", value_name = "DIR")]
    plasma_directory: Option<PathBuf>,
    /// Touch all memory at start so puts never pay first-touch page faults.
    #[arg(long)]
    prefault: bool,
    /// Start even if -m is more than the machine can back now (pages past that fail with SIGBUS
    /// when first touched).
    #[arg(long)]
    overcommit: bool,
    /// Do not back an object's pages when it is created: they are allocated when a client
    /// first touches them (as Plasma did), which saves the daemon that work on a first put
    /// into fresh memory, but if the machine or its memory cgroup has run short by then the
    /// touch is SIGBUS in that client, or the OOM killer. By default a create is refused with
    /// OUT_OF_MEMORY instead.
    #[arg(long)]
    lazy_pages: bool,
    /// Do not publish objects in the shared directory: every get is a message to the daemon
    /// (as Plasma's were). By default clients get sealed host objects by reading the
    /// directory and recording a hold in a table of their own, with no message.
    #[arg(long)]
    no_shared_reads: bool,
    /// Spill unreferenced objects to files in DIR instead of evicting them when memory is
    /// needed; a get reads them back (README, "Semantics"). DIR is this daemon's alone (locked)
    /// and emptied of spill files at start. Off by default: eviction drops objects, as Plasma.
    #[arg(long, value_name = "DIR")]
    spill_dir: Option<PathBuf>,
    /// Most bytes of spill files (512M, 100G); past it victims are evicted. Default: what the
    /// disk takes (a full disk also falls back to eviction).
    #[arg(long, value_name = "BYTES", value_parser = parse_size, requires = "spill_dir")]
    spill_max: Option<u64>,
    /// Per-GPU capacity, e.g. `0:8G,1:8G`.
    #[arg(long)]
    gpu_memory: Option<String>,
    /// Also accept clients running as this uid (repeatable). The daemon's own uid always may.
    #[arg(long = "allow-uid")]
    allow_uid: Vec<u32>,
    /// Mode of the socket file, in octal.
    #[arg(long, default_value = "600", value_parser = parse_mode)]
    socket_mode: u32,
    /// Most connections served at once (default: what the open-file limit allows, raised to
    /// its hard limit at start). Beyond it new clients get a clear "too many connections".
    #[arg(long)]
    max_connections: Option<usize>,
    /// Seconds a new client has to send HELLO, and a started frame to arrive whole.
    #[arg(long, default_value = "10", value_parser = parse_seconds)]
    handshake_timeout: std::time::Duration,
    /// Seconds a client may leave its replies unread (socket buffer full) before it is
    /// disconnected.
    #[arg(long, default_value = "30", value_parser = parse_seconds)]
    write_timeout: std::time::Duration,
    /// error, warn, info, debug or trace.
    #[arg(long, default_value = "info")]
    log_level: String,
    /// text (for people) or json (one object a line, for log collectors).
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
    /// Serve Prometheus metrics at http://ADDR/metrics, e.g. 127.0.0.1:9464 (off by
    /// default). Port 0 takes a free port, logged at start (`metrics_addr`). Anyone who can
    /// reach ADDR can read them: bind a loopback or private address.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<SocketAddr>,
    /// Serve object transfers to other engines at ADDR (ip:port; port 0 takes a free port,
    /// logged at start as `transfer_addr`), off by default. Only streams with a ticket minted
    /// with the cluster's key are served; the bytes are not encrypted: bind a private
    /// network's address.
    #[arg(long, value_name = "ADDR")]
    transfer: Option<SocketAddr>,
    /// The cluster's transfer key (64 hex digits), in a file only its owner may read (mode
    /// 0600). Needed to serve --transfer and to fetch from other engines. Without it, the
    /// VOVP_TRANSFER_KEY variable is read.
    #[arg(long, value_name = "PATH")]
    transfer_key_file: Option<PathBuf>,
    /// Threads that send and receive transfers (never the daemon's own thread).
    #[arg(long, default_value = "4")]
    transfer_threads: usize,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum LogFormat {
    Text,
    Json,
}

/// The log on stderr, as `--log-level` and `--log-format` say.
fn init_logging(level: &str, format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_new(level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let log = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => {
            // Colour codes in a file or a pipe are noise to whoever reads it.
            let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
            log.with_ansi(colour).init();
        }
        LogFormat::Json => log.json().with_ansi(false).init(),
    }
}

fn parse_size(s: &str) -> Result<u64, String> {
    vovp::parse_size(s).map_err(|e| e.to_string())
}

fn parse_seconds(s: &str) -> Result<std::time::Duration, String> {
    s.parse::<f64>()
        .ok()
        .filter(|v| v.is_finite() && *v > 0.0)
        .map(std::time::Duration::from_secs_f64)
        .ok_or_else(|| format!("{s:?} is not a positive number of seconds"))
}

fn parse_mode(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s.trim_start_matches("0o"), 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| format!("{s:?} is not an octal file mode like 600 or 660"))
}

/// `f_type` of a hugetlbfs mount (linux/magic.h).
const HUGETLBFS_MAGIC: u64 = 0x9584_58f6;

/// Whether `dir` (Plasma's `-d`) asks for huge pages, i.e. is on a hugetlbfs mount.
fn directory_wants_huge_pages(dir: &std::path::Path) -> Result<bool, String> {
    if !dir.is_dir() {
        return Err(format!("-d {}: not a directory", dir.display()));
    }
    let fs = rustix::fs::statfs(dir).map_err(|e| format!("-d {}: {e}", dir.display()))?;
    // f_type is signed on some targets: compare the low 32 bits, as the magic is 32-bit.
    Ok((fs.f_type as u64 & 0xFFFF_FFFF) == HUGETLBFS_MAGIC)
}

fn main() -> ExitCode {
    let args = Args::parse();
    init_logging(&args.log_level, args.log_format);
    let mut engine = vovp::Config::with_capacity(args.memory);
    engine.huge_pages = args.huge_pages;
    if let Some(dir) = &args.plasma_directory {
        match directory_wants_huge_pages(dir) {
            Ok(true) => {
                tracing::info!("-d {}: a hugetlbfs mount, using huge pages", dir.display());
                engine.huge_pages = true;
            }
            Ok(false) => tracing::info!(
                "-d {}: accepted for Plasma compatibility; vovp keeps objects in a memfd, \
                 not in a directory",
                dir.display()
            ),
            Err(e) => {
                eprintln!("vovp-engine: {e}");
                return ExitCode::from(2);
            }
        }
    }
    engine.prefault = args.prefault;
    engine.overcommit = args.overcommit;
    engine.lazy_pages = args.lazy_pages;
    engine.shared_reads = !args.no_shared_reads;
    engine.spill = args.spill_dir.clone().map(|dir| vovp::SpillConfig {
        dir,
        max_bytes: args.spill_max,
    });
    if let Some(spec) = &args.gpu_memory {
        match vovp::parse_gpu_memory(spec) {
            Ok(c) => engine.gpu.capacities = c,
            Err(e) => {
                eprintln!("vovp-engine: --gpu-memory: {e}");
                return ExitCode::from(2);
            }
        }
    }
    let mut config = vovp_transport::ServerConfig::new(&args.socket, engine);
    config.socket_mode = args.socket_mode;
    config.allowed_uids.extend(args.allow_uid);
    config.limits.max_connections = args.max_connections;
    config.limits.handshake_timeout = args.handshake_timeout;
    config.limits.frame_timeout = args.handshake_timeout;
    config.limits.write_timeout = args.write_timeout;
    config.metrics = args.metrics;
    config.transfer.listen = args.transfer;
    config.transfer.threads = args.transfer_threads.max(1);
    let key = match &args.transfer_key_file {
        Some(path) => Some(vovp_transport::TransferConfig::key_from_file(path)),
        None => vovp_transport::TransferConfig::key_from_env(),
    };
    match key.transpose() {
        Ok(key) => config.transfer.key = key,
        Err(e) => {
            eprintln!("vovp-engine: {e}");
            return ExitCode::from(2);
        }
    }
    match vovp_transport::run(config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vovp-engine: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plasma_store_server_spelling_parses() {
        let a = Args::try_parse_from([
            "vovp-engine",
            "-m",
            "1000000000",
            "-s",
            "/tmp/dgl_socket",
            "-d",
            "/dev/shm",
        ])
        .unwrap();
        assert_eq!(a.memory, 1_000_000_000);
        assert_eq!(a.socket, PathBuf::from("/tmp/dgl_socket"));
        assert_eq!(a.plasma_directory, Some(PathBuf::from("/dev/shm")));
        assert!(!a.huge_pages);
        assert_eq!((a.metrics, a.log_format), (None, LogFormat::Text));
        assert_eq!(
            Args::try_parse_from(["vovp-engine", "-m", "1G", "-s", "x"])
                .unwrap()
                .memory,
            1 << 30
        );
    }

    #[test]
    fn plasma_flags_vovp_lacks_are_refused() {
        for extra in [&["-e", "hashtable://test"][..], &["-z"][..]] {
            let mut argv = vec!["vovp-engine", "-m", "1000000", "-s", "x"];
            argv.extend_from_slice(extra);
            assert!(Args::try_parse_from(argv).is_err(), "{extra:?}");
        }
    }

    #[test]
    fn spilling_takes_a_directory_and_an_optional_bound() {
        let a = Args::try_parse_from([
            "vovp-engine",
            "-m",
            "64M",
            "-s",
            "x",
            "--spill-dir",
            "/tmp/spill",
            "--spill-max",
            "1G",
        ])
        .unwrap();
        assert_eq!(a.spill_dir, Some(PathBuf::from("/tmp/spill")));
        assert_eq!(a.spill_max, Some(1 << 30));
        // A bound without a directory is a mistake, said at once.
        assert!(
            Args::try_parse_from(["vovp-engine", "-m", "1M", "-s", "x", "--spill-max", "1G"])
                .is_err()
        );
    }

    #[test]
    fn plasma_directory_must_exist_and_hugetlbfs_means_huge_pages() {
        assert!(directory_wants_huge_pages(std::path::Path::new("/nonexistent-dir")).is_err());
        let tmp = std::env::temp_dir();
        assert_eq!(directory_wants_huge_pages(&tmp), Ok(false));
    }
}
