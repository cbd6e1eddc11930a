//! Running out of memory is a clear error, never SIGBUS or the OOM killer (issue 14, item 3):
//! the daemon and its clients run inside a memory cgroup with a small limit, as in a container,
//! and whatever eats the room (other processes after the daemon started, or a `-m` larger than
//! the cgroup with `--overcommit`), a create the store cannot back is an `OutOfMemory` reply,
//! every client exits by itself, and the kernel records no OOM kill in the cgroup.
//!
//! Needs a memory cgroup this process may create children in (root, cgroup v1 or v2); where
//! there is none the tests say so and pass without running (the unit tests in
//! `actors/src/allocator/` and `memory_room.rs` still run everywhere).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use vovp::Store;
use vovp_tests::{bin, wait_until};

const MIB: u64 = 1 << 20;
const OBJECT: u64 = 32 * MIB;

/// A memory cgroup of our own, removed on drop (after its processes were killed).
struct Cgroup {
    dir: PathBuf,
    v2: bool,
}

impl Cgroup {
    /// A child of this process's memory cgroup limited to `limit` bytes; `None` (with the
    /// reason on stderr) where this machine does not let us make one.
    fn new(name: &str, limit: u64) -> Option<Cgroup> {
        let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
        let mut candidates = Vec::new();
        for line in own.lines() {
            let mut parts = line.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            let rel = path.trim_start_matches('/');
            if controllers.split(',').any(|c| c == "memory") {
                candidates.push((Path::new("/sys/fs/cgroup/memory").join(rel), false));
            } else if controllers.is_empty() {
                candidates.push((Path::new("/sys/fs/cgroup").join(rel), true));
            }
        }
        let tag = format!("vovp-test-{name}-{}", std::process::id());
        for (parent, v2) in candidates {
            let dir = parent.join(&tag);
            if std::fs::create_dir(&dir).is_err() {
                continue;
            }
            let cg = Cgroup { dir, v2 };
            let limit_file = if v2 {
                "memory.max"
            } else {
                "memory.limit_in_bytes"
            };
            if std::fs::write(cg.dir.join(limit_file), limit.to_string()).is_ok() {
                if !v2 {
                    // No swap for our pages either (where the machine has swap accounting).
                    let _ = std::fs::write(
                        cg.dir.join("memory.memsw.limit_in_bytes"),
                        limit.to_string(),
                    );
                }
                return Some(cg);
            }
        }
        vovp_tests::precondition_missing(
            "memory_limit: no memory cgroup can be made here (needs root and cgroup v1, or v2 \
             with the memory controller delegated)",
        );
        None
    }

    /// `program args` started inside this cgroup (the shell joins it, then execs).
    fn command(&self, program: &Path, args: &[&str]) -> Command {
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c")
            .arg("echo $$ > \"$0/cgroup.procs\" && exec \"$@\"")
            .arg(&self.dir)
            .arg(program)
            .args(args);
        cmd
    }

    /// OOM kills the kernel has made in this cgroup.
    fn oom_kills(&self) -> u64 {
        let file = if self.v2 {
            "memory.events"
        } else {
            "memory.oom_control"
        };
        std::fs::read_to_string(self.dir.join(file))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }

