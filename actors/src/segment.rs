//! Host memory: memfd-backed segments mapped shared, so the fd can be passed to other processes
//! and every process sees the same physical pages.
//!
//! Each memfd is sealed against shrinking and growing (`F_SEAL_SHRINK | F_SEAL_GROW |
//! F_SEAL_SEAL`: no client holding an fd can make the daemon fault), mode 0600, with a
//! read-only reopening (`/proc/self/fd/N`, `O_RDONLY`) that is what readers get. Segments are
//! sparse until touched; `--huge-pages` uses 2 MiB `MFD_HUGETLB` pages and falls back with a
//! warning. The store's mapping reserves a huge-page segment's pages when it is made; clients
//! map segments `MAP_NORESERVE`, since the store backs every page an object needs before
//! handing it out (a client's mapping would otherwise re-reserve pages the store gave back to
//! the pool, and fail once the pool is empty). Which segment an object goes to (segment 0, the
//! client arenas) is the allocator's ([`crate::allocator`]).
//!
//! # What isolation does and does not cover
//!
//! Only the creating connection gets an arena's read-write fd; every other client gets the
//! read-only one, so a client can write only memory of objects it created: a write through a
//! view it got is SIGSEGV, and a hole punch (`fallocate`, `MADV_REMOVE`) through a read-only fd
//! fails. A client of another uid (`--allow-uid`) has only read-only fds (with `--prefault`
//! too, where it can therefore put only inline: a CREATE lands in segment 0, which it cannot
//! write, and its client says so), and mode 0600 stops it reopening them read-write. Processes
//! of the daemon's own uid are protected against accidents (stray writes through views,
//! numpy/ctypes bugs), not against deliberate attack: Linux lets a same-uid process reopen
//! `/proc/self/fd/N` read-write or ptrace another client. Sealing arenas with
//! `F_SEAL_FUTURE_WRITE` would stop the reopen but also the daemon's own hole punching (the
//! memory budget), and ptrace would remain: run untrusted clients under another uid.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd};

use memfd::{FileSeal, HugetlbSize, MemfdOptions};
use memmap2::{MmapOptions, MmapRaw};

use vovp_types::Error;

const HUGE_PAGE: u64 = 2 * 1024 * 1024;
/// The base page (x86-64, most arm64 kernels). Where it is larger, the allocator's page
/// accounting undercounts partly used pages (punching stays correct: it only zeroes free bytes).
const PAGE: u64 = 4096;

/// One shared-memory segment: a sealed-size memfd, a read-only reopening of it for readers,
/// and the store's own mapping of it.
pub struct Segment {
    id: u32,
    file: File,
    /// The same memfd opened O_RDONLY: what clients that may only read get. It cannot be
    /// mapped writable, written, or used to punch holes.
    read_only: File,
    map: MmapRaw,
    huge_pages: bool,
    /// Every page was populated at creation (`--prefault`).
    prefaulted: bool,
}

impl Segment {
    /// Creates a segment of `size` bytes. With `huge_pages` it tries 2 MiB `MFD_HUGETLB` pages and
    /// falls back to normal pages (with a warning) when the machine has none reserved.
    /// `prefault` populates every page now, so the first put does not pay page faults.
    pub fn create(id: u32, size: u64, huge_pages: bool, prefault: bool) -> Result<Self, Error> {
        if huge_pages {
            let rounded = size.div_ceil(HUGE_PAGE) * HUGE_PAGE;
            match Self::create_with(id, rounded, Some(HugetlbSize::Huge2MB), prefault) {
                Ok(seg) => return Ok(seg),
                Err(e) => tracing::warn!(
                    "huge pages requested but unavailable ({e}); using normal pages. \
                     Reserve some with `echo N > /proc/sys/vm/nr_hugepages`."
                ),
            }
        }
        Self::create_with(id, size, None, prefault)
    }

    /// A segment for one client's objects (an arena): like [`Segment::create`], never prefaulted
    /// (its pages are touched by the client that writes them).
    pub fn create_arena(id: u32, size: u64, huge_pages: bool) -> Result<Self, Error> {
        Self::create(id, size, huge_pages, false)
    }

