//! The memfd-backed regions: the store creates them, clients map the fds they are handed.
//! The directory's clients get a read-only reopening of its memfd (so no client can write it);
//! a hold table's client gets its read-write memfd. Both memfds are sealed against shrinking
//! and growing so no fd holder can make the store fault on its own mapping.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering::Relaxed;

use memmap2::{MmapOptions, MmapRaw};

use crate::directory::{Directory, DirectoryWriter};
use crate::error::{Result, ShmError};
use crate::hold::{Holds, HoldsView};
use crate::layout::{
    DirHeader, Entry, HoldHeader, HoldSlot, DIR_MAGIC, ENTRY_SIZE, HEADER_SIZE, HOLD_MAGIC,
    LAYOUT_VERSION, MAX_CAPACITY, NAME_MAX, SLOT_SIZE,
};
use crate::lend::{LendRevoker, LendWriters};
use crate::{low32, to_usize};

fn io(op: &'static str) -> impl FnOnce(std::io::Error) -> ShmError {
    move |source| ShmError::Io { op, source }
}

fn check_capacity(n: usize) -> Result<()> {
    if n == 0 || !n.is_power_of_two() || n > MAX_CAPACITY {
        return Err(ShmError::BadCapacity {
            requested: n,
            max: MAX_CAPACITY,
        });
    }
    Ok(())
}

/// A sealed, owner-only memfd of `len` bytes, mapped read-write. With `store_only_writes`
/// it is also sealed `F_SEAL_FUTURE_WRITE` after the store's own writable mapping exists:
/// a read-only fd alone does not stop a same-user client from reopening
/// `/proc/self/fd/N` read-write, but that seal makes every later writable mapping and
/// `write(2)` fail, whoever asks.
fn create(name: &str, len: u64, store_only_writes: bool) -> Result<(File, MmapRaw)> {
    let seal_err = |e: memfd::Error| ShmError::Io {
        op: "sealing the memfd",
        source: std::io::Error::other(e),
    };
    let memfd = memfd::MemfdOptions::default()
        .close_on_exec(true)
        .allow_sealing(true)
        .create(name)
        .map_err(|e| ShmError::Io {
            op: "memfd_create",
            source: std::io::Error::other(e),
        })?;
    memfd.as_file().set_len(len).map_err(io("ftruncate"))?;
    // Mapped before the write seal: the seal forbids new writable mappings, not this one.
    let map = MmapOptions::new()
        .len(to_usize(len))
        .map_raw(memfd.as_file())
        .map_err(io("mmap"))?;
    let mut seals = vec![memfd::FileSeal::SealShrink, memfd::FileSeal::SealGrow];
    if store_only_writes {
        seals.push(memfd::FileSeal::SealFutureWrite);
    }
    seals.push(memfd::FileSeal::SealSeal);
    memfd.add_seals(&seals).map_err(seal_err)?;
    let file = memfd.into_file();
    rustix::fs::fchmod(&file, rustix::fs::Mode::from_raw_mode(0o600))
        .map_err(|e| io("fchmod")(e.into()))?;
    Ok((file, map))
}

fn file_len(file: &File) -> Result<u64> {
    Ok(file.metadata().map_err(io("fstat"))?.len())
}

/// Checks a mapped header's magic, version, element size and count against `len`; returns
/// the count.
fn check_header(
    what: &'static str,
    len: u64,
    words: [u64; 4],
    magic: u64,
    elem: usize,
) -> Result<usize> {
    let [found_magic, version_size, count, offset] = words;
    if found_magic != magic {
        return Err(ShmError::BadMagic {
            what,
            expected: magic,
            found: found_magic,
        });
    }
    let version = low32(version_size);
    if version != LAYOUT_VERSION {
        return Err(ShmError::VersionMismatch {
            expected: LAYOUT_VERSION,
            found: version,
        });
    }
    if version_size >> 32 != elem as u64 {
        return Err(ShmError::LayoutMismatch {
            what: "element size",
            expected: elem as u64,
            found: version_size >> 32,
        });
    }
    if offset != HEADER_SIZE as u64 {
        return Err(ShmError::LayoutMismatch {
            what: "first element offset",
            expected: HEADER_SIZE as u64,
            found: offset,
        });
    }
    let n = usize::try_from(count).unwrap_or(usize::MAX);
    check_capacity(n)?;
    let needed = HEADER_SIZE as u64 + count * elem as u64;
    if len < needed {
        return Err(ShmError::RegionTooSmall { len, needed });
    }
    Ok(n)
}

