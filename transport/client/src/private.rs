//! Private (copy-on-write) views: a writable view of an object this client may not write in
//! place (a torch result, `writable=True`) of the store's segment or another client's arena.
//! Writes through one stay in this process.
//!
//! One `MAP_PRIVATE` mapping per segment serves them all, under one rule. A page this process
//! writes becomes a *copy* of the page as it was then; once the object there is freed and the
//! store puts another object at that place, the copy is stale, and a view of the new object
//! through it would read the old bytes. So pages leave private use clean: when the last
//! private view over a page goes, its copy is dropped (`MADV_DONTNEED` on a private mapping:
//! the page shows the segment again). A page another *live* private view still covers (two
//! small objects in one page) may hold a copy made before the new view's object was written:
//! the new view compares its bytes there with the segment's (a few KiB at most, no system
//! call) and takes a mapping of its own if they differ. That comparison is enough: a copy
//! made once an object is written holds its final bytes, and nothing but this process's own
//! writes changes a copy. A page whose live views are all of the same object needs no
//! comparison for another view of it (which then shares this process's writes to it, as two
//! views of one array would; a get after every view has gone shows the store's bytes again).

use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use memmap2::{MmapOptions, MmapRaw};
use vovp_types::Error;

/// What keeps a private view's bytes mapped (and its pages counted): the `Arc` handed out
/// with the pointer.
pub(crate) type Keep = Arc<dyn std::any::Any + Send + Sync>;

/// A segment's private mapping and the pages live views of it cover.
pub(crate) struct PrivateMapping {
    map: MmapRaw,
    /// The unit of copy-on-write: the segment's page (its fd's block size: a huge page for a
    /// huge-page segment).
    page: u64,
    /// Pages (index in the segment) under live views of `map`. A page not here holds no copy.
    live: Mutex<HashMap<u64, LivePage>>,
    /// Dropping a copy failed once (a kernel without `MADV_DONTNEED` for huge pages): every
    /// later view takes a mapping of its own.
    poisoned: AtomicBool,
}

/// A page under live private views.
struct LivePage {
    views: u32,
    /// The object (offset, size) every one of them views, if they all view the same one.
    object: Option<(u64, u64)>,
}

/// One private view's hold on its bytes (the `Keep` of [`private_view`]).
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
            live: Mutex::new(HashMap::new()),
            poisoned: AtomicBool::new(false),
        })
    }
}

/// A writable view of `size` bytes at `offset` of the segment behind `file`, private to this
/// process: its address and what keeps it. `segment` is the segment's shared mapping (the
/// caller checked `offset + size` against the segment).
pub(crate) fn private_view(
    mapping: &Arc<PrivateMapping>,
    file: &File,
    segment: *const u8,
    offset: u64,
    size: u64,
) -> Result<(*mut u8, Keep), Error> {
    let page = mapping.page;
    let pages = offset / page..(offset + size).div_ceil(page);
    let object = Some((offset, size));
    let mut live = lock(&mapping.live)?;
    let shared = !mapping.poisoned.load(Ordering::Acquire) && {
        // Pages another live view covers may hold a copy older than this object (unless
        // they are all views of this object).
        let covered: Vec<u64> = (pages.clone())
            .filter(|p| live.get(p).is_some_and(|l| l.object != object))
            .collect();
        let object = offset..offset + size;
        let clean = runs(&covered).all(|run| shows_segment(mapping, segment, &object, run));
        clean
    };
    if shared {
        for p in pages.clone() {
            let page = live.entry(p).or_insert(LivePage { views: 0, object });
            if page.object != object {
                page.object = None;
            }
            page.views += 1;
        }
        drop(live);
        // SAFETY: inside the mapping (the caller checked the bounds).
        let ptr = unsafe { mapping.map.as_mut_ptr().add(offset as usize) };
        let keep = PrivateView {
            mapping: mapping.clone(),
            pages,
            _own: None,
        };
        return Ok((ptr, Arc::new(keep)));
    }
    drop(live);
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
    Ok((ptr, Arc::new(keep)))
}

