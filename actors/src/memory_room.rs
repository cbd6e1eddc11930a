//! How much memory this machine can still back: checked once before a store starts (the
//! engine refuses a `-m` larger than this unless `--overcommit`) and, through [`MachineRoom`],
//! by the allocator before it backs a new object's pages.
//!
//! The segments are sparse memfds. A page nobody can back is not an error anyone can handle:
//! the first touch of it is SIGBUS in whichever client touches it, or the OOM killer (users of
//! torch shared memory and Ray hit exactly these bus errors). So the allocator backs every new
//! object's pages at create (`fallocate`) after checking here that they fit, and a create that
//! does not fit is a typed `OutOfMemory` reply instead.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Bytes that can still be backed: MemAvailable + SwapFree, capped by the room of every memory
/// cgroup above this process that has a limit (cgroup v2 or v1). `None` when /proc/meminfo
/// cannot be read.
pub fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let machine = meminfo_field(&meminfo, "MemAvailable:")?
        .saturating_add(meminfo_field(&meminfo, "SwapFree:").unwrap_or(0));
    Some(
        match limited_cgroups().iter().filter_map(Cgroup::room).min() {
            Some(room) => machine.min(room),
            None => machine,
        },
    )
}

fn meminfo_field(meminfo: &str, name: &str) -> Option<u64> {
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

/// A memory cgroup with a limit, v2 or v1.
#[derive(Clone, Debug)]
struct Cgroup {
    dir: PathBuf,
    v2: bool,
}

impl Cgroup {
    fn read(&self, file: &str) -> Option<u64> {
        std::fs::read_to_string(self.dir.join(file))
            .ok()?
            .trim()
            .parse::<u64>()
            .ok()
    }

    /// The limit ("max" in v2 does not parse: none; v1 says "none" with a huge number).
    fn limit(&self) -> Option<u64> {
        self.read(if self.v2 {
            "memory.max"
        } else {
            "memory.limit_in_bytes"
        })
        .filter(|l| *l < (1 << 60))
    }

    /// Limit minus usage, plus the file cache the kernel would reclaim before it ran out (the
    /// usage counts it: a cgroup that has read big files looks full). Active file pages count
    /// half, as they are the slower to reclaim; shared memory (our own segments) is not in
    /// these counters.
    fn room(&self) -> Option<u64> {
        let limit = self.limit()?;
        let usage = self
            .read(if self.v2 {
                "memory.current"
            } else {
                "memory.usage_in_bytes"
            })
            .unwrap_or(0);
        let stat = std::fs::read_to_string(self.dir.join("memory.stat")).unwrap_or_default();
        let field = |name: &str| -> u64 {
            stat.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0)
        };
        // v1's `total_*` fields cover the cgroup's whole subtree, like its usage does.
        let (inactive, active) = if self.v2 {
            (field("inactive_file"), field("active_file"))
        } else {
            (field("total_inactive_file"), field("total_active_file"))
        };
        Some(
            limit
                .saturating_sub(usage)
                .saturating_add(inactive)
                .saturating_add(active / 2),
        )
    }
}

/// The memory cgroups of this process and their ancestors that have a limit: any of them
/// running out means the OOM killer (v1 with `use_hierarchy`, v2 always).
fn limited_cgroups() -> Vec<Cgroup> {
    let Ok(own) = std::fs::read_to_string("/proc/self/cgroup") else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for line in own.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let (root, v2) = if controllers.is_empty() {
            (Path::new("/sys/fs/cgroup"), true)
        } else if controllers.split(',').any(|c| c == "memory") {
            (Path::new("/sys/fs/cgroup/memory"), false)
        } else {
            continue;
        };
        let rel = path.trim_start_matches('/');
        // Inside a container the cgroup path may not be visible under its own name: then its
        // root is what the container sees of it.
        let own_dir = root.join(rel);
        let mut dir = if own_dir.exists() {
            own_dir
        } else {
            root.to_owned()
        };
        loop {
            let cg = Cgroup {
                dir: dir.clone(),
                v2,
            };
            if cg.limit().is_some() {
                found.push(cg);
            }
            if dir == root || !dir.pop() {
                break;
            }
        }
    }
    found
}

/// Kept free beyond what a create backs: the room figures are estimates, and other processes
/// allocate between two readings. When the check passes and the backing still fails, the
/// create fails cleanly (ENOMEM/ENOSPC); what this margin guards against is the OOM killer,
/// which a memory cgroup at its limit wakes even for `fallocate`.
pub const BACKING_MARGIN: u64 = 16 << 20;

/// How long one reading of the room is trusted (minus what was backed since).
const ROOM_TTL: Duration = Duration::from_millis(100);

/// The allocator's view of [`available_memory`], read at most every [`ROOM_TTL`] (a reading
/// costs tens of microseconds on the daemon's one thread) or when a request would not fit the
/// last reading, minus what was backed since.
#[derive(Debug)]
pub(crate) struct MachineRoom {
    cgroups: Vec<Cgroup>,
    /// (when, bytes that could be backed then less what was backed since)
    reading: Option<(Instant, u64)>,
}

impl Default for MachineRoom {
    fn default() -> Self {
        Self::new()
    }
}

impl MachineRoom {
    pub(crate) fn new() -> Self {
        MachineRoom {
            cgroups: limited_cgroups(),
            reading: None,
        }
    }

    fn read(&self) -> Option<u64> {
        let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
        let machine = meminfo_field(&meminfo, "MemAvailable:")?
            .saturating_add(meminfo_field(&meminfo, "SwapFree:").unwrap_or(0));
        Some(
            self.cgroups
                .iter()
                .filter_map(Cgroup::room)
                .fold(machine, u64::min),
        )
    }

    /// Forgets the last reading (pages were given back, or time to look again).
    pub(crate) fn invalidate(&mut self) {
        self.reading = None;
    }

    /// Whether `bytes` more can be backed now with [`BACKING_MARGIN`] to spare; if so, they are
    /// counted as taken. A machine whose room cannot be read at all is not refused.
    pub(crate) fn take(&mut self, bytes: u64) -> bool {
        let fresh = |r: &Option<(Instant, u64)>| {
            r.is_some_and(|(at, room)| {
                at.elapsed() < ROOM_TTL && room >= bytes.saturating_add(BACKING_MARGIN)
            })
        };
        if !fresh(&self.reading) {
            match self.read() {
                Some(room) => self.reading = Some((Instant::now(), room)),
                None => return true,
            }
        }
        match &mut self.reading {
            Some((_, room)) if *room >= bytes.saturating_add(BACKING_MARGIN) => {
                *room -= bytes;
                true
            }
            _ => false,
        }
    }

    /// What can be backed now with [`BACKING_MARGIN`] to spare (read again if the last
    /// reading is stale); `None` when the machine's room cannot be read.
    pub(crate) fn available(&mut self) -> Option<u64> {
        if self.reading.is_none_or(|(at, _)| at.elapsed() >= ROOM_TTL) {
            self.reading = Some((Instant::now(), self.read()?));
        }
        self.reading
            .map(|(_, room)| room.saturating_sub(BACKING_MARGIN))
    }

    /// The last reading, if any (for messages).
    pub(crate) fn last(&self) -> Option<u64> {
        self.reading.map(|(_, r)| r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_machine_reports_some_memory() {
        let room = available_memory().expect("/proc/meminfo");
        assert!(room > 1 << 20, "{room}");
        let mut m = MachineRoom::new();
        assert!(m.take(4096));
        // More than the machine has is refused, and refusing takes nothing.
        assert!(!m.take(u64::MAX / 2));
        assert!(m.take(4096));
    }
}