/// # Safety
/// `map` is at least `HEADER_SIZE + n * size_of::<E>()` bytes and outlives the returned references.
/// Every type here is `#[repr(C)]` over `AtomicU64`s, valid for any bit pattern, and atomics
/// in memory shared with other processes are what they are for. On a read-only mapping only
/// loads are made, which std permits for lock-free atomics ("atomic accesses to read-only memory").
unsafe fn parts<H, E>(map: &MmapRaw, n: usize) -> (&H, &[E]) {
    let base = map.as_ptr();
    (
        &*(base as *const H),
        std::slice::from_raw_parts(base.add(HEADER_SIZE) as *const E, n),
    )
}

/// The store's directory: owns the memfd and the only writer.
#[derive(Debug)]
pub struct DirectoryRegion {
    file: File,
    read_only: File,
    map: MmapRaw,
    capacity: usize,
}

impl DirectoryRegion {
    /// A directory of `capacity` entries (a power of two; size it about twice the store's
    /// object limit so probe chains stay short).
    pub fn create(capacity: usize) -> Result<Self> {
        check_capacity(capacity)?;
        let len = (HEADER_SIZE + capacity * ENTRY_SIZE) as u64;
        let (file, map) = create("vovp-directory", len, true)?;
        let read_only = File::from(
            rustix::fs::open(
                format!("/proc/self/fd/{}", file.as_raw_fd()),
                rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
                rustix::fs::Mode::empty(),
            )
            .map_err(|e| io("reopening the directory read-only")(e.into()))?,
        );
        let region = DirectoryRegion {
            file,
            read_only,
            map,
            capacity,
        };
        // SAFETY: the map is exactly this long and lives in `region`.
        let (h, _) = unsafe { parts::<DirHeader, Entry>(&region.map, capacity) };
        // Written before any fd leaves the store, so no reader sees a partial header.
        h.version_entry_size.store(
            u64::from(LAYOUT_VERSION) | (ENTRY_SIZE as u64) << 32,
            Relaxed,
        );
        h.capacity.store(capacity as u64, Relaxed);
        h.name_max.store(NAME_MAX as u64, Relaxed);
        h.entries_offset.store(HEADER_SIZE as u64, Relaxed);
        h.next_generation.store(1, Relaxed);
        h.magic.store(DIR_MAGIC, Relaxed);
        Ok(region)
    }

    /// The fd clients get (read-only: a client cannot write the directory).
    pub fn read_only_fd(&self) -> &File {
        &self.read_only
    }

    /// The read-write fd; never hand it to a client.
    pub fn fd(&self) -> &File {
        &self.file
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The writer. `&mut self`: one writer at a time, as the seqlock requires.
    pub fn writer(&mut self) -> DirectoryWriter<'_> {
        // SAFETY: see `parts`; the map was created `HEADER_SIZE + capacity * ENTRY_SIZE` long.
        let (h, e) = unsafe { parts::<DirHeader, Entry>(&self.map, self.capacity) };
        DirectoryWriter::new(h, e)
    }

    pub fn reader(&self) -> Directory<'_> {
        // SAFETY: as in `writer`.
        let (_, e) = unsafe { parts::<DirHeader, Entry>(&self.map, self.capacity) };
        Directory::new(e)
    }
}

enum Access {
    ReadOnly,
    ReadWrite,
}

/// Maps all of a region fd handed over by the other side, after checking that it holds at
/// least a header; returns the map and its length.
fn map_whole(file: &File, access: Access) -> Result<(MmapRaw, u64)> {
    let len = file_len(file)?;
    if len < HEADER_SIZE as u64 {
        return Err(ShmError::RegionTooSmall {
            len,
            needed: HEADER_SIZE as u64,
        });
    }
    let mut options = MmapOptions::new();
    options.len(to_usize(len));
    let map = match access {
        Access::ReadOnly => options.map_raw_read_only(file),
        Access::ReadWrite => options.map_raw(file),
    };
    Ok((map.map_err(io("mmap"))?, len))
}

/// A client's read-only mapping of the directory.
#[derive(Debug)]
pub struct DirectoryMap {
    map: MmapRaw,
    capacity: usize,
}

