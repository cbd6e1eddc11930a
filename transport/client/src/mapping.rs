//! The segments mapped into this process and how an object's location becomes an address:
//! what a view or a buffer points into. No I/O.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use memmap2::{MmapOptions, MmapRaw};
use vovp_types::{Error, Location, Mapped, ObjectBuffer, ObjectRef, ObjectSink, ObjectView};

use crate::private::{self, PrivateMapping};
use vovp_shm::held::{held_view, Holder};
use vovp_shm::SharedReader;
use vovp_types::lends::SMALL_MAX_BLOCK;

/// One shared-memory segment mapped into this process: read-only unless it is one of this
/// client's own arenas (the daemon decides, by the fd it hands over).
pub(crate) struct MappedSegment {
    map: MmapRaw,
    writable: bool,
    /// One of this client's own arenas (writes in place are its own objects' bytes). Segment
    /// 0 may be writable (`--prefault`) but is everyone's: private views of it stay private.
    own: bool,
    /// The segment's fd, kept for private copy-on-write mappings made on demand
    /// ([`crate::Client::private_view`]).
    file: File,
    private: OnceLock<Arc<PrivateMapping>>,
}

// SAFETY: the mapping is shared memory addressed through raw pointers only.
unsafe impl Send for MappedSegment {}
unsafe impl Sync for MappedSegment {}

impl MappedSegment {
    /// `own`: one of this client's arenas (else the store's segment 0, writable or not).
    pub(crate) fn map(fd: OwnedFd, size: u64, writable: bool, own: bool) -> Result<Self, Error> {
        let file = File::from(fd);
        // A mapping past the file's end faults (SIGBUS) on first touch: a segment whose fd is
        // smaller than announced is the daemon's error, reported here, never a crash later.
        let actual = file
            .metadata()
            .map_err(|e| Error::Memory(format!("a segment's fd: {e}")))?
            .len();
        if actual < size {
            return Err(Error::Protocol(format!(
                "a segment of {size} bytes was announced, its fd holds {actual}"
            )));
        }
        let mut opts = MmapOptions::new();
        opts.len(usize::try_from(size).map_err(|_| Error::Protocol("segment size".into()))?);
        // MAP_NORESERVE: the store backs every page an object needs before it hands the object
        // out (`fallocate` at create; not with `--lazy-pages`, which leaves first touches to
        // fault anyway), so a client needs no reservation of its own. Without it, a client
        // mapping a huge-page segment (`--huge-pages`) reserved again every page the store
        // had given back to the pool, and could not map the segment at all (HELLO failed,
        // ENOMEM) once the pool had no page to spare. (Normal memfd pages are not reserved
        // per mapping: no change there.)
        opts.no_reserve_swap();
        let map = if writable {
            opts.map_raw(&file)
        } else {
            opts.map_raw_read_only(&file)
        }
        .map_err(|e| Error::Memory(format!("mapping a segment of {size} bytes: {e}")))?;
        Ok(MappedSegment {
            map,
            writable,
            own: own && writable,
            file,
            private: OnceLock::new(),
        })
    }

    /// Whether this is one of this client's own arenas, mapped read-write.
    pub(crate) fn is_own(&self) -> bool {
        self.own
    }

    pub(crate) fn len(&self) -> u64 {
        self.map.len() as u64
    }

    /// Whether [`MappedSegment::private_view`] of `size` bytes would answer without mapping
    /// the whole segment (in place, or its private mapping made already; what may remain is a
    /// mapping of the object's own pages, `crate::private`).
    pub(crate) fn private_ready(&self, size: u64) -> bool {
        self.viewed_in_place(size) || self.private.get().is_some()
    }

    /// Whether [`MappedSegment::private_view`] of `size` bytes is the shared mapping itself:
    /// a large object of this client's own arena (its doc says why).
    fn viewed_in_place(&self, size: u64) -> bool {
        self.own && size > SMALL_MAX_BLOCK
    }

    /// Start of this client's own arena, mapped read-write (where its lends are).
    pub(crate) fn own_base(&self) -> Result<*mut u8, Error> {
        if self.own {
            Ok(self.map.as_mut_ptr())
        } else {
            Err(Error::Internal("not one of this client's arenas".into()))
        }
    }