impl Drop for PrivateView {
    fn drop(&mut self) {
        let Ok(mut live) = self.mapping.live.lock() else {
            // (Only a panic while counting poisons it: views from now on map their own.)
            self.mapping.poisoned.store(true, Ordering::Release);
            return;
        };
        let mut freed = Vec::new();
        for p in self.pages.clone() {
            if let Some(page) = live.get_mut(&p) {
                page.views -= 1;
                if page.views == 0 {
                    live.remove(&p);
                    freed.push(p);
                }
            }
        }
        // Under the lock: a view made meanwhile over these pages must find them clean.
        for run in runs(&freed) {
            if !drop_copies(&self.mapping, run) {
                self.mapping.poisoned.store(true, Ordering::Release);
            }
        }
    }
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
    // object is sealed (nobody writes its bytes in the segment), and this process's writes to
    // its private copy are made through views the caller's lock keeps from changing pages
    // under a new view.
    unsafe {
        let private = std::slice::from_raw_parts(mapping.map.as_ptr().add(start), end - start);
        let shared = std::slice::from_raw_parts(segment.add(start), end - start);
        private == shared
    }
}

/// Drops this process's copies of `pages` (they show the segment again); false if it failed.
fn drop_copies(mapping: &PrivateMapping, pages: Range<u64>) -> bool {
    let page = mapping.page as usize;
    let len = (pages.end - pages.start) as usize * page;
    // SAFETY: whole pages of this private mapping, which no live view covers (the caller
    // holds `live` and removed them): nothing here is anyone's any more.
    unsafe {
        let addr = mapping.map.as_mut_ptr().add(pages.start as usize * page);
        rustix::mm::madvise(addr.cast(), len, rustix::mm::Advice::LinuxDontNeed).is_ok()
    }
}

/// The segment's page size: its fd's block size (4 KiB for memfd pages, the huge page's size
/// on hugetlbfs), never below 4 KiB.
fn page_of(file: &File) -> u64 {
    let blksize = file.metadata().map(|m| m.blksize()).unwrap_or(4096);
    if blksize.is_power_of_two() {
        blksize.max(4096)
    } else {
        4096
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

fn lock<T>(m: &Mutex<T>) -> Result<std::sync::MutexGuard<'_, T>, Error> {
    m.lock()
        .map_err(|_| Error::Internal("private mapping's page counts poisoned".into()))
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
        let (ptr, keep) = private_view(&mapping, &file, shared.as_ptr(), 100, 16).expect("view");
        // SAFETY: 16 bytes of the view.
        unsafe { ptr.write(99) };
        drop(keep);
        // Another object at the same place: the segment's bytes change (the store's write).
        file.write_all_at(&[7u8; 16], 100).expect("write");
        let (ptr, _keep) = private_view(&mapping, &file, shared.as_ptr(), 100, 16).expect("view");
        // SAFETY: as above.
        assert_eq!(unsafe { ptr.read() }, 7);
    }

    #[test]
    fn a_page_a_live_written_view_covers_gives_a_new_object_a_mapping_of_its_own() {
        let (file, shared) = segment(4);
        let mapping = Arc::new(PrivateMapping::map(&file, 4 * 4096).expect("map"));
        let (a, _keep_a) = private_view(&mapping, &file, shared.as_ptr(), 0, 64).expect("view");
        // SAFETY: inside a's 64 bytes.
        unsafe { a.write(1) };
        // A new object is written after a's page was copied, then viewed.
        file.write_all_at(&[5u8; 64], 64).expect("write");
        let (b, _keep_b) = private_view(&mapping, &file, shared.as_ptr(), 64, 64).expect("view");
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
        let (a, _ka) = private_view(&mapping, &file, shared.as_ptr(), 0, 64).expect("view");
        let (b, _kb) = private_view(&mapping, &file, shared.as_ptr(), 64, 64).expect("view");
        assert_eq!(a as usize, base);
        assert_eq!(b as usize, base + 64);
        assert_eq!(
            mapping.live.lock().expect("lock").get(&0).map(|p| p.views),
            Some(2)
        );
    }

    #[test]
    fn live_views_of_one_object_share_this_process_writes_until_the_last_goes() {
        let (file, shared) = segment(2);
        let mapping = Arc::new(PrivateMapping::map(&file, 2 * 4096).expect("map"));
        let (a, keep_a) = private_view(&mapping, &file, shared.as_ptr(), 8, 8).expect("view");
        // SAFETY: inside the 8 bytes viewed (here and below).
        unsafe { a.write(3) };
        let (b, keep_b) = private_view(&mapping, &file, shared.as_ptr(), 8, 8).expect("view");
        assert_eq!(b, a);
        drop((keep_a, keep_b));
        let (c, _keep_c) = private_view(&mapping, &file, shared.as_ptr(), 8, 8).expect("view");
        assert_eq!(unsafe { c.read() }, 0);
    }
}