impl DirectoryMap {
    /// Maps the fd the store handed over, checking its header against this build's layout.
    pub fn open(file: &File) -> Result<Self> {
        let (map, len) = map_whole(file, Access::ReadOnly)?;
        // SAFETY: at least HEADER_SIZE bytes are mapped; no entries taken yet.
        let (h, _) = unsafe { parts::<DirHeader, Entry>(&map, 0) };
        let words = [
            h.magic.load(Relaxed),
            h.version_entry_size.load(Relaxed),
            h.capacity.load(Relaxed),
            h.entries_offset.load(Relaxed),
        ];
        let capacity = check_header("directory", len, words, DIR_MAGIC, ENTRY_SIZE)?;
        if h.name_max.load(Relaxed) != NAME_MAX as u64 {
            return Err(ShmError::LayoutMismatch {
                what: "name_max",
                expected: NAME_MAX as u64,
                found: h.name_max.load(Relaxed),
            });
        }
        Ok(DirectoryMap { map, capacity })
    }

    pub fn reader(&self) -> Directory<'_> {
        // SAFETY: `check_header` checked the length covers `capacity` entries.
        let (_, e) = unsafe { parts::<DirHeader, Entry>(&self.map, self.capacity) };
        Directory::new(e)
    }
}

/// The store's side of one client's hold table.
#[derive(Debug)]
pub struct HoldRegion {
    file: File,
    map: MmapRaw,
    slots: usize,
}

impl HoldRegion {
    pub fn create(slots: usize, client_id: u64) -> Result<Self> {
        check_capacity(slots)?;
        let len = (HEADER_SIZE + slots * SLOT_SIZE) as u64;
        let (file, map) = create("vovp-holds", len, false)?;
        let region = HoldRegion { file, map, slots };
        // SAFETY: the map is exactly this long.
        let (h, _) = unsafe { parts::<HoldHeader, HoldSlot>(&region.map, slots) };
        h.version_slot_size.store(
            u64::from(LAYOUT_VERSION) | (SLOT_SIZE as u64) << 32,
            Relaxed,
        );
        h.slots.store(slots as u64, Relaxed);
        h.slots_offset.store(HEADER_SIZE as u64, Relaxed);
        h.client_id.store(client_id, Relaxed);
        h.magic.store(HOLD_MAGIC, Relaxed);
        Ok(region)
    }

    /// The read-write fd the client gets. Dropping the region (the client died) drops the
    /// whole table: pass it to `is_held`/`collect` no more.
    pub fn fd(&self) -> &File {
        &self.file
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    /// The store's side of the lend handshake ([`crate::lend`]).
    pub fn lend_revoker(&self) -> LendRevoker<'_> {
        // SAFETY: the map was created `HEADER_SIZE + slots * SLOT_SIZE` long.
        let (h, _) = unsafe { parts::<HoldHeader, HoldSlot>(&self.map, self.slots) };
        LendRevoker::new(h)
    }

    /// How many pipelined puts the client says it sent ([`crate::sent`]).
    pub fn puts_sent(&self) -> u64 {
        // SAFETY: the map was created `HEADER_SIZE + slots * SLOT_SIZE` long.
        let (h, _) = unsafe { parts::<HoldHeader, HoldSlot>(&self.map, self.slots) };
        crate::sent::SentPuts::new(h).sent()
    }

    /// The client's own count of the gets it served from the directory: (gets, data bytes),
    /// ever (the header's `shared_gets` and `shared_get_bytes`; 0 from a client that predates
    /// them). The client's word, for metrics only: a store that reports a counter over it
    /// adds what a table's count rose by since it last looked (and folds a table's last rise
    /// in when its client goes), so a table's count going down cannot make the sum go down.
    pub fn shared_gets(&self) -> (u64, u64) {
        // SAFETY: the map was created `HEADER_SIZE + slots * SLOT_SIZE` long.
        let (h, _) = unsafe { parts::<HoldHeader, HoldSlot>(&self.map, self.slots) };
        (
            h.shared_gets.load(Relaxed),
            h.shared_get_bytes.load(Relaxed),
        )
    }

    /// The store's view; uses the store's own slot count, never the (client-writable) header's,
    /// and of the header only the `holding` count (which can only expose the client's own holds).
    pub fn view(&self) -> HoldsView<'_> {
        // SAFETY: the map was created `HEADER_SIZE + slots * SLOT_SIZE` long.
        let (h, s) = unsafe { parts::<HoldHeader, HoldSlot>(&self.map, self.slots) };
        HoldsView::new(s).counted(&h.holding)
    }
}

