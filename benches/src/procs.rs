//! Child processes of the harness: the two store daemons and the Python driver. Every child is
//! registered so that a watchdog (or a failure anywhere) can kill them all: a benchmark must
//! never leave a 2 GiB daemon behind.

use std::fs::File;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Pids of the children alive now (for [`kill_all`]).
static CHILDREN: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// Registers a child started elsewhere (the soak's workers) so that [`kill_all`] kills it too.
pub fn track(pid: u32) {
    register(pid);
}

/// Forgets a child that has been reaped.
pub fn untrack(pid: u32) {
    unregister(pid);
}

fn register(pid: u32) {
    if let Ok(mut c) = CHILDREN.lock() {
        c.push(pid);
    }
}

fn unregister(pid: u32) {
    if let Ok(mut c) = CHILDREN.lock() {
        c.retain(|&p| p != pid);
    }
}

/// SIGKILLs every child still registered (the watchdog's last resort; normal paths stop their
/// children themselves).
pub fn kill_all() {
    if let Ok(c) = CHILDREN.lock() {
        for &pid in c.iter() {
            // SAFETY: plain syscall on a pid this process spawned and has not reaped.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGKILL);
            }
        }
    }
}

/// A store daemon serving a Unix socket, stopped (SIGTERM, then SIGKILL) on drop.
pub struct Daemon {
    pub name: &'static str,
    pub socket: PathBuf,
    pub log: PathBuf,
    child: Child,
}

impl Daemon {
    /// Starts `program args...`, stderr and stdout to `log`, and waits until `socket` accepts
    /// connections.
    pub fn start(
        name: &'static str,
        program: &Path,
        args: &[String],
        socket: &Path,
        log: &Path,
    ) -> Result<Daemon, String> {
        let _ = std::fs::remove_file(socket);
        let out = File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
        let err = out.try_clone().map_err(|e| e.to_string())?;
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("cannot start {name} ({}): {e}", program.display()))?;
        register(child.id());
        let mut d = Daemon {
            name,
            socket: socket.to_owned(),
            log: log.to_owned(),
            child,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if UnixStream::connect(socket).is_ok() {
                return Ok(d);
            }
            if let Ok(Some(status)) = d.child.try_wait() {
                return Err(format!(
                    "{name} exited during start ({status}); its log:\n{}",
                    read_tail(log)
                ));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "{name} did not open {} within 20 s; its log:\n{}",
                    socket.display(),
                    read_tail(log)
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `None` while it runs; its exit status once it has died (a store failure).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Stops it (SIGTERM, SIGKILL after 5 s) and returns how it exited; `None` when it had to
    /// be killed or could not be waited for.
    pub fn stop(&mut self) -> Option<ExitStatus> {
        if let Ok(Some(status)) = self.child.try_wait() {
            return Some(status);
        }
        // SAFETY: plain syscall on our own unreaped child.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        None
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let pid = self.child.id();
        self.stop();
        unregister(pid);
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// Runs `cmd` to completion within `timeout` (killed after it); stdout/stderr as configured by
/// the caller.
pub fn run_with_timeout(cmd: &mut Command, timeout: Duration) -> Result<ExitStatus, String> {
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
    register(child.id());
    let deadline = Instant::now() + timeout;
    let result = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Ok(status),
            Ok(None) if Instant::now() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                break Err(format!(
                    "{cmd:?} ran past its {} s limit",
                    timeout.as_secs()
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => break Err(e.to_string()),
        }
    };
    unregister(child.id());
    result
}

/// The last 2000 bytes of a log file.
pub fn read_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let cut = text.len().saturating_sub(2000);
    let cut = (cut..text.len())
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(text.len());
    text[cut..].to_string()
}
