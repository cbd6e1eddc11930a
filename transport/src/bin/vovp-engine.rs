//! `vovp-engine`: the standalone store daemon (Plasma-like flags).
//!
//!     vovp-engine -m 1G -s /tmp/vovp.sock

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
    /// Touch all memory at start so puts never pay first-touch page faults.
    #[arg(long)]
    prefault: bool,
    /// Start even if -m is more than the machine can back now (pages past that fail with SIGBUS
    /// when first touched).
    #[arg(long)]
    overcommit: bool,
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

fn main() -> ExitCode {
    let args = Args::parse();
    let filter = tracing_subscriber::EnvFilter::try_new(&args.log_level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let mut engine = vovp::Config::with_capacity(args.memory);
    engine.huge_pages = args.huge_pages;
    engine.prefault = args.prefault;
    engine.overcommit = args.overcommit;
    if let Some(spec) = &args.gpu_memory {
        match vovp_gpu::parse_gpu_memory(spec) {
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
    match vovp_transport::run(config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vovp-engine: {e}");
            ExitCode::FAILURE
        }
    }
}