/// A client's read-write mapping of its hold table, with the free-slot list only the client
/// keeps.
#[derive(Debug)]
pub struct HoldMap {
    map: MmapRaw,
    slots: usize,
    free: std::collections::VecDeque<usize>,
}

impl HoldMap {
    pub fn open(file: &File) -> Result<Self> {
        let (map, len) = map_whole(file, Access::ReadWrite)?;
        // SAFETY: at least HEADER_SIZE bytes are mapped.
        let (h, _) = unsafe { parts::<HoldHeader, HoldSlot>(&map, 0) };
        let words = [
            h.magic.load(Relaxed),
            h.version_slot_size.load(Relaxed),
            h.slots.load(Relaxed),
            h.slots_offset.load(Relaxed),
        ];
        let slots = check_header("hold table", len, words, HOLD_MAGIC, SLOT_SIZE)?;
        // SAFETY: `check_header` checked the length covers `slots` slots.
        let (h, s) = unsafe { parts::<HoldHeader, HoldSlot>(&map, slots) };
        let free = Holds::new(s, &h.holding).into_free();
        Ok(HoldMap { map, slots, free })
    }

    /// Runs `f` on the client's hold operations. `&mut self`: one at a time, as the free list
    /// requires; the list stays here between calls, so no call rescans the table.
    pub fn with_holds<R>(&mut self, f: impl FnOnce(&mut Holds<'_>) -> R) -> R {
        // SAFETY: `check_header` checked the length covers `slots` slots.
        let (h, s) = unsafe { parts::<HoldHeader, HoldSlot>(&self.map, self.slots) };
        let mut holds = Holds::with_free(s, std::mem::take(&mut self.free), &h.holding);
        let r = f(&mut holds);
        self.free = holds.into_free();
        r
    }

    /// The client's side of the lend handshake ([`crate::lend`]).
    pub fn lend_writers(&self) -> LendWriters<'_> {
        // SAFETY: at least HEADER_SIZE bytes are mapped (checked at open).
        let (h, _) = unsafe { parts::<HoldHeader, HoldSlot>(&self.map, 0) };
        LendWriters::new(h)
    }

