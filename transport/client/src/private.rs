//! Private (copy-on-write) views: a writable view of an object this client may not write in
//! place (a torch result, `writable=True`) of the store's segment or another client's arena.
//! Writes through one stay in this process, and every view shows the object's bytes as the
//! store has them, whatever this process wrote through earlier views of the same memory.
//!
//! A small object's views share one `MAP_PRIVATE` mapping of the segment, under one rule. A
//! page this process writes becomes a *copy* of the page as it was then; once the object there
//! is freed and the store puts another object at that place, the copy is stale. So a new view
//! never trusts a page this process may hold a copy of: it compares its object's bytes there
//! with the segment's (at most [`SHARED_MAX`] bytes, no system call). That is enough: nothing
//! but this process's writes changes a copy, and a copy made once an object is sealed holds
//! its bytes. Where they differ:
//! * on a page another *live* view covers (small objects share pages), the new view takes a
//!   mapping of its own (the copy is that view's, written or not);
//! * on an *idle* page (its last view gone), the copy is dropped (`MADV_DONTNEED` on a private
//!   mapping: the page shows the segment again).
//!
//! Idle pages are not dropped when their last view goes: a stream of small torch results
//! (every one a private view, most never written) would pay a `madvise`, a TLB flush and a
//! fault on the next read per object. They are dropped together once [`IDLE_MAX_BYTES`] of
//! them gather, which also bounds the copies this process keeps.
//!
//! A larger object's view is a mapping of its own, always: the per-page bookkeeping would grow
//! with the object, and its pages are its own anyway (one mmap per view is small beside it).

use std::collections::hash_map::{Entry, HashMap};
use std::fs::File;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use memmap2::{MmapOptions, MmapRaw};
use vovp_types::{Error, Mapped};

/// A segment's private mapping and the pages live views of it cover.
pub(crate) struct PrivateMapping {
    map: MmapRaw,
    /// The unit of copy-on-write: the system's page, or the huge page of a hugetlbfs segment.
    page: u64,
    /// The pages this process may hold a copy of (see [`Pages`]).
    pages: Mutex<Pages>,
    /// Dropping a copy failed once (`mlockall`, a kernel without `MADV_DONTNEED` for huge
    /// pages): every later view takes a mapping of its own.
    poisoned: AtomicBool,
}

/// The largest object whose views share the segment's private mapping.
pub(crate) const SHARED_MAX: u64 = 16 << 10;

/// How many bytes of idle pages (copies, maybe, that no view uses) wait before they are
/// dropped together (at least one page).
pub(crate) const IDLE_MAX_BYTES: u64 = 256 << 10;

/// Pages (index in the segment) of a private mapping that may hold a copy, and how many live
/// views cover each: 0 for an idle page. A page not here holds no copy.
#[derive(Default)]
struct Pages {
    views: HashMap<u64, u32>,
    /// How many entries of `views` are 0.
    idle: u64,
}

/// One private view's hold on its bytes (the owner of what [`private_view`] hands out: it
/// keeps them mapped, and their pages counted).
struct PrivateView {
    mapping: Arc<PrivateMapping>,
    /// Its pages of `mapping` (empty for a zero-byte object or a mapping of its own).
    pages: Range<u64>,
    /// Its mapping of its own, when the shared one could not serve it; unmapped on drop.
    _own: Option<MmapRaw>,
}

impl PrivateMapping {
    /// A private mapping of the whole of `file` (`len` bytes).
    pub(crate) fn map(file: &File, len: usize) -> Result<Self, Error> {
        // SAFETY: a private mapping of the segment's fd: other processes' writes to pages this
        // process has not written show through (the same as the shared read-only mapping).
        let map = unsafe { MmapOptions::new().len(len).map_copy(file) }
            .map_err(|e| Error::Memory(format!("private mapping of a segment: {e}")))?;
        Ok(PrivateMapping {
            map: MmapRaw::from(map),
            page: page_of(file),
            pages: Mutex::new(Pages::default()),
            poisoned: AtomicBool::new(false),
        })
    }
}