    fn usage(&self) -> u64 {
        let file = if self.v2 {
            "memory.current"
        } else {
            "memory.usage_in_bytes"
        };
        std::fs::read_to_string(self.dir.join(file))
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // Its processes were killed by the test; the kernel takes a moment to let go.
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::fs::remove_dir(&self.dir).is_err() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A daemon (or any process) inside a cgroup, killed on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn socket_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vovp-mem-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn daemon_in(cg: &Cgroup, socket: &Path, args: &[&str]) -> Proc {
    let mut all: Vec<&str> = args.to_vec();
    let s = socket.to_str().unwrap();
    all.extend(["-s", s, "--log-level", "warn"]);
    let child = cg
        .command(&bin("vovp-engine"), &all)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut p = Proc(child);
    wait_until(Duration::from_secs(20), || {
        std::os::unix::net::UnixStream::connect(socket).is_ok()
            || p.0.try_wait().ok().flatten().is_some()
    });
    assert!(
        p.0.try_wait().unwrap().is_none(),
        "the daemon did not start"
    );
    p
}

/// How one `vovp-fixture create-hold` client (writes every byte of its object, then holds it unsealed)
/// ended up.
enum Outcome {
    /// Created and written; still running, holding the object.
    Holding(Proc),
    /// Exited by itself, with its stderr.
    Refused(ExitStatus, String),
    /// Killed by a signal (SIGBUS, or SIGKILL from the OOM killer).
    Killed(ExitStatus, String),
}

fn create_hold(cg: &Cgroup, socket: &Path, name: &str) -> Outcome {
    let size = OBJECT.to_string();
    let mut child = cg
        .command(
            &bin("vovp-fixture"),
            &["-s", socket.to_str().unwrap(), "create-hold", name, &size],
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let _ = BufReader::new(child.stdout.take().unwrap()).read_line(&mut line);
    if line.trim() == "created" {
        return Outcome::Holding(Proc(child));
    }
    let status = child.wait().unwrap();
    let mut err = String::new();
    let _ = std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err);
    if status.code().is_some() {
        Outcome::Refused(status, err)
    } else {
        Outcome::Killed(status, err)
    }
}

/// Creates 32 MiB objects (each written whole and held by a client in the cgroup) until one
/// does not succeed or `max` do; returns the holders and how the last one ended.
fn fill(cg: &Cgroup, socket: &Path, tag: &str, max: usize) -> (Vec<Proc>, Option<Outcome>) {
    let mut holders = Vec::new();
    for i in 0..max {
        match create_hold(cg, socket, &format!("{tag}-{i}")) {
            Outcome::Holding(p) => holders.push(p),
            other => return (holders, Some(other)),
        }
    }
    (holders, None)
}

/// Other processes in the cgroup take the memory after the daemon started within its limit
/// (here: a second daemon prefaulting 112 MiB): the daemon refuses the create it can no longer
/// back with OUT_OF_MEMORY, long before `-m`, every client exits by itself, nothing is OOM
/// killed; once the memory is back, creates succeed again. Inside the same cgroup a `-m` larger
/// than it is refused at start, and with `--overcommit` it is the same clear refusal later.
#[test]
fn a_create_the_machine_cannot_back_is_out_of_memory_not_sigbus_or_the_oom_killer() {
    let Some(cg) = Cgroup::new("backed", 384 * MIB) else {
        return;
    };
    let dir = socket_dir("backed");
    let store = dir.join("store.sock");

    // More than the cgroup can give is refused at start (the cgroup's room, not the machine's).
    let out = cg
        .command(
            &bin("vovp-engine"),
            &["-m", "1G", "-s", store.to_str().unwrap()],
        )
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("more than this machine can back"),
        "{err}"
    );

    let daemon = daemon_in(&cg, &store, &["-m", "224M"]);
    let hog_socket = dir.join("hog.sock");
    let hog = daemon_in(&cg, &hog_socket, &["-m", "112M", "--prefault"]);
    let before = cg.usage();
    let (mut holders, last) = fill(&cg, &store, "a", 7);
    let fitted = holders.len();
    match last {
        Some(Outcome::Refused(status, err)) => {
            assert!(err.contains("out of memory"), "{status}: {err}")
        }
        Some(Outcome::Killed(status, err)) => {
            panic!("a client was killed ({status}) after {fitted} objects: {err}")
        }
        Some(Outcome::Holding(_)) => unreachable!(),
        None => panic!(
            "all {fitted} creates of 32 MiB succeeded in a cgroup of 384 MiB, {} MiB used \
             before them: the limit was never reached",
            before / MIB
        ),
    }
    eprintln!(
        "memory_limit: {fitted} objects of 32 MiB fitted beside the hog ({} MiB used before)",
        before / MIB
    );
    // 224M holds 7 objects: the refusal came from the cgroup, not from -m.
    assert!(fitted < 6, "{fitted} objects fitted");
    assert!(daemon.0.id() > 0);
    let client = vovp_client::Client::connect(&store).unwrap();
    let stats = client.stats().unwrap();
    assert_eq!(stats.unsealed, fitted as u64, "{stats:?}");
    assert_eq!(cg.oom_kills(), 0, "the OOM killer woke in the cgroup");

    // The hog goes: its memory is back, and creates fit again.
    drop(hog);
    let (more, last) = fill(&cg, &store, "b", 2);
    assert!(last.is_none(), "after the hog left a create still failed");
    holders.extend(more);
    // Clients that leave take their objects (and pages) with them.
    holders.clear();
    wait_until(Duration::from_secs(10), || {
        client.stats().is_ok_and(|s| s.unsealed == 0)
    });
    drop(client);
    drop(daemon);

    // --overcommit: -m beyond the cgroup starts, and the cgroup's end is still a clear error.
    let over = dir.join("over.sock");
    let daemon = daemon_in(&cg, &over, &["-m", "2G", "--overcommit"]);
    let (holders, last) = fill(&cg, &over, "c", 14);
    assert!(
        matches!(&last, Some(Outcome::Refused(_, e)) if e.contains("out of memory")),
        "after {} objects: {}",
        holders.len(),
        match last {
            Some(Outcome::Killed(s, e)) => format!("killed {s}: {e}"),
            Some(Outcome::Refused(s, e)) => format!("exited {s}: {e}"),
            _ => "no refusal".into(),
        }
    );
    assert_eq!(cg.oom_kills(), 0, "the OOM killer woke in the cgroup");
    eprintln!(
        "memory_limit: --overcommit: {} objects fitted, then OUT_OF_MEMORY",
        holders.len()
    );
    drop(holders);
    drop(daemon);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The same cgroup with `--lazy-pages` (pages allocated on first touch, as Plasma did): the
/// create is accepted and writing the object is where the cgroup runs out, so the OOM killer
/// ends some process. This is what the backing at create prevents, and shows the test above
/// can fail.
#[test]
fn with_lazy_pages_the_same_fill_ends_in_the_oom_killer() {
    let Some(cg) = Cgroup::new("lazy", 384 * MIB) else {
        return;
    };
    let dir = socket_dir("lazy");
    let store = dir.join("store.sock");
    let mut daemon = daemon_in(&cg, &store, &["-m", "2G", "--overcommit", "--lazy-pages"]);
    let (holders, last) = fill(&cg, &store, "l", 14);
    let daemon_died = daemon.0.try_wait().unwrap().is_some();
    let killed = matches!(last, Some(Outcome::Killed(..)));
    eprintln!(
        "memory_limit: --lazy-pages: {} objects fitted, the last client {}, daemon died: \
         {daemon_died}, OOM kills: {}",
        holders.len(),
        match &last {
            Some(Outcome::Killed(s, _)) => format!("killed ({s})"),
            Some(Outcome::Refused(s, _)) => format!("exited ({s})"),
            _ => "none".into(),
        },
        cg.oom_kills()
    );
    assert!(
        cg.oom_kills() > 0,
        "{} objects fitted, last: {}, OOM kills {}, daemon died {daemon_died}, client killed {killed}",
        holders.len(),
        match &last {
            Some(Outcome::Killed(s, _)) => format!("killed {s}"),
            Some(Outcome::Refused(s, e)) => format!("exited {s}: {e}"),
            _ => "none".into(),
        },
        cg.oom_kills()
    );
    drop(holders);
    drop(daemon);
    let _ = std::fs::remove_dir_all(&dir);
}
