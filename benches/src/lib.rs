//! vovp-bench: the benchmark harness of vovp.
//!
//! The `vovp-bench` binary (`cargo run --release -p vovp-bench -- --quick|--full`) starts
//! `vovp-engine` and the reference store, Apache Arrow Plasma, with the same memory limit, and
//! runs two kinds of performance workloads:
//!
//! * Python-level workloads (`benches/driver.py`) drive both stores through their Python
//!   clients from one script, interleaving the stores repetition by repetition, so the ratio
//!   vovp/Plasma compares stores, not languages.
//! * Rust-level workloads ([`rust_level`]) drive the Rust client and the embedded engine and are
//!   compared with the machine's own limits measured in the same run ([`limits`]): a bare
//!   Unix-socket round trip and the parallel memcpy bandwidth into a shared mapping.
//!
//! Then, in both modes, the reliability section: [`soak`] (worker processes on one daemon,
//! SIGKILLs, a fuzzer connection, everything verified at the end) and [`probes`]
//! (`benches/probes.py`: the same fault and bad-input probes on vovp and on Plasma).
//! RELIABILITY.md reports both.
//!
//! [`report`] turns the samples into medians, ratios, the PASS/FAIL lines of the performance
//! targets, a markdown table and `target/bench/results.json`.

pub mod limits;
pub mod metrics_cost;
pub mod probes;
pub mod procs;
pub mod report;
pub mod rust_level;
pub mod soak;
pub mod spill;
pub mod transfer;

/// Binary size units.
pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// `1 KiB`, `256 MiB`, `64 B`: the size labels used in row names.
pub fn size_label(n: u64) -> String {
    for (unit, div) in [("GiB", GIB), ("MiB", MIB), ("KiB", KIB)] {
        if n >= div && n.is_multiple_of(div) {
            return format!("{} {unit}", n / div);
        }
    }
    format!("{n} B")
}

/// `n` bytes of a fixed pseudo-random pattern (not constant, so a store that hands back the
/// wrong bytes is caught by [`same_bytes`]).
pub fn pattern(n: usize, seed: u64) -> Vec<u8> {
    let mut block = vec![0u8; n.min(MIB as usize)];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for b in block.iter_mut() {
        // xorshift64: cheap and good enough to make every byte position differ.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = (x >> 56) as u8;
    }
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let take = (n - out.len()).min(block.len());
        out.extend_from_slice(&block[..take]);
    }
    out
}

/// A large source buffer for puts and copies, backed like numpy's large arrays: anonymous
/// memory advised `MADV_HUGEPAGE` (numpy advises every array of 4 MiB and more). Reading a
/// plain `Vec` through 4 KiB pages costs TLB misses that numpy's sources do not pay, which
/// would understate the memcpy limit against the Python puts.
pub struct SourceBuf {
    map: memmap2::MmapMut,
    len: usize,
}

impl SourceBuf {
    /// [`pattern`]`(n, seed)` in huge-page-advised memory.
    pub fn new(n: usize, seed: u64) -> std::io::Result<SourceBuf> {
        let mut map = memmap2::MmapMut::map_anon(n.max(1))?;
        // Advisory: without transparent huge pages the buffer just uses normal pages.
        let _ = map.advise(memmap2::Advice::HugePage);
        let block = pattern(n.min(MIB as usize), seed);
        for chunk in map[..n].chunks_mut(block.len().max(1)) {
            chunk.copy_from_slice(&block[..chunk.len()]);
        }
        Ok(SourceBuf { map, len: n })
    }
}

impl std::ops::Deref for SourceBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map[..self.len]
    }
}

/// Whether `got` holds the bytes of `expect`: compared in full up to 16 MiB, above that the
/// first and last MiB and every 4096th byte (full compares of 1 GiB would dominate the run).
pub fn same_bytes(got: &[u8], expect: &[u8]) -> bool {
    if got.len() != expect.len() {
        return false;
    }
    let n = got.len();
    let m = MIB as usize;
    if n <= 16 * m {
        return got == expect;
    }
    got[..m] == expect[..m]
        && got[n - m..] == expect[n - m..]
        && got.iter().step_by(4096).eq(expect.iter().step_by(4096))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels() {
        assert_eq!(size_label(64), "64 B");
        assert_eq!(size_label(4096), "4 KiB");
        assert_eq!(size_label(256 << 20), "256 MiB");
        assert_eq!(size_label(1 << 30), "1 GiB");
        assert_eq!(size_label(1000), "1000 B");
    }

    #[test]
    fn pattern_is_not_constant_and_compares() {
        let a = pattern(3 * MIB as usize + 5, 1);
        assert_eq!(a.len(), 3 * MIB as usize + 5);
        assert!(a[..64].iter().any(|&b| b != a[0]));
        assert!(same_bytes(&a, &a.clone()));
        let mut b = a.clone();
        b[17] ^= 1;
        assert!(!same_bytes(&b, &a));
        let s = SourceBuf::new(a.len(), 1).unwrap();
        assert_eq!(&s[..], &a[..]);
    }
}
