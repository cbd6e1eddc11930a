//! How much memory this machine can really back, checked before a store of `capacity` bytes
//! starts. The segment is sparse until touched, so a `-m` larger than what the machine or its
//! memory cgroup can give starts fine and fails later, where nobody can handle it: a client's
//! first touch of a page that cannot be backed is SIGBUS (or the OOM killer). Refusing at start
//! turns that into a clear error (users of torch shared memory and Ray hit exactly these bus
//! errors).

use std::path::{Path, PathBuf};

/// Bytes that can still be backed: MemAvailable + SwapFree, capped by the memory cgroup's
/// limit minus its usage (cgroup v2 or v1). `None` when /proc/meminfo cannot be read.
pub fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| -> Option<u64> {
        meminfo
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
    };
    let machine = field("MemAvailable:")?.saturating_add(field("SwapFree:").unwrap_or(0));
    Some(match cgroup_room() {
        Some(room) => machine.min(room),
        None => machine,
    })
}

/// Limit minus usage of this process's memory cgroup, if it has a limit.
fn cgroup_room() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    for line in own.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let rel = path.trim_start_matches('/');
        let (dir, limit_file, usage_file) = if controllers.is_empty() {
            (
                cgroup_dir("/sys/fs/cgroup", rel),
                "memory.max",
                "memory.current",
            )
        } else if controllers.split(',').any(|c| c == "memory") {
            (
                cgroup_dir("/sys/fs/cgroup/memory", rel),
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        } else {
            continue;
        };
        let read = |f: &str| -> Option<u64> {
            std::fs::read_to_string(dir.join(f))
                .ok()?
                .trim()
                .parse::<u64>()
                .ok()
        };
        // "max" (v2) does not parse: no limit. v1 reports "no limit" as a huge number.
        if let Some(limit) = read(limit_file).filter(|l| *l < (1 << 60)) {
            return Some(limit.saturating_sub(read(usage_file).unwrap_or(0)));
        }
    }
    None
}

fn cgroup_dir(root: &str, rel: &str) -> PathBuf {
    let dir = Path::new(root).join(rel);
    // Inside a container the cgroup path may not be visible under its own name.
    if dir.exists() {
        dir
    } else {
        PathBuf::from(root)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn this_machine_reports_some_memory() {
        let room = super::available_memory().expect("/proc/meminfo");
        assert!(room > 1 << 20, "{room}");
    }
}
