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
    let item = Item {
        dst: Some(dst.as_mut_ptr() as usize),
        src: src.as_ptr() as usize,
        len: src.len(),
    };
    run(vec![item])[0]
}

/// Copies each `(offset, src)` of `items` into `dst[offset..offset + src.len()]` and returns
/// each one's content hash, in one job over the copy pool: a state dict of hundreds of tensors
/// costs one dispatch, not one per tensor, and its small tensors share threads.
///
/// # Panics
/// If an item does not fit in `dst`, or two items overlap there (a caller bug: the Python
/// layer checks both first).
pub fn copy_hashed_many(dst: &mut [u8], items: &[(usize, &[u8])]) -> Vec<u64> {
    let mut spans: Vec<(usize, usize)> = items.iter().map(|(o, s)| (*o, s.len())).collect();
    spans.sort_unstable();
    for pair in spans.windows(2) {
        assert!(
            pair[0].0 + pair[0].1 <= pair[1].0,
            "copy_hashed_many: items overlap"
        );
    }
    let base = dst.as_mut_ptr() as usize;
    let items = items
        .iter()
        .map(|(offset, src)| {
            assert!(
                offset + src.len() <= dst.len(),
                "copy_hashed_many: an item past the destination"
            );
            Item {
                dst: Some(base + offset),
                src: src.as_ptr() as usize,
                len: src.len(),
            }
        })
        .collect();
    run(items)
}

/// The content hash of `bytes` (threads of the copy pool for large ones).
pub fn hash(bytes: &[u8]) -> u64 {
    let item = Item {
        dst: None,
        src: bytes.as_ptr() as usize,
        len: bytes.len(),
    };
    run(vec![item])[0]
}

/// One tensor of a job: `len` bytes at `src`, copied to `dst` when given.
struct Item {
    dst: Option<usize>,
    src: usize,
    len: usize,
}

/// Hashes (and copies) every item, its blocks spread over the copy pool; one hash per item.
fn run(items: Vec<Item>) -> Vec<u64> {
    // Units of work: one per block of each item (an empty item has none).
    let units: Vec<(usize, usize)> = items
        .iter()
        .enumerate()
        .flat_map(|(i, item)| (0..item.len.div_ceil(HASH_BLOCK)).map(move |b| (i, b)))
        .collect();
    let total: usize = items.iter().map(|i| i.len).sum();
    let pool = (total > PARALLEL_MIN)
        .then(crate::copy::process_pool)
        .flatten()
        .filter(|p| p.current_num_threads() >= 2);
    // Runs of consecutive units of about equal bytes, one per thread (as parallel_copy's one
    // contiguous chunk per thread).
    let threads = pool.map_or(1, |p| p.current_num_threads());
    let mut runs = vec![0];
    let mut bytes = 0;
    for (u, &(i, b)) in units.iter().enumerate() {
        bytes += HASH_BLOCK.min(items[i].len - b * HASH_BLOCK);
        if bytes * threads >= total * runs.len() && u + 1 < units.len() {
            runs.push(u + 1);
        }
    }
    runs.push(units.len());
    runs.dedup();
    let job = Arc::new(Job {
        block_hashes: (0..units.len()).map(|_| AtomicU64::new(0)).collect(),
        items,
        units,
        runs,
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
    });
    let count = job.runs.len() - 1;
    if let Some(pool) = pool {
        for _ in 1..count {
            let helper = job.clone();
            pool.spawn(move || helper.work_claimed());
        }
    }
    job.work_claimed();
    // Every run is claimed; wait for those a worker is still on, yielding in case that
    // worker shares this CPU.
    let mut spins = 0u32;
    while job.done.load(Ordering::Acquire) < count {
        spins += 1;
        if spins < 64 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
    let mut hashes = Vec::with_capacity(job.items.len());
    let mut unit = 0;
    for item in &job.items {
        let blocks = item.len.div_ceil(HASH_BLOCK);
        let mut summary = Vec::with_capacity(8 * (blocks + 1));
        summary.extend_from_slice(&(item.len as u64).to_le_bytes());
        for h in &job.block_hashes[unit..unit + blocks] {
            summary.extend_from_slice(&h.load(Ordering::Acquire).to_le_bytes());
        }
        unit += blocks;
        hashes.push(xxh3_64(&summary));
    }
    hashes
}

/// One job, shared by the caller and the pool jobs it spawned. As in `copy::ClaimedCopy`, the
/// addresses are dereferenced only for a claimed run, and `run` returns only once every run
/// is claimed and done.
struct Job {
    items: Vec<Item>,
    /// (item, block within it) per unit, in order.
    units: Vec<(usize, usize)>,
    block_hashes: Vec<AtomicU64>,
    /// Run `r` is units `runs[r]..runs[r + 1]`.
    runs: Vec<usize>,
    next: AtomicUsize,
    done: AtomicUsize,
}

impl Job {
    fn work_claimed(&self) {
        loop {
            let r = self.next.fetch_add(1, Ordering::AcqRel);
            if r + 1 >= self.runs.len() {
                return;
            }
            for u in self.runs[r]..self.runs[r + 1] {
                let (i, b) = self.units[u];
                let h = self.block(&self.items[i], b * HASH_BLOCK);
                self.block_hashes[u].store(h, Ordering::Release);
            }
            self.done.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Copies (when copying) and hashes the block of `item` at `start`, a piece at a time.
    fn block(&self, item: &Item, start: usize) -> u64 {
        let end = (start + HASH_BLOCK).min(item.len);
        let mut hasher = Xxh3Default::new();
        let mut at = start;
        while at < end {
            let n = PIECE.min(end - at);
            // SAFETY: [at, at + n) lies inside the item's source and destination (at + n <=
            // item.len); its run is this thread's alone (claimed once); every buffer stays
            // borrowed by `run`'s caller until every run is done; sources and destinations do
            // not overlap (`&` against `&mut`), nor do two items' destinations (checked).
            let piece = unsafe {
                let src = std::slice::from_raw_parts((item.src + at) as *const u8, n);
                if let Some(dst) = item.dst {
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
    fn many_items_each_copied_and_hashed_as_alone() {
        let sizes = [0usize, 5, 4096, HASH_BLOCK + 3, 3 << 20, 100];
        let srcs: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(k, &n)| (0..n).map(|i| (i * 7 + k) as u8).collect())
            .collect();
        let mut offsets = Vec::new();
        let mut end = 0;
        for s in &srcs {
            offsets.push(end);
            end += s.len().next_multiple_of(64);
        }
        let mut dst = vec![0u8; end];
        let items: Vec<(usize, &[u8])> = offsets
            .iter()
            .zip(&srcs)
            .map(|(o, s)| (*o, s.as_slice()))
            .collect();
        let hashes = copy_hashed_many(&mut dst, &items);
        for ((o, s), h) in items.iter().zip(&hashes) {
            assert_eq!(&dst[*o..*o + s.len()], *s);
            assert_eq!(*h, reference(s));
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
