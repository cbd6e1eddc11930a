//! Host copies: above 1 MB (10^6 bytes, so a 1 MiB copy too) the copy is split into one
//! contiguous chunk per rayon thread, because one core cannot saturate the memory bus (and page
//! faults on fresh memory parallelise too).
//!
//! The calling thread copies chunks itself and never sleeps waiting for the pool: chunks are
//! *claimed* (an atomic counter), the caller claims them like the workers do, and at the end it
//! waits only for chunks a worker is copying. A worker that wakes up late finds nothing left and
//! does nothing. Why: a put usually follows a pause (the application computed something), and
//! after a pause rayon's workers are asleep; a plain `par_chunks` from outside the pool puts the
//! caller to sleep on a latch until sleeping workers have woken, copied and woken it in turn.
//! On the development VMs that made a 1 MiB copy after a 2 ms pause 1.6-2× slower than a plain
//! `memcpy` (281-303 µs against 181, claimed chunks 138-148), and in a tight loop too (20-33 µs
//! against 22; claimed chunks 12). Claiming also spares the caller every wake-up of its own,
//! and a busy pool (another put's copy) only means the caller copies more itself.
//!
//! Fresh destination pages (a store's block nobody wrote yet: its pages are allocated but were
//! never mapped, so each first write faults, and the kernel zeroes the page then) are mapped in
//! ahead of the copy, piece by piece, by the thread that copies them: `MADV_POPULATE_WRITE`
//! takes the same faults in one call instead of one trap per page. Whether a piece is fresh is
//! read from its first page (`mincore`: an untouched page of the store's memory is not in the
//! page cache yet; a warm one is, whoever touched it), so a copy into warm pages pays 32 system
//! calls per 128 MiB, not the 3-4 ms a populate of present pages costs. Into fresh pages of a
//! memfd (2 threads, 256 MiB, a C probe on the development VM) the copy took 50-86 ms this
//! way against 80-148 ms faulting page by page; into warm pages, 13-17 ms either way.

use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::Arc;

/// Copies at or below this size run on the calling thread. 1 MB, not 1 MiB: a 1 MiB put into
/// fresh memory is bound by its page faults, which two threads take in parallel (a 1 MiB
/// Python put into fresh memory: 816 → 724 µs on 2 cores).
pub const PARALLEL_COPY_THRESHOLD: usize = 1_000_000;
/// Smallest chunk.
const MIN_CHUNK: usize = 128 * 1024;
/// Fresh pages are looked for, and mapped in, this much at a time.
const POPULATE_PIECE: usize = 4 << 20;