    /// A writable view of `size` bytes at `offset` (checked against the segment), private to
    /// this process (`crate::private`) — also in segment 0 when the store hands it out
    /// read-write (`--prefault`): others' objects there are not this client's to change —
    /// except a large object in this client's own arena, viewed in place.
    ///
    /// Why small ones are private even in one's own arena: small puts live in this client's
    /// small lend and were in the store's segment before (their torch results private, and
    /// tests and users rely on that); a large one was written in place through a lend, and a
    /// private view of it would fault every page in again.
    pub(crate) fn private_view(self: &Arc<Self>, offset: u64, size: u64) -> Result<Mapped, Error> {
        if offset.saturating_add(size) > self.len() {
            return Err(Error::Protocol("object outside its segment".into()));
        }
        if self.viewed_in_place(size) {
            // SAFETY: in bounds (checked above), kept mapped by the returned owner.
            let ptr = unsafe { self.map.as_mut_ptr().add(offset as usize) };
            return Ok(Mapped::host(ptr, size, self.clone()));
        }
        let mapping = match self.private.get() {
            Some(m) => m,
            None => {
                let m = Arc::new(PrivateMapping::map(&self.file, self.map.len())?);
                self.private.get_or_init(|| m)
            }
        };
        private::private_view(mapping, &self.file, self.map.as_ptr(), offset, size)
    }
}

/// A mapped segment as the client keeps it: the store's segment and the client's own arenas
/// for the connection's life; other clients' arenas only while a view into them lives (the
/// views hold the mapping), so an arena the daemon dropped is unmapped here too.
enum SegmentSlot {
    Kept(Arc<MappedSegment>),
    WhileViewed(Weak<MappedSegment>),
}

/// Other clients' arenas kept mapped after their last view here goes, most recent first: a
/// get through the shared directory needs the object's segment mapped already (else it asks
/// over the socket), and re-mapping per get would cost more than the get. Bounded, because an
/// arena whose owner has gone stays alive (punched, so not resident) while anyone maps it.
const RECENT_ARENAS: usize = 32;

/// One connection's mappings and what its HELLO said.
pub(crate) struct Mappings {
    segments: Mutex<HashMap<u32, SegmentSlot>>,
    /// The last [`RECENT_ARENAS`] other clients' arenas mapped, kept alive.
    recent: Mutex<std::collections::VecDeque<Arc<MappedSegment>>>,
    pub(crate) max_inline: u32,
    pub(crate) capacity: u64,
    /// [`crate::ClientOptions::defer_cuda_mapping`].
    pub(crate) defer_cuda: bool,
    /// The store's shared directory and this connection's hold table, when both sides use
    /// them ([`crate::ClientOptions::shared_reads`]).
    pub(crate) shared: Option<Arc<SharedReader>>,
}

impl Mappings {
    /// A connection's mappings from its HELLO reply: the store's own segments, read-only.
    pub(crate) fn from_hello(
        capacity: u64,
        max_inline: u32,
        segments: Vec<(u32, u64)>,
        fds: Vec<OwnedFd>,
    ) -> Result<Self, Error> {
        if segments.len() != fds.len() {
            return Err(Error::Protocol(format!(
                "HELLO announced {} segments but {} fds came",
                segments.len(),
                fds.len()
            )));
        }
        let mut map = HashMap::with_capacity(segments.len());
        for ((id, size), fd) in segments.into_iter().zip(fds) {
            // The store's own segment: read-only, unless the store has no client arenas
            // (`--prefault`) and creates every object there: then its fd is read-write.
            let writable = rustix::fs::fcntl_getfl(&fd)
                .is_ok_and(|f| f & rustix::fs::OFlags::ACCMODE == rustix::fs::OFlags::RDWR);
            map.insert(
                id,
                SegmentSlot::Kept(Arc::new(MappedSegment::map(fd, size, writable, false)?)),
            );
        }
        Ok(Mappings {
            segments: Mutex::new(map),
            recent: Mutex::new(std::collections::VecDeque::new()),
            max_inline,
            capacity,
            defer_cuda: false,
            shared: None,
        })
    }