/// A writable view of `size` bytes at `offset` of the segment behind `file`, private to this
/// process. `segment` is the segment's shared mapping (the
/// caller checked `offset + size` against the segment).
pub(crate) fn private_view(
    mapping: &Arc<PrivateMapping>,
    file: &File,
    segment: *const u8,
    offset: u64,
    size: u64,
) -> Result<Mapped, Error> {
    let page = mapping.page;
    let pages = offset / page..(offset + size).div_ceil(page);
    if size <= SHARED_MAX && !mapping.poisoned.load(Ordering::Acquire) {
        if let Ok(mut known) = mapping.pages.lock() {
            let object = offset..offset + size;
            if shared_serves(mapping, &mut known, segment, &object, &pages) {
                for p in pages.clone() {
                    known.cover(p);
                }
                drop(known);
                // SAFETY: inside the mapping (the caller checked the bounds).
                let ptr = unsafe { mapping.map.as_mut_ptr().add(offset as usize) };
                let keep = PrivateView {
                    mapping: mapping.clone(),
                    pages,
                    _own: None,
                };
                return Ok(Mapped::host(ptr, size, Arc::new(keep)));
            }
        }
    }
    // A mapping of its own, of whole pages around the object.
    let start = pages.start * page;
    let len = (pages.end * page - start).max(page);
    // SAFETY: as `PrivateMapping::map`'s, of a part of the fd (the caller checked the bounds).
    let own = unsafe {
        MmapOptions::new()
            .offset(start)
            .len(len as usize)
            .map_copy(file)
    }
    .map_err(|e| Error::Memory(format!("private mapping of an object: {e}")))?;
    let own = MmapRaw::from(own);
    // SAFETY: `offset - start` < one page, inside `own`.
    let ptr = unsafe { own.as_mut_ptr().add((offset - start) as usize) };
    let keep = PrivateView {
        mapping: mapping.clone(),
        pages: 0..0,
        _own: Some(own),
    };
    Ok(Mapped::host(ptr, size, Arc::new(keep)))
}

impl Drop for PrivateView {
    fn drop(&mut self) {
        if self.pages.is_empty() {
            return;
        }
        let Ok(mut known) = self.mapping.pages.lock() else {
            // (Only a panic while counting poisons it: views from now on map their own.)
            self.mapping.poisoned.store(true, Ordering::Release);
            return;
        };
        for p in self.pages.clone() {
            known.uncover(p);
        }
        // Under the lock: a view made meanwhile over these pages must find them clean.
        if known.idle * self.mapping.page > IDLE_MAX_BYTES.max(self.mapping.page)
            && !known.drop_idle(&self.mapping)
        {
            self.mapping.poisoned.store(true, Ordering::Release);
        }
    }
}

impl Pages {
    /// One more live view over page `p`.
    fn cover(&mut self, p: u64) {
        match self.views.entry(p) {
            Entry::Vacant(page) => {
                page.insert(1);
            }
            Entry::Occupied(mut page) => {
                if *page.get() == 0 {
                    self.idle -= 1;
                }
                *page.get_mut() += 1;
            }
        }
    }

    /// One live view fewer over page `p`: idle at the last (its copy, if any, kept for now).
    fn uncover(&mut self, p: u64) {
        if let Some(views) = self.views.get_mut(&p).filter(|views| **views > 0) {
            *views -= 1;
            if *views == 0 {
                self.idle += 1;
            }
        }
    }

    /// Drops the copies of every idle page (they show the segment again); false if it failed.
    fn drop_idle(&mut self, mapping: &PrivateMapping) -> bool {
        let mut idle: Vec<u64> = (self.views.iter())
            .filter_map(|(&p, &views)| (views == 0).then_some(p))
            .collect();
        idle.sort_unstable();
        for p in &idle {
            self.views.remove(p);
        }
        self.idle = 0;
        // Every run is tried, even after one failed.
        let mut dropped = true;
        for run in runs(&idle) {
            dropped &= drop_copies(mapping, run);
        }
        dropped
    }
}