/// Copies `src` into `dst` (same length), in parallel when large.
///
/// ```
/// let src = vec![7u8; 3 << 20];
/// let mut dst = vec![0u8; src.len()];
/// vovp_shm::copy::parallel_copy(&mut dst, &src); // 3 MiB: split across the copy pool
/// assert_eq!(dst, src);
/// ```
///
/// # Panics
/// If the lengths differ (a caller bug, never client-controlled).
pub fn parallel_copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "parallel_copy: length mismatch");
    let pool = (src.len() > PARALLEL_COPY_THRESHOLD)
        .then(process_pool)
        .flatten();
    let Some(pool) = pool.filter(|p| p.current_num_threads() >= 2) else {
        dst.copy_from_slice(src);
        return;
    };
    let threads = pool.current_num_threads();
    // One contiguous chunk per thread: measured (vovp-bench, 1 GiB) ~40 % faster than four
    // smaller chunks per thread, which interleave the threads' streams through the memory
    // controller and TLB.
    let chunk = src
        .len()
        .div_ceil(threads)
        .max(MIN_CHUNK)
        .next_multiple_of(4096);
    let copy = Arc::new(ClaimedCopy {
        dst: dst.as_mut_ptr() as usize,
        src: src.as_ptr() as usize,
        len: src.len(),
        chunk,
        chunks: src.len().div_ceil(chunk),
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
    });
    for _ in 1..copy.chunks {
        let helper = copy.clone();
        pool.spawn(move || helper.copy_claimed());
    }
    copy.copy_claimed();
    // Every chunk is claimed; wait for those still being copied by a worker (a few dozen µs
    // at most), yielding in case that worker shares this CPU.
    let mut spins = 0u32;
    while copy.done.load(Ordering::Acquire) < copy.chunks {
        spins += 1;
        if spins < 64 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// The copy pool of this process, built on its first large copy: a rayon pool of one thread
/// per CPU. Per process, not rayon's global pool, because fork() copies only the calling
/// thread: in a child forked after its parent copied, the parent's pool has no workers, so
/// jobs spawned on it would never run and never be freed (a leak per copy, and every chunk
/// copied by the caller). Forked children are common clients (a DataLoader's workers put
/// their batches), so a child builds a pool of its own; the parent's, in the child's memory,
/// is left alone (its threads are not there to stop). `None` when no pool can be built.
pub(crate) fn process_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: AtomicPtr<ProcessPool> = AtomicPtr::new(std::ptr::null_mut());
    let pid = std::process::id();
    let current = POOL.load(Ordering::Acquire);
    // SAFETY: POOL only ever holds null or a leaked `Box<ProcessPool>`, never freed.
    if let Some(p) = unsafe { current.as_ref() }.filter(|p| p.pid == pid) {
        return Some(&p.pool);
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .thread_name(|i| format!("vovp-copy-{i}"))
        .build()
        .ok()?;
    let fresh = Box::into_raw(Box::new(ProcessPool { pid, pool }));
    match POOL.compare_exchange(current, fresh, Ordering::AcqRel, Ordering::Acquire) {
        // (The entry replaced, if any, was a parent's: leaked on purpose, see above.)
        // SAFETY: `fresh` is now POOL's, leaked, never freed.
        Ok(_) => Some(unsafe { &(*fresh).pool }),
        Err(won) => {
            // Another thread of this process built one first: use it, and drop ours (its
            // threads are this process's, so they stop).
            // SAFETY: `fresh` was never shared; `won` is a leaked entry, never freed.
            drop(unsafe { Box::from_raw(fresh) });
            unsafe { won.as_ref() }
                .filter(|p| p.pid == pid)
                .map(|p| &p.pool)
        }
    }
}

/// A copy pool and the process it belongs to.
struct ProcessPool {
    pid: u32,
    pool: rayon::ThreadPool,
}

/// One parallel copy, shared by the caller and the rayon jobs it spawned. The addresses are
/// dereferenced only for a claimed chunk, and `parallel_copy` returns only once every chunk is
/// claimed and copied, so a job that runs after it returned claims nothing and touches neither
/// buffer (it only holds this struct alive).
struct ClaimedCopy {
    dst: usize,
    src: usize,
    len: usize,
    chunk: usize,
    chunks: usize,
    next: AtomicUsize,
    done: AtomicUsize,
}

impl ClaimedCopy {
    fn copy_claimed(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::AcqRel);
            if i >= self.chunks {
                return;
            }
            let start = i * self.chunk;
            let len = self.chunk.min(self.len - start);
            populate_fresh(self.dst + start, len);
            // SAFETY: chunk `i` is this thread's alone (claimed once), lies inside both
            // buffers (start + len <= self.len), and both stay borrowed by `parallel_copy`,
            // which does not return before `done` counts this chunk. `dst` and `src` do not
            // overlap: one is `&mut`, the other `&`.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (self.src + start) as *const u8,
                    (self.dst + start) as *mut u8,
                    len,
                );
            }
            self.done.fetch_add(1, Ordering::AcqRel);
        }
    }
}