    /// A view of `name` got through the shared directory, with no message: `None` when the
    /// socket must answer (not published, busy, hold table full, segment not mapped here).
    pub(crate) fn shared_view(&self, name: &str, connection: &Holder) -> Option<ObjectView> {
        let shared = self.shared.as_ref()?;
        let segment = |id: u32| {
            let seg = self.segment(id)?;
            Some(Mapped::host(seg.map.as_mut_ptr(), seg.len(), seg))
        };
        // SAFETY: `segment` gives this client's live mappings of the store's segments, whole.
        unsafe { held_view(shared, name, segment, connection) }
    }

    /// Where the object `r` locates is in this process.
    fn locate(&self, r: &ObjectRef) -> Result<Mapped, Error> {
        match r.location {
            Location::Host { segment, offset } => {
                let seg = self
                    .segment(segment)
                    .ok_or_else(|| Error::Protocol(format!("unknown segment {segment}")))?;
                let end = offset
                    .checked_add(r.size)
                    .filter(|&e| e <= seg.map.len() as u64);
                if end.is_none() {
                    return Err(Error::Protocol("object outside its segment".into()));
                }
                // SAFETY: in bounds (checked above).
                let ptr = unsafe { seg.map.as_mut_ptr().add(offset as usize) };
                Ok(Mapped::host(ptr, r.size, seg.clone()))
            }
            // Opened through CUDA IPC once per pool (cached by vovp-gpu), closed with the last view.
            Location::Cuda(block) => {
                let view = vovp_gpu::ipc::open(&block)?;
                Ok(Mapped::device(view.ptr(), Arc::new(view)))
            }
        }
    }

    /// The mapping of segment `id`, if this client has it mapped.
    pub(crate) fn segment(&self, id: u32) -> Option<Arc<MappedSegment>> {
        let map = self.segments.lock().ok()?;
        match map.get(&id)? {
            SegmentSlot::Kept(s) => Some(s.clone()),
            SegmentSlot::WhileViewed(w) => w.upgrade(),
        }
    }

    pub(crate) fn insert_segment(&self, id: u32, seg: Arc<MappedSegment>) {
        let slot = if id == 0 || seg.writable {
            SegmentSlot::Kept(seg)
        } else {
            if let Ok(mut recent) = self.recent.lock() {
                recent.push_front(seg.clone());
                recent.truncate(RECENT_ARENAS);
            }
            SegmentSlot::WhileViewed(Arc::downgrade(&seg))
        };
        if let Ok(mut map) = self.segments.lock() {
            // Forget mappings whose views are all gone.
            map.retain(|_, s| match s {
                SegmentSlot::Kept(_) => true,
                SegmentSlot::WhileViewed(w) => w.strong_count() > 0,
            });
            map.insert(id, slot);
        }
    }

