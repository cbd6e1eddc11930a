//! Content hashes of tensors, computed in the same pass as the copy into the store.
//!
//! `vovp.cluster.publish_state` records a 64-bit hash per tensor so that a receiver holding
//! an older version fetches only the tensors whose bytes changed. Hashing after the copy
//! would read every byte a second time from memory; here each thread hashes a 64 KiB piece
//! right after copying it, while it is still in its cache, so the hash costs little beyond
//! the copy itself (the writer's copy is bound by memory bandwidth, xxh3 by ALU).
//!
//! # The hash (content hash version 1)
//!
//! The bytes are cut into [`HASH_BLOCK`] (1 MiB) blocks, the last one shorter; `h_i` is
//! xxh3-64 (seed 0) of block `i`; the hash is xxh3-64 of `len as u64 LE` followed by every
//! `h_i as u64 LE`. Blocks are independent, so threads hash different blocks of one large
//! tensor in parallel, and the result does not depend on how many threads did it. It is a
//! change detector, not a MAC: a writer who wants two different tensors to look alike can
//! make them (the writer is trusted anyway; see vovp.cluster's trust model).
//!
//! Large copies are split like [`crate::copy::parallel_copy`]'s: one contiguous run of
//! blocks per thread of the copy pool, claimed so that the caller never sleeps waiting for a
//! worker to wake.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use xxhash_rust::xxh3::{xxh3_64, Xxh3Default};

/// Bytes per hashed block (content hash version 1: changing it changes every hash).
pub const HASH_BLOCK: usize = 1 << 20;
/// Bytes copied and then hashed at a time: small enough to stay in a core's L2.
const PIECE: usize = 64 * 1024;
/// Content at or below this size is copied and hashed on the calling thread.
const PARALLEL_MIN: usize = 2 * HASH_BLOCK;

/// Copies `src` into `dst` (same length) and returns the content hash of the bytes.
///
/// ```
/// let src = vec![3u8; 5 << 20];
/// let mut dst = vec![0u8; src.len()];
/// let h = vovp_shm::content_hash::copy_hashed(&mut dst, &src);
/// assert_eq!(dst, src);
/// assert_eq!(h, vovp_shm::content_hash::hash(&src));
/// ```
///
/// # Panics
/// If the lengths differ (a caller bug, never client-controlled).
pub fn copy_hashed(dst: &mut [u8], src: &[u8]) -> u64 {
    assert_eq!(dst.len(), src.len(), "copy_hashed: length mismatch");
    run(Some(dst.as_mut_ptr() as usize), src)
}

/// The content hash of `bytes` (threads of the copy pool for large ones).
pub fn hash(bytes: &[u8]) -> u64 {
    run(None, bytes)
}

fn run(dst: Option<usize>, src: &[u8]) -> u64 {
    let blocks = src.len().div_ceil(HASH_BLOCK);
    let pool = (src.len() > PARALLEL_MIN)
        .then(crate::copy::process_pool)
        .flatten()
        .filter(|p| p.current_num_threads() >= 2);
    // One contiguous run of blocks per thread (as parallel_copy's one chunk per thread).
    let run_blocks = pool.map_or(blocks, |p| blocks.div_ceil(p.current_num_threads()));
    let run_blocks = run_blocks.max(1);
    let job = Arc::new(Job {
        dst,
        src: src.as_ptr() as usize,
        len: src.len(),
        block_hashes: (0..blocks).map(|_| AtomicU64::new(0)).collect(),
        run_blocks,
        runs: blocks.div_ceil(run_blocks),
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
    });
    if let Some(pool) = pool {
        for _ in 1..job.runs {
            let helper = job.clone();
            pool.spawn(move || helper.work_claimed());
        }
    }
    job.work_claimed();
    // Every run is claimed; wait for those a worker is still on, yielding in case that
    // worker shares this CPU.
    let mut spins = 0u32;
    while job.done.load(Ordering::Acquire) < job.runs {
        spins += 1;
        if spins < 64 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
    let mut summary = Vec::with_capacity(8 * (blocks + 1));
    summary.extend_from_slice(&(src.len() as u64).to_le_bytes());
    for h in &job.block_hashes {
        summary.extend_from_slice(&h.load(Ordering::Acquire).to_le_bytes());
    }
    xxh3_64(&summary)
}

/// One copy-and-hash (or hash), shared by the caller and the pool jobs it spawned. As in
/// `copy::ClaimedCopy`, the addresses are dereferenced only for a claimed run of blocks, and
/// `run` returns only once every run is claimed and done.
struct Job {
    dst: Option<usize>,
    src: usize,
    len: usize,
    block_hashes: Vec<AtomicU64>,
    /// Blocks per claimed run.
    run_blocks: usize,
    runs: usize,
    next: AtomicUsize,
    done: AtomicUsize,
}

impl Job {
    fn work_claimed(&self) {
        loop {
            let r = self.next.fetch_add(1, Ordering::AcqRel);
            if r >= self.runs {
                return;
            }
            let first = r * self.run_blocks;
            let last = (first + self.run_blocks).min(self.block_hashes.len());
            for b in first..last {
                let start = b * HASH_BLOCK;
                let len = HASH_BLOCK.min(self.len - start);
                let h = self.block(start, len);
                self.block_hashes[b].store(h, Ordering::Release);
            }
            self.done.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Copies (when copying) and hashes `len` bytes at `start`, a piece at a time.
    fn block(&self, start: usize, len: usize) -> u64 {
        let mut hasher = Xxh3Default::new();
        let mut at = start;
        while at < start + len {
            let n = PIECE.min(start + len - at);
            // SAFETY: [at, at + n) lies inside both buffers (at + n <= self.len); the run it
            // belongs to is this thread's alone (claimed once); both buffers stay borrowed by
            // `run`'s caller until every run is done; `dst` and `src` do not overlap (one is
            // `&mut`, the other `&`).
            let piece = unsafe {
                let src = std::slice::from_raw_parts((self.src + at) as *const u8, n);
                if let Some(dst) = self.dst {
                    std::ptr::copy_nonoverlapping(src.as_ptr(), (dst + at) as *mut u8, n);
                }
                src
            };
            hasher.update(piece);
            at += n;
        }
        hasher.digest()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition, written plainly.
    fn reference(bytes: &[u8]) -> u64 {
        let mut summary = (bytes.len() as u64).to_le_bytes().to_vec();
        for block in bytes.chunks(HASH_BLOCK) {
            summary.extend_from_slice(&xxh3_64(block).to_le_bytes());
        }
        xxh3_64(&summary)
    }

    #[test]
    fn copies_and_hashes_as_defined_at_every_size() {
        for len in [
            0usize,
            1,
            63,
            PIECE + 1,
            HASH_BLOCK,
            HASH_BLOCK + 1,
            PARALLEL_MIN + 1,
            (7 << 20) + 12345,
        ] {
            let src: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let mut dst = vec![0u8; len];
            let h = copy_hashed(&mut dst, &src);
            assert_eq!(dst, src, "len {len}");
            assert_eq!(h, reference(&src), "len {len}");
            assert_eq!(hash(&src), h, "len {len}");
        }
    }

    #[test]
    fn one_changed_byte_changes_the_hash() {
        let mut bytes = vec![0u8; 3 << 20];
        let before = hash(&bytes);
        bytes[(3 << 20) - 1] = 1;
        assert_ne!(hash(&bytes), before);
        // Same bytes, different length: different hash.
        assert_ne!(hash(&[0u8; 10]), hash(&[0u8; 11]));
    }
}