/// Maps in, writable, the whole pages of `len` bytes at address `dst` (memory the caller may
/// write: part of a `&mut [u8]`) that look fresh: per [`POPULATE_PIECE`], when its first page
/// is not resident. Only pages wholly inside the range: an edge page may belong to a neighbour
/// (or to no object, where touching it would make a page the store does not count). Where the
/// kernel cannot (before Linux 5.14), the copy's own writes fault the pages in, as without.
fn populate_fresh(dst: usize, len: usize) {
    let page = rustix::param::page_size();
    let end = (dst + len) / page * page;
    let mut at = dst.next_multiple_of(page);
    while at < end {
        let piece_end = at.saturating_add(POPULATE_PIECE).min(end);
        let mut resident = 0u8;
        // SAFETY: `at` is page-aligned and its page lies inside the caller's live mapping; the
        // kernel writes one byte into `resident`.
        let looked = unsafe { libc::mincore(at as *mut libc::c_void, 1, &mut resident) };
        if looked == 0 && resident & 1 == 0 {
            // SAFETY: whole pages inside the caller's writable range; populating only faults
            // them in (as the copy's writes would), it changes no byte.
            let populated = unsafe {
                libc::madvise(
                    at as *mut libc::c_void,
                    piece_end - at,
                    libc::MADV_POPULATE_WRITE,
                )
            };
            if populated != 0 {
                return;
            }
        }
        at = piece_end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_pages_are_populated_and_nothing_outside_the_range() {
        // A shared memfd mapping as the store's: its pages allocated (fallocate), never
        // touched. The copy into an unaligned range in the middle must map in the pages
        // inside and leave the pages on either side untouched (not resident).
        use std::os::fd::AsRawFd;
        let page = rustix::param::page_size();
        let len = 24 << 20;
        let fd = rustix::fs::memfd_create("copy-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, len as u64).unwrap();
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(map, libc::MAP_FAILED);
        let resident = |off: usize| {
            let off = off / page * page;
            let mut v = 0u8;
            let r = unsafe { libc::mincore((map as usize + off) as *mut libc::c_void, 1, &mut v) };
            assert_eq!(r, 0);
            v & 1 == 1
        };
        let (start, n) = (2 * page + 100, (16 << 20) + 7);
        let src: Vec<u8> = (0..n).map(|i| (i % 241) as u8).collect();
        // SAFETY: inside the mapping, which lives until the munmap below.
        let dst = unsafe { std::slice::from_raw_parts_mut((map as usize + start) as *mut u8, n) };
        parallel_copy(dst, &src);
        assert!(dst == &src[..]);
        assert!(!resident(0) && !resident(page), "pages before the range");
        let after = (start + n).next_multiple_of(page);
        assert!(
            !resident(after) && !resident(len - page),
            "pages after the range"
        );
        assert!(resident(3 * page) && resident(start + n - page));
        unsafe { libc::munmap(map, len) };
    }

    #[test]
    fn copies_every_byte_small_and_large() {
        for len in [0usize, 1, 4096, PARALLEL_COPY_THRESHOLD + 1, 5 << 20] {
            let src: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let mut dst = vec![0u8; len];
            parallel_copy(&mut dst, &src);
            assert_eq!(dst, src, "len {len}");
        }
    }

    #[test]
    fn concurrent_copies_each_get_their_own_bytes() {
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                std::thread::spawn(move || {
                    for round in 0..20u8 {
                        let len = 3 << 20;
                        let src: Vec<u8> = (0..len).map(|i| (i as u8) ^ t ^ round).collect();
                        let mut dst = vec![0u8; len];
                        parallel_copy(&mut dst, &src);
                        assert!(dst == src, "thread {t} round {round}");
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("copying thread");
        }
    }

    #[test]
    fn a_forked_child_copies_with_a_pool_of_its_own() {
        // The parent's pool exists (and has workers) before the fork; the child's copy must
        // come out right and run on workers the child started, not on the parent's pool,
        // whose workers the child does not have.
        let len = 8 << 20;
        let src: Vec<u8> = (0..len).map(|i| (i % 249) as u8).collect();
        let mut dst = vec![0u8; len];
        parallel_copy(&mut dst, &src);
        let parent_pool = process_pool().expect("a copy pool") as *const rayon::ThreadPool;
        // SAFETY: the child only copies, reads /proc and exits with _exit (no destructors,
        // no test harness code).
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let mut dst = vec![0u8; len];
            parallel_copy(&mut dst, &src);
            let own = process_pool().map(|p| p as *const rayon::ThreadPool);
            let threads = std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count());
            let code = match (dst == src, own != Some(parent_pool), threads > 1) {
                (false, _, _) => 1,
                (_, false, _) => 2,
                (_, _, false) => 3,
                _ => 0,
            };
            // SAFETY: ends the child at once, as fork's child must in a threaded test.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for the child forked above.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status), "the child did not exit: {status}");
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "1: bytes wrong, 2: the parent's pool, 3: no worker threads in the child"
        );
    }

    #[test]
    fn a_copy_never_waits_for_a_busy_pool() {
        // Occupy every worker of the copy pool until the copy is done: the caller must copy
        // every chunk itself instead of waiting for a worker (with a plain par_chunks this
        // deadlocks, and the timeout below fails the test).
        let pool = process_pool().expect("a copy pool");
        let workers = pool.current_num_threads();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let release_rx = std::sync::Arc::new(std::sync::Mutex::new(release_rx));
        let (busy_tx, busy_rx) = std::sync::mpsc::channel::<()>();
        for _ in 0..workers {
            let rx = release_rx.clone();
            let busy = busy_tx.clone();
            pool.spawn(move || {
                let _ = busy.send(());
                let _ = rx.lock().map(|rx| rx.recv());
            });
        }
        for _ in 0..workers {
            busy_rx.recv().expect("a worker started");
        }
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let src: Vec<u8> = (0..(4 << 20)).map(|i| (i % 253) as u8).collect();
            let mut dst = vec![0u8; src.len()];
            parallel_copy(&mut dst, &src);
            let _ = done_tx.send(dst == src);
        });
        let result = done_rx.recv_timeout(std::time::Duration::from_secs(20));
        for _ in 0..workers {
            let _ = release_tx.send(());
        }
        assert_eq!(
            result,
            Ok(true),
            "the copy waited for the busy pool or copied wrong bytes"
        );
    }
}