    /// The host segments of `refs`: those mapped here, held (`pins`) so that they stay mapped
    /// until the caller's views hold them, and the ids of those that are not (to map). Holding
    /// the mapped ones matters: mapping the missing ones pushes older foreign arenas out of the
    /// last-32 list, and one of `refs` may be in such an arena with no view holding it.
    pub(crate) fn segments_of<'r>(
        &self,
        refs: impl IntoIterator<Item = &'r ObjectRef>,
    ) -> (Vec<Arc<MappedSegment>>, Vec<u32>) {
        let mut ids: Vec<u32> = refs
            .into_iter()
            .filter_map(|r| match r.location {
                Location::Host { segment, .. } => Some(segment),
                _ => None,
            })
            .collect();
        ids.sort_unstable();
        ids.dedup();
        let mut pins = Vec::with_capacity(ids.len());
        ids.retain(|&id| match self.segment(id) {
            Some(seg) => {
                pins.push(seg);
                false
            }
            None => true,
        });
        (pins, ids)
    }

    pub(crate) fn view(
        &self,
        r: ObjectRef,
        sink: Arc<dyn ObjectSink>,
    ) -> Result<ObjectView, Error> {
        if self.defer_cuda && matches!(r.location, Location::Cuda(_)) {
            // The caller maps it itself (its location says where): a null, empty view.
            // SAFETY: a null pointer is never read through (`bytes()` is empty for it).
            return Ok(unsafe { ObjectView::from_raw(r, std::ptr::null(), Arc::new(()), sink) });
        }
        let mapped = self.locate(&r)?;
        // SAFETY: a sealed object inside our mapping; `owner` keeps the mapping.
        Ok(unsafe { ObjectView::from_mapped(r, mapped, sink) })
    }

    /// Views for a GET's results. On a failure every reference is still released (the views
    /// already made drop; the failed one is released explicitly).
    pub(crate) fn views(
        &self,
        objects: Vec<Option<ObjectRef>>,
        sink: Arc<dyn ObjectSink>,
    ) -> Result<Vec<Option<ObjectView>>, Error> {
        let mut views = Vec::with_capacity(objects.len());
        let mut failure = None;
        for o in objects {
            views.push(match o {
                None => None,
                Some(r) => {
                    let id = r.id;
                    match self.view(r, sink.clone()) {
                        Ok(v) => Some(v),
                        Err(e) => {
                            sink.release(id);
                            failure = Some(e);
                            None
                        }
                    }
                }
            });
        }
        failure.map_or(Ok(views), Err)
    }

    pub(crate) fn buffer(
        &self,
        r: ObjectRef,
        sink: Arc<dyn ObjectSink>,
    ) -> Result<ObjectBuffer, Error> {
        if let Location::Host { segment, .. } = r.location {
            if !self.segment(segment).is_some_and(|s| s.writable) {
                return Err(Error::Protocol(format!(
                    "{} was placed in segment {segment}, which this client may not write",
                    r.name
                )));
            }
        }
        let mapped = self.locate(&r)?;
        // SAFETY: a fresh unsealed object of ours inside the mapping.
        Ok(unsafe { ObjectBuffer::from_mapped(r, mapped, sink) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{foreign_segment, mappings, memfd, object, own_segment, Counted};

    fn sink() -> (Arc<Counted>, Arc<dyn ObjectSink>) {
        let counted = Arc::new(Counted::default());
        (counted.clone(), counted)
    }

    #[test]
    fn a_segment_smaller_than_its_announced_size_is_refused_not_mapped() {
        let short = MappedSegment::map(memfd(4096), 8192, false, false);
        assert!(matches!(short, Err(Error::Protocol(_))));
        // Segment 0 handed out read-write (`--prefault`) is still nobody's own.
        let zero = MappedSegment::map(memfd(4096), 4096, true, false).unwrap();
        assert!(!zero.is_own() && zero.own_base().is_err());
    }

    #[test]
    fn views_point_inside_their_segment_or_are_refused() {
        let maps = mappings(1 << 30, None);
        let seg = foreign_segment(4096);
        maps.insert_segment(1, seg.clone());
        let (_, s) = sink();
        let v = maps.view(object("a", 1, 64, 64), s.clone()).unwrap();
        assert_eq!(v.as_ptr(), seg.map.as_ptr().wrapping_add(64));
        let outside = maps.view(object("b", 1, 4090, 64), s.clone());
        assert!(matches!(outside, Err(Error::Protocol(_))));
        let unknown = maps.view(object("c", 7, 0, 8), s);
        assert!(matches!(unknown, Err(Error::Protocol(_))));
    }

    #[test]
    fn a_failed_view_among_many_gives_every_reference_back() {
        let maps = mappings(1 << 30, None);
        maps.insert_segment(1, foreign_segment(4096));
        let (counted, s) = sink();
        let good = object("good", 1, 0, 8);
        let bad = object("bad", 1, 4095, 64);
        let got = maps.views(vec![Some(good.clone()), None, Some(bad.clone())], s);
        assert!(matches!(got, Err(Error::Protocol(_))));
        let mut released = counted.released();
        released.sort_unstable();
        assert_eq!(released, [good.id.get(), bad.id.get()]);
    }

    #[test]
    fn buffers_only_in_segments_this_client_writes() {
        let maps = mappings(1 << 30, None);
        maps.insert_segment(1, foreign_segment(4096));
        maps.insert_segment(2, own_segment(4096));
        let (_, s) = sink();
        let theirs = maps.buffer(object("t", 1, 0, 8), s.clone());
        assert!(matches!(theirs, Err(Error::Protocol(_))));
        let mut mine = maps.buffer(object("m", 2, 64, 8), s).unwrap();
        mine.as_mut_slice().copy_from_slice(b"12345678");
        let view = maps.view(object("m", 2, 64, 8), sink().1).unwrap();
        assert_eq!(&view[..], b"12345678");
    }

    #[test]
    fn the_segments_of_a_reply_are_pinned_if_mapped_and_listed_once_if_not() {
        let maps = mappings(1 << 30, None);
        let seg = foreign_segment(4096);
        maps.insert_segment(1, seg.clone());
        let refs = [
            object("a", 1, 0, 8),
            object("b", 3, 0, 8),
            object("c", 1, 64, 8),
            object("d", 2, 0, 8),
            object("e", 3, 64, 8),
        ];
        let (pins, missing) = maps.segments_of(refs.iter());
        assert_eq!(missing, [2, 3]);
        assert_eq!(pins.len(), 1);
        assert!(Arc::ptr_eq(&pins[0], &seg));
    }

    #[test]
    fn other_clients_arenas_stay_mapped_while_viewed_or_among_the_last_mapped() {
        let maps = mappings(1 << 30, None);
        maps.insert_segment(100, own_segment(4096));
        let viewed = foreign_segment(4096);
        maps.insert_segment(1, viewed.clone());
        for id in 2..=(RECENT_ARENAS as u32 + 2) {
            maps.insert_segment(id, foreign_segment(4096));
        }
        // Segment 2 fell out of the recent list and nothing views it: unmapped.
        assert!(maps.segment(2).is_none());
        assert!(maps.segment(3).is_some());
        // Segment 1 is out of the list too, but viewed; this client's own arena is kept.
        assert!(maps.segment(1).is_some());
        assert!(maps.segment(100).is_some());
        drop(viewed);
        maps.insert_segment(200, foreign_segment(4096));
        assert!(maps.segment(1).is_none());
    }

    #[test]
    fn writable_views_are_in_place_only_for_large_objects_of_this_clients_arena() {
        let own = own_segment(64 << 10);
        let big = own.private_view(8192, SMALL_MAX_BLOCK + 1).unwrap();
        assert_eq!(big.ptr, own.map.as_mut_ptr().wrapping_add(8192));
        assert!(own.private_ready(SMALL_MAX_BLOCK + 1));
        let small = own.private_view(0, 64).unwrap();
        assert_ne!(small.ptr, own.map.as_mut_ptr());
        let theirs = foreign_segment(64 << 10);
        assert!(!theirs.private_ready(SMALL_MAX_BLOCK + 1));
        let copy = theirs.private_view(8192, SMALL_MAX_BLOCK + 1).unwrap();
        assert_ne!(copy.ptr, theirs.map.as_mut_ptr().wrapping_add(8192));
        assert!(theirs.private_ready(SMALL_MAX_BLOCK + 1));
        assert!(matches!(
            theirs.private_view(60 << 10, 8 << 10),
            Err(Error::Protocol(_))
        ));
    }

    #[test]
    fn a_cuda_object_a_caller_maps_itself_comes_back_empty() {
        let mut maps = mappings(1 << 30, None);
        maps.defer_cuda = true;
        let block = vovp_types::DeviceBlock {
            device: 0,
            pool: 0,
            ipc_handle: [0; 64],
            offset: 0,
            size: 256,
        };
        let cuda = ObjectRef {
            location: Location::Cuda(block),
            ..object("g", 0, 0, 256)
        };
        let v = maps.view(cuda, sink().1).unwrap();
        assert!(v.as_ptr().is_null() && v.bytes().is_empty() && v.cuda_ptr().is_none());
    }
}
