//! The kernel's own count of a daemon's object memory: the pages of its memfds (the store's
//! segment and the clients' arenas; not the shared directory nor the hold tables, which have
//! fixed sizes of their own), whoever touched them. The soak and `resident_bound.rs` check
//! `-m` against it.
//!
//! Read with the daemon stopped ([`object_memfd_bytes`]): the segments are separate files,
//! read one after the other, and one allocator message can punch pages in one and allocate
//! pages in another (an object moving arenas). Read while it runs, a sum can count a segment
//! before the punch and the next after the allocation: up to an object's size more than the
//! store ever held at once (the allocator's doc has the numbers).

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

/// Bytes the kernel holds for `pid`'s object memfds, read while `pid` is stopped (SIGSTOP,
/// then SIGCONT, also on a panic). 0 when the process is gone.
pub fn object_memfd_bytes(pid: u32) -> u64 {
    let _stopped = Stopped::new(pid);
    object_memfd_bytes_running(pid)
}

/// The same sum, read while the process runs: only for a process that cannot move pages
/// meanwhile (see the module doc).
pub fn object_memfd_bytes_running(pid: u32) -> u64 {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return 0;
    };
    // The daemon keeps a read-only fd of each segment beside the read-write one: count inodes.
    let mut seen = HashMap::new();
    for e in dir.flatten() {
        let Ok(target) = std::fs::read_link(e.path()) else {
            continue;
        };
        let target = target.to_string_lossy();
        if !target.starts_with("/memfd:vovp-segment-") {
            continue;
        }
        // stat through the /proc link reaches the memfd itself (st_blocks: 512 bytes).
        if let Ok(m) = std::fs::metadata(e.path()) {
            seen.insert((m.dev(), m.ino()), m.blocks() * 512);
        }
    }
    seen.values().sum()
}

/// A process stopped (every thread, not only signalled) until drop.
pub struct Stopped(u32);

impl Stopped {
    /// Stops `pid` (SIGSTOP) and waits (up to 1 s) until every thread has stopped.
    pub fn new(pid: u32) -> Stopped {
        let p = rustix::process::Pid::from_raw(pid as i32);
        if let Some(p) = p {
            let _ = rustix::process::kill_process(p, rustix::process::Signal::STOP);
        }
        // A thread inside a system call stops when it returns from it: wait until every one
        // has (bounded: a thread in an uninterruptible wait only makes the read less exact).
        let deadline = Instant::now() + Duration::from_secs(1);
        while !all_stopped(pid) && Instant::now() < deadline {
            std::thread::yield_now();
        }
        Stopped(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        if let Some(p) = rustix::process::Pid::from_raw(self.0 as i32) {
            let _ = rustix::process::kill_process(p, rustix::process::Signal::CONT);
        }
    }
}

/// Whether every thread of `pid` is stopped (or the process is gone).
fn all_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return true;
    };
    tasks.flatten().all(|t| {
        let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else {
            return true; // the thread is gone
        };
        // "pid (comm) S ...": the state follows the last ')'.
        stat.rfind(')')
            .and_then(|i| stat[i + 1..].trim_start().chars().next())
            .is_none_or(|state| matches!(state, 'T' | 't' | 'Z' | 'X'))
    })
}
