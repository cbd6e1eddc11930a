//! Arbitrary bytes into the daemon's own connection loop: vovp-transport's server (io_uring,
//! one actor per connection, the engine behind it) on a real Unix socket, written in chunks
//! whose size the input's first byte picks, so frames arrive split anywhere. Then a
//! well-behaved client must still be served, and once the connection is gone nothing it did
//! may be left behind: no references, no holders, no unsealed objects.

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use vovp::Store;
use vovp_client::Client;
use vovp_transport::ServerConfig;

/// One daemon for the whole process (a start per input would dominate the run time); each
/// input must leave it serving and holding nothing for the input's connection.
struct Daemon {
    socket: PathBuf,
    client: Client,
}

fn daemon() -> &'static Daemon {
    static DAEMON: OnceLock<Daemon> = OnceLock::new();
    DAEMON.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("vovp-fuzz-daemon-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("socket directory");
        let socket = dir.join("fuzz.sock");
        // The daemon's io_uring writes to a socket its peer closed raise SIGPIPE, which the
        // vovp-engine binary ignores (Rust's `main` does); a libFuzzer binary has no Rust
        // `main`, so the same is done here.
        // SAFETY: setting a signal's disposition to SIG_IGN, before any thread of ours starts.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
        let mut config = ServerConfig::new(&socket, vovp::Config::with_capacity(16 << 20));
        // Short, so that inputs which stop mid-frame or never greet end quickly.
        config.limits.handshake_timeout = Duration::from_secs(1);
        config.limits.frame_timeout = Duration::from_secs(1);
        config.limits.write_timeout = Duration::from_secs(1);
        std::thread::Builder::new()
            .name("vovp-fuzz-daemon".into())
            .spawn(move || vovp_transport::run(config))
            .expect("daemon thread");
        let deadline = Instant::now() + Duration::from_secs(20);
        let client = loop {
            match Client::connect(&socket) {
                Ok(c) => break c,
                Err(e) if Instant::now() > deadline => panic!("the daemon never served: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        };
        Daemon { socket, client }
    })
}

/// The target's body: panics on a finding.
pub fn run(data: &[u8]) {
    let d = daemon();
    let (&cut, bytes) = data.split_first().unwrap_or((&0, &[]));
    let chunk = 1 + usize::from(cut) * 4; // 1..=1021 bytes per write
    let mut s = UnixStream::connect(&d.socket).expect("the daemon accepts");
    let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
    let _ = s.set_read_timeout(Some(Duration::from_millis(20)));
    for piece in bytes.chunks(chunk) {
        if !crate::send_all(&s, piece) {
            break; // the daemon closed it (a fatal frame): what follows is never read
        }
    }
    // Read what comes back for a moment (a GET may wait; the input's connection is not
    // waited for), then close it.
    let until = Instant::now() + Duration::from_millis(50);
    let mut buf = [0u8; 4096];
    while Instant::now() < until {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(_) => break,
        }
    }
    drop(s);
    // The daemon still serves others ...
    d.client
        .contains("probe")
        .unwrap_or_else(|e| panic!("the daemon stopped serving: {e}"));
    // ... and the closed connection leaves nothing behind (a waiting GET ends at the daemon's
    // next liveness check, 100 ms).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = d.client.stats().expect("STATS");
        if s.references == 0 && s.unsealed == 0 && s.holders == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a closed connection left references behind: {s:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}