/// Whether the shared private mapping shows `object`'s bytes on `pages` (the caller holds
/// `known`): a page a live view covers must show them already; an idle page's copy that does
/// not is dropped here (no view uses it).
fn shared_serves(
    mapping: &PrivateMapping,
    known: &mut Pages,
    segment: *const u8,
    object: &Range<u64>,
    pages: &Range<u64>,
) -> bool {
    let state = |p: &u64| known.views.get(p).copied();
    let covered: Vec<u64> = pages
        .clone()
        .filter(|p| state(p).is_some_and(|n| n > 0))
        .collect();
    if !runs(&covered).all(|run| shows_segment(mapping, segment, object, run)) {
        return false;
    }
    let idle: Vec<u64> = pages.clone().filter(|p| state(p) == Some(0)).collect();
    for run in runs(&idle) {
        if !shows_segment(mapping, segment, object, run.clone()) {
            if !drop_copies(mapping, run.clone()) {
                mapping.poisoned.store(true, Ordering::Release);
                return false;
            }
            for p in run {
                known.views.remove(&p);
                known.idle -= 1;
            }
        }
    }
    true
}

/// Whether `object`'s bytes in `pages` read the same through the private mapping as through
/// the segment's shared mapping (`segment`).
fn shows_segment(
    mapping: &PrivateMapping,
    segment: *const u8,
    object: &Range<u64>,
    pages: Range<u64>,
) -> bool {
    let start = object.start.max(pages.start * mapping.page) as usize;
    let end = object.end.min(pages.end * mapping.page) as usize;
    if start >= end {
        return true;
    }
    // SAFETY: `start..end` lies in the object, inside both whole-segment mappings; the
    // object is sealed (nobody writes its bytes in the segment). Another thread of this
    // process may be writing them through a live view of the same object: then the bytes
    // compared may be torn, which only decides between this mapping and one of its own.
    unsafe {
        let private = std::slice::from_raw_parts(mapping.map.as_ptr().add(start), end - start);
        let shared = std::slice::from_raw_parts(segment.add(start), end - start);
        private == shared
    }
}

/// Drops this process's copies of `pages` (they show the segment again); false if it failed.
fn drop_copies(mapping: &PrivateMapping, pages: Range<u64>) -> bool {
    let page = mapping.page as usize;
    let start = pages.start as usize * page;
    // (The segment's length is a whole number of pages; clamped all the same: madvise past
    // the mapping would reach whatever is mapped after it.)
    let len = ((pages.end - pages.start) as usize * page)
        .min(mapping.map.len() - start.min(mapping.map.len()));
    // SAFETY: whole pages of this private mapping, which no live view covers (the caller
    // holds `live` and removed them): nothing here is anyone's any more.
    unsafe {
        let addr = mapping.map.as_mut_ptr().add(start);
        rustix::mm::madvise(addr.cast(), len, rustix::mm::Advice::LinuxDontNeed).is_ok()
    }
}

/// The segment's unit of copy-on-write: the huge page of a hugetlbfs segment, else the
/// system's page. (Not `st_blksize`: a memfd reports 2 MiB when shmem may use transparent huge
/// pages, but a private mapping still copies 4 KiB pages.)
fn page_of(file: &File) -> u64 {
    const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;
    let system = rustix::param::page_size() as u64;
    // (`f_type`'s integer type differs between targets.)
    #[allow(clippy::unnecessary_cast)]
    match rustix::fs::fstatfs(file) {
        Ok(fs) if fs.f_type as i64 == HUGETLBFS_MAGIC => (fs.f_bsize as u64).max(system),
        _ => system,
    }
}