    /// The client's side of the pipelined-put count ([`crate::sent`]).
    pub fn sent_puts(&self) -> crate::sent::SentPuts<'_> {
        // SAFETY: at least HEADER_SIZE bytes are mapped (checked at open).
        let (h, _) = unsafe { parts::<HoldHeader, HoldSlot>(&self.map, 0) };
        crate::sent::SentPuts::new(h)
    }

    /// Counts one get served from the directory, of `bytes` data bytes, in the header's
    /// `shared_gets` and `shared_get_bytes` (for the store's metrics). Plain stores, no
    /// read-modify-write: this client is their only writer, and `&mut self` (its reader's
    /// lock) orders its own updates.
    pub fn count_shared_get(&mut self, bytes: u64) {
        // SAFETY: at least HEADER_SIZE bytes are mapped (checked at open).
        let (h, _) = unsafe { parts::<HoldHeader, HoldSlot>(&self.map, 0) };
        let gets = h.shared_gets.load(Relaxed);
        h.shared_gets.store(gets.wrapping_add(1), Relaxed);
        let total = h.shared_get_bytes.load(Relaxed);
        h.shared_get_bytes.store(total.wrapping_add(bytes), Relaxed);
    }

    /// The client's hold operations, rebuilt from the table (rescans every slot).
    pub fn holds(&mut self) -> Holds<'_> {
        // SAFETY: `check_header` checked the length covers `slots` slots.
        let (h, s) = unsafe { parts::<HoldHeader, HoldSlot>(&self.map, self.slots) };
        Holds::new(s, &h.holding)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::directory::{Lookup, Publish};
    use crate::hold::{is_held, Get};
    use std::io::Write;

    fn publish(region: &mut DirectoryRegion, name: &[u8], v: u64) -> (usize, u64) {
        region
            .writer()
            .publish(&Publish {
                name,
                object_id: v,
                segment: 1,
                offset: v * 8,
                size: 8,
                meta_offset: 0,
                meta_len: 0,
                flags: 0,
                version: 1,
            })
            .unwrap()
    }

    /// A plain memfd holding `bytes`, for hand-made (bad) headers.
    fn raw_memfd(bytes: &[u8], len: u64) -> File {
        let mut f = memfd::MemfdOptions::default()
            .create("vovp-test")
            .unwrap()
            .into_file();
        f.set_len(len).unwrap();
        f.write_all(bytes).unwrap();
        f
    }

    fn header_bytes(words: &[u64]) -> Vec<u8> {
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    #[test]
    fn directory_round_trip_through_the_read_only_fd() {
        let mut region = DirectoryRegion::create(16).unwrap();
        assert_eq!(region.capacity(), 16);
        let (_, g) = publish(&mut region, b"alpha", 3);
        let map = DirectoryMap::open(region.read_only_fd()).unwrap();
        let Lookup::Found(s) = map.reader().lookup(b"alpha") else {
            panic!("not found through the client mapping")
        };
        assert_eq!((s.generation, s.object_id, s.offset), (g, 3, 24));
        assert_eq!(region.reader().lookup(b"alpha"), Lookup::Found(s));
        // Later writes show through the client's mapping: same pages.
        publish(&mut region, b"beta", 4);
        assert!(matches!(map.reader().lookup(b"beta"), Lookup::Found(_)));
    }

    #[test]
    fn directory_fd_cannot_be_mapped_or_reopened_writable() {
        let region = DirectoryRegion::create(4).unwrap();
        let ro = region.read_only_fd();
        let mode = rustix::fs::fcntl_getfl(ro).unwrap() & rustix::fs::OFlags::RWMODE;
        assert_eq!(mode, rustix::fs::OFlags::RDONLY);
        assert!(
            MmapOptions::new().len(64).map_raw(ro).is_err(),
            "writable map of a read-only fd"
        );
        // Reopening through /proc may succeed, but the future-write seal refuses any new
        // writable mapping and any write(2).
        if let Ok(fd) = rustix::fs::open(
            format!("/proc/self/fd/{}", ro.as_raw_fd()),
            rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        ) {
            let mut rw = File::from(fd);
            assert!(
                MmapOptions::new().len(64).map_raw(&rw).is_err(),
                "writable map after reopen"
            );
            assert!(rw.write_all(b"x").is_err(), "write(2) after reopen");
        }
        // Not even the store's own read-write fd can make a new writable mapping.
        assert!(MmapOptions::new().len(64).map_raw(region.fd()).is_err());
    }

    #[test]
    fn hold_table_round_trip() {
        let mut dir = DirectoryRegion::create(8).unwrap();
        let (_, g) = publish(&mut dir, b"a", 1);
        let region = HoldRegion::create(4, 42).unwrap();
        assert_eq!(region.slots(), 4);
        let mut map = HoldMap::open(region.fd()).unwrap();
        let client_dir = DirectoryMap::open(dir.read_only_fd()).unwrap();
        let mut holds = map.holds();
        let Get::Held(h) = holds.get(&client_dir.reader(), b"a", 1).unwrap() else {
            panic!("no hold")
        };
        assert!(
            is_held([region.view()], g),
            "the store sees the client's hold"
        );
        holds.release(h).unwrap();
        assert!(!is_held([region.view()], g));
    }

    #[test]
    fn gets_served_from_the_directory_are_counted_in_the_clients_table() {
        let mut dir = DirectoryRegion::create(8).unwrap();
        publish(&mut dir, b"a", 1);
        let region = HoldRegion::create(4, 42).unwrap();
        assert_eq!(region.shared_gets(), (0, 0), "a new table counts nothing");
        let reader = crate::SharedReader::open(dir.read_only_fd(), region.fd()).unwrap();
        let first = reader.hold("a").expect("a is published");
        let second = reader.hold("a").expect("a second hold");
        assert!(reader.hold("missing").is_none());
        // Two gets of the 8-byte object; a miss (the store answers it) is not one.
        assert_eq!(region.shared_gets(), (2, 16));
        for h in [first, second] {
            reader.release(h.slot, h.snapshot).unwrap();
        }
        assert_eq!(region.shared_gets(), (2, 16), "a release leaves the count");
    }

    #[test]
    fn a_lend_is_taken_back_only_while_no_put_writes_into_it() {
        let region = HoldRegion::create(4, 7).unwrap();
        let client = HoldMap::open(region.fd()).unwrap();
        let (writers, store) = (client.lend_writers(), region.lend_revoker());
        assert!(!store.client_takes_part(), "an undeclared client");
        writers.declare();
        assert!(store.client_takes_part());
        // A put writing into lend 3 keeps it from being taken back, and the failed attempt
        // leaves no mark behind: the next put still writes.
        assert!(writers.begin(3));
        assert!(!store.revoke(3), "revoked while a put writes into it");
        writers.end();
        assert!(writers.begin(3), "a failed take-back left its mark");
        writers.end();
        // Taken back while no put writes: the next put sees the mark and writes nothing.
        assert!(
            store.revoke(3),
            "no put writes: the store may retire the lend"
        );
        assert!(!writers.begin(3), "wrote into a lend the store took back");
        // The mark names one lend only; clearing it (a new LEND) lets puts write again.
        assert!(writers.begin(4));
        writers.end();
        store.clear();
        assert!(writers.begin(3));
        writers.end();
        assert!(store.revoke(4));
    }

    #[test]
    fn bad_capacities_are_refused() {
        for n in [0, 3, MAX_CAPACITY * 2] {
            assert!(matches!(
                DirectoryRegion::create(n),
                Err(ShmError::BadCapacity { requested, .. }) if requested == n
            ));
            assert!(matches!(
                HoldRegion::create(n, 1),
                Err(ShmError::BadCapacity { .. })
            ));
        }
    }

    #[test]
    fn bad_headers_are_refused() {
        // The wrong kind of region.
        let holds = HoldRegion::create(4, 1).unwrap();
        assert!(matches!(
            DirectoryMap::open(holds.fd()),
            Err(ShmError::BadMagic {
                what: "directory",
                ..
            })
        ));
        let dir = DirectoryRegion::create(4).unwrap();
        let f = File::from(
            rustix::fs::open(
                format!("/proc/self/fd/{}", dir.read_only_fd().as_raw_fd()),
                rustix::fs::OFlags::RDONLY,
                rustix::fs::Mode::empty(),
            )
            .unwrap(),
        );
        assert!(HoldMap::open(&f).is_err(), "a directory is no hold table");
        // Shorter than a header.
        assert!(matches!(
            DirectoryMap::open(&raw_memfd(&[], 10)),
            Err(ShmError::RegionTooSmall { len: 10, .. })
        ));
        let good = |cap: u64| {
            [
                DIR_MAGIC,
                u64::from(LAYOUT_VERSION) | (ENTRY_SIZE as u64) << 32,
                cap,
                NAME_MAX as u64,
                HEADER_SIZE as u64,
            ]
        };
        let len = (HEADER_SIZE + 2 * ENTRY_SIZE) as u64;
        assert!(DirectoryMap::open(&raw_memfd(&header_bytes(&good(2)), len)).is_ok());
        // Claims more entries than the region holds.
        assert!(matches!(
            DirectoryMap::open(&raw_memfd(&header_bytes(&good(4)), len)),
            Err(ShmError::RegionTooSmall { .. })
        ));
        // A capacity that is no power of two, or absurd.
        for cap in [0, 3, u64::MAX] {
            assert!(matches!(
                DirectoryMap::open(&raw_memfd(&header_bytes(&good(cap)), len)),
                Err(ShmError::BadCapacity { .. })
            ));
        }
        let mut w = good(2);
        w[1] = u64::from(LAYOUT_VERSION + 1) | (ENTRY_SIZE as u64) << 32;
        assert!(matches!(
            DirectoryMap::open(&raw_memfd(&header_bytes(&w), len)),
            Err(ShmError::VersionMismatch { found, .. }) if found == LAYOUT_VERSION + 1
        ));
        let mut w = good(2);
        w[1] = u64::from(LAYOUT_VERSION) | 128 << 32;
        assert!(matches!(
            DirectoryMap::open(&raw_memfd(&header_bytes(&w), len)),
            Err(ShmError::LayoutMismatch {
                what: "element size",
                ..
            })
        ));
        let mut w = good(2);
        w[4] = 64;
        assert!(matches!(
            DirectoryMap::open(&raw_memfd(&header_bytes(&w), len)),
            Err(ShmError::LayoutMismatch {
                what: "first element offset",
                ..
            })
        ));
        let mut w = good(2);
        w[3] = 100;
        assert!(matches!(
            DirectoryMap::open(&raw_memfd(&header_bytes(&w), len)),
            Err(ShmError::LayoutMismatch {
                what: "name_max",
                ..
            })
        ));
    }
}
