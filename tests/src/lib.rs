//! Helpers for the cross-process tests: start the real `vovp-engine` on a private socket, run
//! the `vovp` CLI as another client process, wait for conditions.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The workspace's binaries (built by `cargo build --workspace --bins` before the tests; the
/// test command in the README does that). Set `VOVP_BIN_DIR` to use others.
pub fn bin(name: &str) -> PathBuf {
    let dir = std::env::var_os("VOVP_BIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            // target/<profile>/deps/<test binary> -> target/<profile>
            let exe = std::env::current_exe().expect("current exe");
            exe.parent()
                .and_then(Path::parent)
                .expect("target dir")
                .to_path_buf()
        });
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: run `cargo build --workspace --bins` first (the README's test command does)",
        path.display()
    );
    path
}

/// A daemon on a private socket, killed on drop.
pub struct Daemon {
    pub child: Child,
    pub socket: PathBuf,
    dir: PathBuf,
}

impl Daemon {
    pub fn start(memory: &str) -> Daemon {
        Self::start_with(memory, &[])
    }

    pub fn start_with(memory: &str, extra: &[&str]) -> Daemon {
        let dir =
            std::env::temp_dir().join(format!("vovp-test-{}-{}", std::process::id(), unique()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let socket = dir.join("vovp.sock");
        Self::spawn(memory, socket, dir, extra)
    }

    /// A daemon on an existing socket path (e.g. a stale one left by a killed daemon).
    pub fn start_with_socket(memory: &str, socket: &Path) -> Daemon {
        let dir =
            std::env::temp_dir().join(format!("vovp-test-{}-{}", std::process::id(), unique()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        Self::spawn(memory, socket.to_path_buf(), dir, &[])
    }

    fn spawn(memory: &str, socket: PathBuf, dir: PathBuf, extra: &[&str]) -> Daemon {
        let child = Command::new(bin("vovp-engine"))
            .arg("-m")
            .arg(memory)
            .arg("-s")
            .arg(&socket)
            .args(extra)
            .arg("--log-level")
            .arg("warn")
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn vovp-engine");
        let d = Daemon { child, socket, dir };
        wait_until(Duration::from_secs(20), || {
            std::os::unix::net::UnixStream::connect(&d.socket).is_ok()
        });
        d
    }

    pub fn client(&self) -> vovp_transport::Client {
        vovp_transport::Client::connect(&self.socket).expect("connect")
    }

    /// Runs the `vovp` CLI against this daemon to completion.
    pub fn cli(&self, args: &[&str]) -> Output {
        Command::new(bin("vovp"))
            .arg("-s")
            .arg(&self.socket)
            .args(args)
            .output()
            .expect("run vovp")
    }

    /// Starts the `vovp` CLI against this daemon and leaves it running.
    pub fn cli_spawn(&self, args: &[&str]) -> Child {
        Command::new(bin("vovp"))
            .arg("-s")
            .arg(&self.socket)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn vovp")
    }

    /// Sends SIGTERM and waits for a clean exit.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        // SAFETY: plain kill(2) on our child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        self.child.wait().expect("wait")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// Polls `f` until it holds; panics after `limit`.
pub fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < limit,
            "condition not reached within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Reads one line of a child's stdout (e.g. "holding").
pub fn read_line(child: &mut Child) -> String {
    use std::io::BufRead;
    let stdout = child.stdout.as_mut().expect("piped stdout");
    let mut line = String::new();
    std::io::BufReader::new(stdout)
        .read_line(&mut line)
        .expect("read line");
    line.trim().to_string()
}

pub type Runtime = tokio::runtime::Runtime;

/// A small tokio runtime for the async client tests.
pub fn runtime() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}