/// Runs of consecutive numbers in `sorted`, as ranges.
fn runs(sorted: &[u64]) -> impl Iterator<Item = Range<u64>> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        let start = *sorted.get(i)?;
        let mut end = start + 1;
        i += 1;
        while sorted.get(i) == Some(&end) {
            end += 1;
            i += 1;
        }
        Some(start..end)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::FileExt;

    /// A segment of `pages` zeroed pages, and its shared mapping's start (kept by the map).
    fn segment(pages: usize) -> (File, MmapRaw) {
        let fd = rustix::fs::memfd_create("vovp-private-test", rustix::fs::MemfdFlags::CLOEXEC)
            .expect("memfd");
        let mut file = File::from(fd);
        file.write_all(&vec![0u8; pages * 4096]).expect("write");
        let shared = MmapOptions::new().map_raw_read_only(&file).expect("map");
        (file, shared)
    }

    /// A view's address, and the view (which keeps it).
    fn split(view: Mapped) -> (*mut u8, Mapped) {
        (view.ptr, view)
    }

    #[test]
    fn runs_group_consecutive_pages() {
        let r: Vec<_> = runs(&[1, 2, 3, 7, 9, 10]).collect();
        assert_eq!(r, vec![1..4, 7..8, 9..11]);
        assert_eq!(runs(&[]).count(), 0);
    }

    /// The bug this module exists for: a copy made by a write through one view must not show
    /// through a later view of new bytes at the same place.
    #[test]
    fn a_page_written_through_a_dead_view_shows_the_segment_again() {
        let (file, shared) = segment(4);
        let mapping = Arc::new(PrivateMapping::map(&file, 4 * 4096).expect("map"));
        let (ptr, keep) =
            split(private_view(&mapping, &file, shared.as_ptr(), 100, 16).expect("view"));
        // SAFETY: 16 bytes of the view.
        unsafe { ptr.write(99) };
        drop(keep);
        // Another object at the same place: the segment's bytes change (the store's write).
        file.write_all_at(&[7u8; 16], 100).expect("write");
        let (ptr, _keep) =
            split(private_view(&mapping, &file, shared.as_ptr(), 100, 16).expect("view"));
        // SAFETY: as above.
        assert_eq!(unsafe { ptr.read() }, 7);
    }

    #[test]
    fn a_page_a_live_written_view_covers_gives_a_new_object_a_mapping_of_its_own() {
        let (file, shared) = segment(4);
        let mapping = Arc::new(PrivateMapping::map(&file, 4 * 4096).expect("map"));
        let (a, _keep_a) =
            split(private_view(&mapping, &file, shared.as_ptr(), 0, 64).expect("view"));
        // SAFETY: inside a's 64 bytes.
        unsafe { a.write(1) };
        // A new object is written after a's page was copied, then viewed.
        file.write_all_at(&[5u8; 64], 64).expect("write");
        let (b, _keep_b) =
            split(private_view(&mapping, &file, shared.as_ptr(), 64, 64).expect("view"));
        // SAFETY: inside b's 64 bytes.
        assert_eq!(unsafe { b.read() }, 5);
        // a's write stays a's, and b's own writes stay in this process.
        assert_eq!(unsafe { a.read() }, 1);
        unsafe { b.write(6) };
        let mut on_file = [0u8; 1];
        file.read_exact_at(&mut on_file, 64).expect("read");
        assert_eq!(on_file[0], 5);
    }

    #[test]
    fn views_of_unwritten_pages_share_the_mapping() {
        let (file, shared) = segment(4);
        let mapping = Arc::new(PrivateMapping::map(&file, 4 * 4096).expect("map"));
        let base = mapping.map.as_ptr() as usize;
        let (a, _ka) = split(private_view(&mapping, &file, shared.as_ptr(), 0, 64).expect("view"));
        let (b, _kb) = split(private_view(&mapping, &file, shared.as_ptr(), 64, 64).expect("view"));
        assert_eq!(a as usize, base);
        assert_eq!(b as usize, base + 64);
        assert_eq!(mapping.pages.lock().expect("lock").views.get(&0), Some(&2));
    }

    /// Another view of an object this process wrote through a live view shows the store's
    /// bytes (a mapping of its own), not those writes.
    #[test]
    fn a_second_view_of_a_written_object_shows_the_store_bytes() {
        let (file, shared) = segment(2);
        let mapping = Arc::new(PrivateMapping::map(&file, 2 * 4096).expect("map"));
        let (a, _keep_a) =
            split(private_view(&mapping, &file, shared.as_ptr(), 8, 8).expect("view"));
        // SAFETY: inside the 8 bytes viewed (here and below).
        unsafe { a.write(3) };
        let (b, _keep_b) =
            split(private_view(&mapping, &file, shared.as_ptr(), 8, 8).expect("view"));
        assert_ne!(b, a);
        assert_eq!(unsafe { (b.read(), a.read()) }, (0, 3));
    }

    /// The same object got again while the same slot's old view lives on (its reference given
    /// back early): the new one compares and shows the new bytes.
    #[test]
    fn a_new_object_in_a_slot_whose_old_view_lives_on_shows_its_own_bytes() {
        let (file, shared) = segment(4);
        let mapping = Arc::new(PrivateMapping::map(&file, 4 * 4096).expect("map"));
        let (old, _keep_old) =
            split(private_view(&mapping, &file, shared.as_ptr(), 0, 8192).expect("view"));
        // SAFETY: inside the 8 KiB viewed (here and below).
        unsafe { old.write_bytes(7, 8192) };
        file.write_all_at(&[5u8; 8192], 0).expect("write");
        let (new, _keep_new) =
            split(private_view(&mapping, &file, shared.as_ptr(), 0, 8192).expect("view"));
        assert_eq!(unsafe { (new.read(), new.add(8191).read()) }, (5, 5));
    }

    /// Objects over SHARED_MAX get mappings of their own and leave no bookkeeping behind.
    #[test]
    fn a_large_object_gets_a_mapping_of_its_own() {
        let pages = (SHARED_MAX / 4096 + 2) as usize;
        let (file, shared) = segment(pages);
        let len = pages as u64 * 4096;
        let mapping = Arc::new(PrivateMapping::map(&file, len as usize).expect("map"));
        let (big, keep) =
            split(private_view(&mapping, &file, shared.as_ptr(), 0, len).expect("view"));
        assert_ne!(big as usize, mapping.map.as_ptr() as usize);
        assert!(mapping.pages.lock().expect("lock").views.is_empty());
        // SAFETY: inside the view.
        unsafe { big.add(len as usize - 1).write(1) };
        drop(keep);
        let mut on_file = [9u8; 1];
        file.read_exact_at(&mut on_file, len - 1).expect("read");
        assert_eq!(on_file[0], 0);
    }

    /// An idle page written through its dead view: a new object elsewhere on it (written by the
    /// store after the copy) shows its own bytes, through the shared mapping (the copy dropped).
    #[test]
    fn a_written_idle_page_is_dropped_for_a_new_object_that_differs() {
        let (file, shared) = segment(2);
        let mapping = Arc::new(PrivateMapping::map(&file, 2 * 4096).expect("map"));
        let (a, keep) = split(private_view(&mapping, &file, shared.as_ptr(), 0, 64).expect("view"));
        // SAFETY: inside a's 64 bytes.
        unsafe { a.write(1) };
        drop(keep);
        assert_eq!(mapping.pages.lock().expect("lock").idle, 1);
        file.write_all_at(&[5u8; 64], 64).expect("write");
        let (b, _keep_b) =
            split(private_view(&mapping, &file, shared.as_ptr(), 64, 64).expect("view"));
        assert_eq!(b as usize, mapping.map.as_ptr() as usize + 64);
        // SAFETY: inside b's 64 bytes; byte 0 is on the same page, in no live object.
        assert_eq!(unsafe { (b.read(), a.read()) }, (5, 0));
        let known = mapping.pages.lock().expect("lock");
        assert_eq!((known.idle, known.views.get(&0)), (0, Some(&1)));
    }

    /// Idle pages stay mapped (no system call per view) until IDLE_MAX_BYTES of them gather;
    /// then all go together.
    #[test]
    fn idle_pages_are_dropped_together_once_enough_gather() {
        let bound = (IDLE_MAX_BYTES / 4096) as usize;
        let (file, shared) = segment(bound + 1);
        let len = (bound + 1) * 4096;
        let mapping = Arc::new(PrivateMapping::map(&file, len).expect("map"));
        for p in 0..bound {
            let offset = p as u64 * 4096;
            let view = private_view(&mapping, &file, shared.as_ptr(), offset, 64).expect("view");
            drop(view);
            let known = mapping.pages.lock().expect("lock");
            assert_eq!(known.idle as usize, p + 1);
        }
        // One more idle page passes the bound: every idle page is dropped.
        let offset = bound as u64 * 4096;
        drop(private_view(&mapping, &file, shared.as_ptr(), offset, 64).expect("view"));
        let known = mapping.pages.lock().expect("lock");
        assert_eq!((known.idle, known.views.len()), (0, 0));
    }

    #[test]
    fn page_of_a_memfd_is_the_system_page() {
        let (file, _shared) = segment(1);
        assert_eq!(page_of(&file), rustix::param::page_size() as u64);
    }
}