    fn create_with(
        id: u32,
        size: u64,
        hugetlb: Option<HugetlbSize>,
        prefault: bool,
    ) -> Result<Self, Error> {
        let err = |what: &str, e: &dyn std::fmt::Display| {
            Error::Memory(format!("{what} ({size} bytes): {e}"))
        };
        let memfd = MemfdOptions::new()
            .close_on_exec(true)
            .allow_sealing(true)
            .hugetlb(hugetlb)
            .create(format!("vovp-segment-{id}"))
            .map_err(|e| err("memfd_create", &e))?;
        memfd
            .as_file()
            .set_len(size)
            .map_err(|e| err("ftruncate", &e))?;
        // Clients get this fd: sealing the size means no client can shrink it under the
        // store and make the daemon fault (SIGBUS) on its own mapping.
        memfd
            .add_seals(&[FileSeal::SealShrink, FileSeal::SealGrow, FileSeal::SealSeal])
            .map_err(|e| err("sealing the memfd", &e))?;
        let file = memfd.into_file();
        // Owner-only permissions: a client of another uid (--allow-uid) cannot reopen its
        // read-only fd read-write through /proc/self/fd.
        rustix::fs::fchmod(&file, rustix::fs::Mode::from_raw_mode(0o600))
            .map_err(|e| err("fchmod", &e))?;
        let read_only = File::from(
            rustix::fs::open(
                format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&file)),
                rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
                rustix::fs::Mode::empty(),
            )
            .map_err(|e| err("reopening the memfd read-only", &e))?,
        );
        let mut opts = MmapOptions::new();
        opts.len(size as usize);
        if prefault {
            opts.populate();
        }
        let map = opts.map_raw(&file).map_err(|e| err("mmap", &e))?;
        Ok(Segment {
            id,
            file,
            read_only,
            map,
            huge_pages: hugetlb.is_some(),
            prefaulted: prefault,
        })
    }

    pub fn id(&self) -> u32 {
        self.id
    }

    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    pub fn uses_huge_pages(&self) -> bool {
        self.huge_pages
    }

    /// The memfd, read-write: only for the client whose objects the segment holds.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// The memfd, read-only: for every other client.
    pub fn read_only_fd(&self) -> BorrowedFd<'_> {
        self.read_only.as_fd()
    }

    /// Gives the pages of `offset..offset + len` back to the kernel (the range must hold no
    /// live object). Only whole pages inside the range are released.
    pub fn punch(&self, offset: u64, len: u64) {
        let page = self.page_size();
        let start = offset.next_multiple_of(page);
        let end = offset.saturating_add(len) / page * page;
        if end <= start {
            return;
        }
        let flags = rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE;
        if let Err(e) = rustix::fs::fallocate(&self.file, flags, start, end - start) {
            tracing::debug!("punching segment {}: {e}", self.id);
        }
    }

    /// The unit in which the kernel backs this segment: 4 KiB, or 2 MiB with huge pages.
    pub fn page_size(&self) -> u64 {
        if self.huge_pages {
            HUGE_PAGE
        } else {
            PAGE
        }
    }

    /// Whether every page was populated when the segment was made (`--prefault`).
    pub fn prefaulted(&self) -> bool {
        self.prefaulted
    }

    /// Allocates the pages of `offset..offset + len` now (`fallocate`), so that touching them
    /// later cannot fail: without it the first touch of a page the machine (or the memory
    /// cgroup) cannot back is SIGBUS in the client, or the OOM killer. Fails with ENOMEM or
    /// ENOSPC (huge pages: none left in the pool) instead; pages that were backed before the
    /// failure stay allocated (the caller punches them back). The pages are not zeroed here
    /// (shmem clears a page when it is first mapped), so this costs the allocation alone.
    pub fn back(&self, offset: u64, len: u64) -> Result<(), rustix::io::Errno> {
        if len == 0 {
            return Ok(());
        }
        rustix::fs::fallocate(
            &self.file,
            rustix::fs::FallocateFlags::KEEP_SIZE,
            offset,
            len,
        )
    }

    /// Bytes of memory the kernel has allocated to this segment now (its pages, `st_blocks`),
    /// whoever touched them.
    pub fn allocated_bytes(&self) -> u64 {
        rustix::fs::fstat(&self.file)
            .map(|st| st.st_blocks as u64 * 512)
            .unwrap_or(0)
    }

    /// The byte ranges the kernel holds pages for (`SEEK_DATA`/`SEEK_HOLE`), in order: where
    /// [`Segment::allocated_bytes`] counts them, this says which they are.
    pub fn data_extents(&self) -> Vec<(u64, u64)> {
        use rustix::fs::{seek, SeekFrom};
        let mut out = Vec::new();
        let mut at = 0u64;
        while at < self.len() {
            let Ok(start) = seek(&self.file, SeekFrom::Data(at)) else {
                break; // ENXIO: no data past `at`
            };
            let end = seek(&self.file, SeekFrom::Hole(start)).unwrap_or(self.len());
            if end <= start {
                break;
            }
            out.push((start, end));
            at = end;
        }
        out
    }

    /// Pointer to `offset` inside the store's mapping, if `offset + len` fits.
    pub fn ptr(&self, offset: u64, len: u64) -> Option<*mut u8> {
        let end = offset.checked_add(len)?;
        if end > self.len() {
            return None;
        }
        // SAFETY: offset is within the mapping (checked above).
        Some(unsafe { self.map.as_mut_ptr().add(offset as usize) })
    }
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment")
            .field("id", &self.id)
            .field("len", &self.len())
            .field("huge_pages", &self.huge_pages)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_is_zeroed_writable_and_size_sealed() {
        let seg = Segment::create(0, 1 << 20, false, false).unwrap();
        let p = seg.ptr(4096, 8).unwrap();
        unsafe {
            assert_eq!(*p, 0);
            *p = 7;
            assert_eq!(*p, 7);
        }
        assert!(seg.ptr(1 << 20, 1).is_none());
        // The size is sealed: a client holding the fd cannot shrink it.
        let dup = seg.file.try_clone().unwrap();
        assert!(dup.set_len(4096).is_err());
    }

    #[test]
    fn the_read_only_fd_cannot_write_map_writable_or_punch() {
        use std::os::fd::AsRawFd;
        let seg = Segment::create(0, 1 << 20, false, false).unwrap();
        let ro = seg.read_only_fd();
        let writable = MmapOptions::new().len(1 << 20).map_raw(ro.as_raw_fd());
        assert!(
            writable.is_err(),
            "a writable shared mapping of the read-only fd"
        );
        let flags = rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE;
        assert!(rustix::fs::fallocate(ro, flags, 0, 4096).is_err());
        assert!(rustix::io::write(ro, b"x").is_err());
        // Punching through the store's own fd releases the pages: they read as zero again.
        let p = seg.ptr(8192, 1).unwrap();
        unsafe { *p = 9 };
        seg.punch(8192, 4096);
        assert_eq!(unsafe { *p }, 0);
    }

    #[test]
    fn huge_pages_fall_back_when_unavailable() {
        let pool = || {
            let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
            meminfo
                .lines()
                .find_map(|l| l.strip_prefix("HugePages_Total:"))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or(0)
        };
        let (before, seg, after) = (
            pool(),
            Segment::create(0, 3 << 20, true, false).unwrap(),
            pool(),
        );
        if seg.uses_huge_pages() {
            // From the pool: whole 2 MiB pages, counted and punched as such.
            assert_eq!((seg.len(), seg.page_size()), (4 << 20, HUGE_PAGE));
        } else {
            // The fallback: normal pages, the size asked for.
            assert_eq!((seg.len(), seg.page_size()), (3 << 20, PAGE));
        }
        if before == 0 && after == 0 {
            assert!(!seg.uses_huge_pages(), "huge pages from an empty pool");
        }
        // Normal pages when none are asked for, whatever the pool holds.
        assert!(!Segment::create(1, 3 << 20, false, false)
            .unwrap()
            .uses_huge_pages());
    }
}
