//! Engine configuration and the size syntax shared by the daemon's flags (`1G`, `512M`).

use vovp_actors::gpu::GpuConfig;

use crate::Error;
pub use vovp_actors::SpillConfig;

/// How an engine is set up.
#[derive(Debug, Clone)]
pub struct Config {
    /// Host bytes for objects (Plasma's `-m`).
    pub capacity: u64,
    /// Back host memory with 2 MiB huge pages when the machine has them reserved.
    pub huge_pages: bool,
    /// Touch every page at start, so no put pays first-touch page faults.
    pub prefault: bool,
    /// Per-GPU capacities.
    pub gpu: GpuConfig,
    /// Start even when `capacity` is more than the machine (or its memory cgroup) can back now.
    /// Off by default: such a store would fail later with SIGBUS in whichever client first
    /// touches a page that cannot be backed.
    pub overcommit: bool,
    /// Allocate an object's pages when they are first touched instead of at create. Off by
    /// default: a create then backs its new pages (after checking that the machine and its
    /// memory cgroup have room for them), so a create the store accepts can never fail later
    /// with SIGBUS or the OOM killer in the client that writes it; one that cannot be backed
    /// is `OutOfMemory` (after evicting what can be). The cost is the daemon's: about 0.4 µs
    /// per new 4 KiB page (RELIABILITY.md), none for pages a freed object left warm.
    pub lazy_pages: bool,
    /// Put each client's objects into arenas of its own that only it can write (other clients
    /// map them read-only). Off: one segment every client maps read-write, as Plasma did.
    pub client_arenas: bool,
    /// Most host objects held at once (at most, and by default, [`crate::MAX_OBJECTS`]).
    pub max_objects: u32,
    /// Publish sealed host objects in a shared directory that clients read with no message,
    /// pinning what they get in hold tables of their own (vovp-shm's crate doc,
    /// "Who does what"). Off: every get is a message to the store.
    pub shared_reads: bool,
    /// Spill unreferenced sealed host objects to this directory instead of evicting them, and
    /// read them back on the next get (`--spill-dir`, `--spill-max`). `None` (the default):
    /// eviction drops them, as Plasma did. README, "Semantics".
    pub spill: Option<SpillConfig>,
}

impl Config {
    pub fn with_capacity(capacity: u64) -> Self {
        Config {
            capacity,
            huge_pages: false,
            prefault: false,
            gpu: GpuConfig::default(),
            overcommit: false,
            lazy_pages: false,
            client_arenas: true,
            max_objects: crate::MAX_OBJECTS as u32,
            shared_reads: true,
            spill: None,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config::with_capacity(1 << 30)
    }
}

/// Parses `1000000`, `64K`, `512M`, `1G`, `2T` (binary multiples; `B`/`iB` suffixes allowed).
///
/// ```
/// assert_eq!(vovp::parse_size("512M")?, 512 << 20);
/// assert_eq!(vovp::parse_size("1GiB")?, 1 << 30);
/// assert!(vovp::parse_size("1.5G").is_err());
/// # Ok::<(), vovp::Error>(())
/// ```
pub fn parse_size(text: &str) -> Result<u64, Error> {
    let t = text.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (digits, mult) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 1u64 << 10),
        Some('m' | 'M') => (&t[..t.len() - 1], 1 << 20),
        Some('g' | 'G') => (&t[..t.len() - 1], 1 << 30),
        Some('t' | 'T') => (&t[..t.len() - 1], 1 << 40),
        _ => (t, 1),
    };
    let n: u64 = digits.trim().parse().map_err(|_| {
        Error::Config(format!(
            "cannot read {text:?} as a size (e.g. 1000000, 512M, 1G)"
        ))
    })?;
    n.checked_mul(mult)
        .ok_or_else(|| Error::Config(format!("size {text:?} is too large")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1000000000").unwrap(), 1_000_000_000);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("512M").unwrap(), 512 << 20);
        assert_eq!(parse_size("64KiB").unwrap(), 64 << 10);
        assert!(parse_size("lots").is_err());
        assert!(parse_size("99999999999T").is_err());
    }
}
