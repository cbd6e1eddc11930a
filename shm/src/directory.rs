//! The directory: an open-addressing (linear probing) table of [`Entry`]s, written only by the
//! store under per-entry seqlocks, read by clients lock-free.
//!
//! Seqlock (Boehm, "Can seqlocks get along with programming language memory models?", 2012):
//! the writer makes `seq` odd, issues a release fence, writes the words (relaxed atomics),
//! then stores `seq` even with release. A reader loads `seq` with acquire, reads the words
//! (relaxed), issues an acquire fence and re-loads `seq`: equal and even means no write
//! overlapped, so the words are one version. A lookup that keeps meeting a write gives up
//! ([`Lookup::Busy`]) rather than spin unboundedly; a miss is never authoritative (a concurrent
//! insert or tombstone clean-up can hide a name), so callers fall back to the socket.

use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

use crate::error::{Result, ShmError};
use crate::layout::{
    name_hash, name_word, DirHeader, Entry, NAME_MAX, STATE_EMPTY, STATE_LIVE, STATE_TOMBSTONE,
};
use crate::sync::{fence, spin};
use crate::{low32, to_usize};

/// How many times a reader re-reads an entry the store is writing before giving up. Under
/// loom two tries already cover "retry once, then give up"; more only multiplies the
/// interleavings to explore.
#[cfg(not(loom))]
const SEQ_TRIES: usize = 64;
#[cfg(loom)]
const SEQ_TRIES: usize = 2;

/// One consistent read of a live entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Snapshot {
    /// Entry index in the table.
    pub index: usize,
    /// The entry's (even) sequence number when read: re-validation compares it.
    pub seq: u64,
    pub object_id: u64,
    pub generation: u64,
    pub segment: u32,
    pub offset: u64,
    pub size: u64,
    pub meta_offset: u64,
    pub meta_len: u64,
    pub flags: u64,
    pub version: u64,
}

impl Snapshot {
    /// Entry `e`'s words as they are now, under sequence number `seq`. Inside a seqlock read
    /// the caller re-checks `seq` afterwards; the store (the only writer) can read at will.
    fn of(e: &Entry, index: usize, seq: u64) -> Snapshot {
        Snapshot {
            index,
            seq,
            object_id: e.object_id.load(Relaxed),
            generation: e.generation.load(Relaxed),
            segment: low32(e.segment_name_len.load(Relaxed)),
            offset: e.offset.load(Relaxed),
            size: e.size.load(Relaxed),
            meta_offset: e.meta_offset.load(Relaxed),
            meta_len: e.meta_len.load(Relaxed),
            flags: e.flags.load(Relaxed),
            version: e.version.load(Relaxed),
        }
    }
}

/// What a lookup found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    Found(Snapshot),
    /// Not in the directory (now, as far as this reader saw): ask the store.
    Missing,
    /// The store kept rewriting an entry on the probe path: ask the store.
    Busy,
}

/// What the store publishes for one sealed object.
#[derive(Debug, Clone, Copy)]
pub struct Publish<'a> {
    pub name: &'a [u8],
    pub object_id: u64,
    pub segment: u32,
    pub offset: u64,
    pub size: u64,
    pub meta_offset: u64,
    pub meta_len: u64,
    pub flags: u64,
    /// The name's version this object is.
    pub version: u64,
}

enum Probe {
    Empty,
    Tombstone,
    Other,
    Match(Snapshot),
}

/// Read side: what every client (and the store itself) looks names up with.
#[derive(Debug, Clone, Copy)]
pub struct Directory<'a> {
    entries: &'a [Entry],
}

impl<'a> Directory<'a> {
    /// `entries.len()` must be a power of two (the region code checks it).
    pub fn new(entries: &'a [Entry]) -> Self {
        debug_assert!(entries.len().is_power_of_two());
        Directory { entries }
    }

    pub fn capacity(&self) -> usize {
        self.entries.len()
    }

    /// Finds `name`: a few seqlocked reads of shared memory, no syscall.
    pub fn lookup(&self, name: &[u8]) -> Lookup {
        // An empty table (only constructible by hand) has no mask: nothing is in it.
        if name.is_empty() || name.len() > NAME_MAX || self.entries.is_empty() {
            return Lookup::Missing;
        }
        let hash = name_hash(name);
        let mask = self.entries.len() - 1;
        let start = to_usize(hash) & mask;
        for step in 0..self.entries.len() {
            let index = (start + step) & mask;
            match read_entry(&self.entries[index], index, hash, name) {
                None => return Lookup::Busy,
                Some(Probe::Empty) => return Lookup::Missing,
                Some(Probe::Tombstone | Probe::Other) => {}
                Some(Probe::Match(s)) => return Lookup::Found(s),
            }
        }
        Lookup::Missing
    }

    /// True while entry `index` has not been rewritten since `snapshot` was read. Acquire: a
    /// reader that sees the old `seq` also sees nothing of a later write (see hold.rs for why
    /// this load, after the hold is published, is what makes the hold safe).
    pub fn still_valid(&self, snapshot: &Snapshot) -> bool {
        self.entries
            .get(snapshot.index)
            .is_some_and(|e| e.seq.load(Acquire) == snapshot.seq)
    }
}

/// One seqlocked read of an entry; `None` when every try met a write.
fn read_entry(e: &Entry, index: usize, hash: u64, name: &[u8]) -> Option<Probe> {
    for _ in 0..SEQ_TRIES {
        let s1 = e.seq.load(Acquire);
        if s1 & 1 == 1 {
            spin();
            continue;
        }
        let probe = match e.state.load(Relaxed) {
            STATE_EMPTY => Probe::Empty,
            STATE_LIVE => {
                if e.hash.load(Relaxed) != hash {
                    Probe::Other
                } else {
                    let len = (e.segment_name_len.load(Relaxed) >> 32) as usize;
                    let same = len == name.len()
                        && (0..name.len().div_ceil(8))
                            .all(|i| e.name[i].load(Relaxed) == name_word(name, i));
                    if same {
                        Probe::Match(Snapshot::of(e, index, s1))
                    } else {
                        Probe::Other
                    }
                }
            }
            // A tombstone, or garbage read mid-write (rejected by the re-check below).
            _ => Probe::Tombstone,
        };
        fence(Acquire);
        if e.seq.load(Relaxed) == s1 {
            return Some(probe);
        }
        spin();
    }
    None
}

/// Write side: the store's, and only one at a time (`&mut self`). All its reads are of words
/// only it writes, so relaxed loads see its own last writes.
#[derive(Debug)]
pub struct DirectoryWriter<'a> {
    header: &'a DirHeader,
    entries: &'a [Entry],
}

impl<'a> DirectoryWriter<'a> {
    pub fn new(header: &'a DirHeader, entries: &'a [Entry]) -> Self {
        debug_assert!(entries.len().is_power_of_two());
        DirectoryWriter { header, entries }
    }

    pub fn reader(&self) -> Directory<'a> {
        Directory::new(self.entries)
    }

    pub fn live(&self) -> usize {
        to_usize(self.header.live.load(Relaxed))
    }

    /// Publishes a sealed object under `p.name`; returns `(entry index, generation)`. The
    /// generation is new (never used before in this directory), so a hold on an older
    /// publication of the same name can never be mistaken for one on this.
    pub fn publish(&mut self, p: &Publish<'_>) -> Result<(usize, u64)> {
        if p.name.is_empty() {
            return Err(ShmError::EmptyName);
        }
        if p.name.len() > NAME_MAX {
            return Err(ShmError::NameTooLong {
                len: p.name.len(),
                max: NAME_MAX,
            });
        }
        if self.entries.is_empty() {
            return Err(ShmError::DirectoryFull { capacity: 0 });
        }
        let hash = name_hash(p.name);
        let mask = self.entries.len() - 1;
        let start = to_usize(hash) & mask;
        let mut free = None;
        for step in 0..self.entries.len() {
            let index = (start + step) & mask;
            let e = &self.entries[index];
            match e.state.load(Relaxed) {
                STATE_EMPTY => {
                    free.get_or_insert(index);
                    break;
                }
                STATE_TOMBSTONE => {
                    free.get_or_insert(index);
                }
                _ => {
                    if e.hash.load(Relaxed) == hash && self.name_is(e, p.name) {
                        return Err(ShmError::AlreadyPublished { index });
                    }
                }
            }
        }
        let index = free.ok_or(ShmError::DirectoryFull {
            capacity: self.entries.len(),
        })?;
        let generation = self.header.next_generation.load(Relaxed).max(1);
        self.header.next_generation.store(generation + 1, Relaxed);
        let e = &self.entries[index];
        write_locked(e, || {
            e.hash.store(hash, Relaxed);
            e.object_id.store(p.object_id, Relaxed);
            e.generation.store(generation, Relaxed);
            e.segment_name_len
                .store(u64::from(p.segment) | (p.name.len() as u64) << 32, Relaxed);
            e.offset.store(p.offset, Relaxed);
            e.size.store(p.size, Relaxed);
            e.meta_offset.store(p.meta_offset, Relaxed);
            e.meta_len.store(p.meta_len, Relaxed);
            e.flags.store(p.flags, Relaxed);
            e.version.store(p.version, Relaxed);
            // Only the words the name spans: readers compare no further than `name_len`.
            for i in 0..p.name.len().div_ceil(8) {
                e.name[i].store(name_word(p.name, i), Relaxed);
            }
            e.state.store(STATE_LIVE, Relaxed);
        });
        e.stamp.store(0, Relaxed);
        self.header.live.fetch_add(1, Relaxed);
        Ok((index, generation))
    }

    fn name_is(&self, e: &Entry, name: &[u8]) -> bool {
        (e.segment_name_len.load(Relaxed) >> 32) as usize == name.len()
            && (0..name.len().div_ceil(8)).all(|i| e.name[i].load(Relaxed) == name_word(name, i))
    }

    /// Takes a published object out of the directory (delete, evict, replace). After this
    /// returns, a reader that had not yet validated a hold on it will fail to; the memory may
    /// be reused only once no hold table names `generation` ([`crate::hold::is_held`], or
    /// [`crate::hold::held_generations`] for objects parked meanwhile).
    pub fn unpublish(&mut self, index: usize, generation: u64) -> Result<()> {
        let e = self
            .entries
            .get(index)
            .filter(|e| {
                e.state.load(Relaxed) == STATE_LIVE && e.generation.load(Relaxed) == generation
            })
            .ok_or(ShmError::NotLive { index, generation })?;
        write_locked(e, || {
            e.state.store(STATE_TOMBSTONE, Relaxed);
            e.generation.store(0, Relaxed);
        });
        self.header.live.fetch_sub(1, Relaxed);
        // A tombstone followed by an empty entry ends no probe chain that the empty one does
        // not already end: turn it (and tombstones before it) back into empty entries, so
        // probe chains do not grow without bound under churn.
        let mask = self.entries.len() - 1;
        if self.entries[(index + 1) & mask].state.load(Relaxed) == STATE_EMPTY {
            let mut i = index;
            for _ in 0..self.entries.len() {
                let t = &self.entries[i];
                if t.state.load(Relaxed) != STATE_TOMBSTONE {
                    break;
                }
                write_locked(t, || t.state.store(STATE_EMPTY, Relaxed));
                i = (i + mask) & mask;
            }
        }
        Ok(())
    }

    /// Records the store's LRU stamp for a live entry (advisory; readers do not retry on it).
    pub fn set_stamp(&mut self, index: usize, stamp: u64) {
        if let Some(e) = self.entries.get(index) {
            e.stamp.store(stamp, Relaxed);
        }
    }

    /// The live entry `index`, as the store last wrote it.
    pub fn get(&self, index: usize) -> Option<Snapshot> {
        let e = self.entries.get(index)?;
        if e.state.load(Relaxed) != STATE_LIVE {
            return None;
        }
        Some(Snapshot::of(e, index, e.seq.load(Relaxed)))
    }
}

/// The seqlock's write side: `seq` odd, release fence (no word write moves above it), the
/// words, `seq` even with release (no word write moves below it).
fn write_locked(e: &Entry, write: impl FnOnce()) {
    let s = e.seq.load(Relaxed);
    debug_assert!(s & 1 == 0);
    e.seq.store(s.wrapping_add(1), Relaxed);
    fence(Release);
    write();
    e.seq.store(s.wrapping_add(2), Release);
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::layout::NAME_WORDS;

    struct Table {
        header: DirHeader,
        entries: Vec<Entry>,
    }

    fn table(capacity: usize) -> Table {
        let header = DirHeader::new();
        header.next_generation.store(1, Relaxed);
        Table {
            header,
            entries: (0..capacity).map(|_| Entry::new()).collect(),
        }
    }

    impl Table {
        fn writer(&self) -> DirectoryWriter<'_> {
            DirectoryWriter::new(&self.header, &self.entries)
        }
    }

    fn object(name: &[u8], v: u64) -> Publish<'_> {
        Publish {
            name,
            object_id: v,
            segment: v as u32,
            offset: v * 10,
            size: v * 100,
            meta_offset: v * 1000,
            meta_len: v + 1,
            flags: v + 2,
            version: v + 3,
        }
    }

    fn found(dir: &Directory<'_>, name: &[u8]) -> Snapshot {
        match dir.lookup(name) {
            Lookup::Found(s) => s,
            other => panic!("{:?}: {other:?}", String::from_utf8_lossy(name)),
        }
    }

    /// `n` distinct names whose probe chains all start at entry `bucket` of a table of
    /// `capacity` entries.
    fn colliding(capacity: usize, bucket: usize, n: usize) -> Vec<Vec<u8>> {
        (0u32..)
            .map(|i| format!("name-{i}").into_bytes())
            .filter(|name| name_hash(name) as usize & (capacity - 1) == bucket)
            .take(n)
            .collect()
    }

    #[test]
    fn publish_then_lookup_returns_every_field() {
        let t = table(16);
        let mut w = t.writer();
        let (index, generation) = w.publish(&object(b"alpha", 7)).unwrap();
        assert_eq!(generation, 1);
        assert_eq!(w.live(), 1);
        let s = found(&w.reader(), b"alpha");
        assert_eq!(s.index, index);
        assert_eq!(s.seq % 2, 0);
        assert_eq!(
            (s.object_id, s.generation, s.segment, s.offset, s.size),
            (7, 1, 7, 70, 700)
        );
        assert_eq!(
            (s.meta_offset, s.meta_len, s.flags, s.version),
            (7000, 8, 9, 10)
        );
        assert_eq!(w.get(index), Some(s));
        assert_eq!(w.reader().lookup(b"beta"), Lookup::Missing);
        assert_eq!(w.reader().lookup(b"alph"), Lookup::Missing);
        assert!(matches!(
            w.publish(&object(b"alpha", 8)),
            Err(ShmError::AlreadyPublished { index: i }) if i == index
        ));
    }

    #[test]
    fn remove_then_republish_gets_a_new_generation() {
        let t = table(8);
        let mut w = t.writer();
        let (i1, g1) = w.publish(&object(b"x", 1)).unwrap();
        let before = found(&w.reader(), b"x");
        assert!(matches!(
            w.unpublish(i1, g1 + 1),
            Err(ShmError::NotLive { .. })
        ));
        w.unpublish(i1, g1).unwrap();
        assert_eq!(w.live(), 0);
        assert_eq!(w.reader().lookup(b"x"), Lookup::Missing);
        assert!(!w.reader().still_valid(&before), "unpublish must move seq");
        assert!(matches!(w.unpublish(i1, g1), Err(ShmError::NotLive { .. })));
        assert_eq!(w.get(i1), None);
        let (i2, g2) = w.publish(&object(b"x", 2)).unwrap();
        assert_eq!(i2, i1, "same name, same (cleaned) entry");
        assert!(g2 > g1);
        let after = found(&w.reader(), b"x");
        assert_eq!((after.generation, after.object_id), (g2, 2));
        assert!(!w.reader().still_valid(&before));
        assert!(w.reader().still_valid(&after));
    }

    #[test]
    fn tombstones_keep_probe_chains_and_are_reused_and_cleaned() {
        let cap = 8;
        let names = colliding(cap, 3, 4);
        let t = table(cap);
        let mut w = t.writer();
        let placed: Vec<(usize, u64)> = names
            .iter()
            .take(3)
            .enumerate()
            .map(|(v, n)| w.publish(&object(n, v as u64 + 1)).unwrap())
            .collect();
        assert_eq!(
            placed.iter().map(|p| p.0).collect::<Vec<_>>(),
            [3, 4, 5],
            "linear probing from the shared bucket"
        );
        // Removing the head leaves a tombstone: the names behind it are still found.
        w.unpublish(placed[0].0, placed[0].1).unwrap();
        assert_eq!(t.entries[3].state.load(Relaxed), STATE_TOMBSTONE);
        assert_eq!(found(&w.reader(), &names[1]).index, 4);
        assert_eq!(found(&w.reader(), &names[2]).index, 5);
        assert_eq!(w.reader().lookup(&names[0]), Lookup::Missing);
        // A new name in the same chain reuses the tombstone.
        let (i, _) = w.publish(&object(&names[3], 9)).unwrap();
        assert_eq!(i, 3);
        assert_eq!(found(&w.reader(), &names[3]).object_id, 9);
        // Removing the middle then the tail: the tail's successor is empty, so the tail and
        // the tombstone before it go back to empty; the head stays live.
        w.unpublish(placed[1].0, placed[1].1).unwrap();
        assert_eq!(t.entries[4].state.load(Relaxed), STATE_TOMBSTONE);
        w.unpublish(placed[2].0, placed[2].1).unwrap();
        assert_eq!(t.entries[4].state.load(Relaxed), STATE_EMPTY);
        assert_eq!(t.entries[5].state.load(Relaxed), STATE_EMPTY);
        assert_eq!(t.entries[3].state.load(Relaxed), STATE_LIVE);
        assert_eq!(found(&w.reader(), &names[3]).index, 3);
        assert_eq!(w.live(), 1);
    }

    #[test]
    fn tombstone_cleanup_wraps_around_the_table() {
        let cap = 4;
        let names = colliding(cap, cap - 1, 2);
        let t = table(cap);
        let mut w = t.writer();
        let a = w.publish(&object(&names[0], 1)).unwrap();
        let b = w.publish(&object(&names[1], 2)).unwrap();
        assert_eq!((a.0, b.0), (3, 0), "the chain wraps to entry 0");
        w.unpublish(a.0, a.1).unwrap();
        assert_eq!(found(&w.reader(), &names[1]).index, 0);
        w.unpublish(b.0, b.1).unwrap();
        assert!(t
            .entries
            .iter()
            .all(|e| e.state.load(Relaxed) == STATE_EMPTY));
    }

    #[test]
    fn full_table_refuses_and_misses_terminate() {
        let cap = 4;
        let t = table(cap);
        let mut w = t.writer();
        let placed: Vec<_> = (0..cap)
            .map(|i| {
                w.publish(&object(format!("o{i}").as_bytes(), i as u64 + 1))
                    .unwrap()
            })
            .collect();
        assert!(matches!(
            w.publish(&object(b"one-too-many", 9)),
            Err(ShmError::DirectoryFull { capacity: 4 })
        ));
        // No empty entry anywhere: a miss must still end (after one lap).
        assert_eq!(w.reader().lookup(b"one-too-many"), Lookup::Missing);
        for i in 0..cap {
            assert_eq!(
                found(&w.reader(), format!("o{i}").as_bytes()).object_id,
                i as u64 + 1
            );
        }
        w.unpublish(placed[2].0, placed[2].1).unwrap();
        let (i, _) = w.publish(&object(b"one-too-many", 9)).unwrap();
        assert_eq!(i, placed[2].0);
    }

    #[test]
    fn name_limits() {
        let t = table(8);
        let mut w = t.writer();
        assert!(matches!(
            w.publish(&object(b"", 1)),
            Err(ShmError::EmptyName)
        ));
        let long = vec![b'n'; NAME_MAX + 1];
        assert!(matches!(
            w.publish(&object(&long, 1)),
            Err(ShmError::NameTooLong { len, max: NAME_MAX }) if len == NAME_MAX + 1
        ));
        assert_eq!(w.reader().lookup(&long), Lookup::Missing);
        assert_eq!(w.reader().lookup(b""), Lookup::Missing);
        // The longest name fits, and names differing only in the last byte are distinct.
        let mut max_a = vec![b'n'; NAME_MAX];
        let mut max_b = max_a.clone();
        *max_a.last_mut().unwrap() = b'a';
        *max_b.last_mut().unwrap() = b'b';
        w.publish(&object(&max_a, 1)).unwrap();
        assert_eq!(found(&w.reader(), &max_a).object_id, 1);
        assert_eq!(w.reader().lookup(&max_b), Lookup::Missing);
        w.publish(&object(&max_b, 2)).unwrap();
        assert_eq!(found(&w.reader(), &max_b).object_id, 2);
        // Names are bytes, lengths count: "k" and "k\0" are different names even though
        // their padded words are equal.
        w.publish(&object(b"k", 3)).unwrap();
        assert_eq!(w.reader().lookup(b"k\0"), Lookup::Missing);
        w.publish(&object(b"k\0", 4)).unwrap();
        assert_eq!(found(&w.reader(), b"k").object_id, 3);
        assert_eq!(found(&w.reader(), b"k\0").object_id, 4);
        // Non-UTF-8 is fine.
        w.publish(&object(&[0xff, 0x00, 0xfe], 5)).unwrap();
        assert_eq!(found(&w.reader(), &[0xff, 0x00, 0xfe]).object_id, 5);
    }

    #[test]
    fn shorter_name_reusing_an_entry_ignores_stale_name_words() {
        // Publishing writes only the words a name spans; the stale tail of a longer earlier
        // name in the same entry must not matter.
        let t = table(1);
        let mut w = t.writer();
        let long = vec![b'z'; NAME_MAX];
        let (i, g) = w.publish(&object(&long, 1)).unwrap();
        w.unpublish(i, g).unwrap();
        w.publish(&object(b"z", 2)).unwrap();
        assert_eq!(
            t.entries[0].name[NAME_WORDS - 1].load(Relaxed),
            name_word(&long, NAME_WORDS - 1)
        );
        assert_eq!(found(&w.reader(), b"z").object_id, 2);
        assert_eq!(w.reader().lookup(&long), Lookup::Missing);
    }

    #[test]
    fn reader_retries_then_gives_up_on_an_entry_being_written() {
        let t = table(4);
        let mut w = t.writer();
        let (i, _) = w.publish(&object(b"busy", 1)).unwrap();
        let seq = t.entries[i].seq.load(Relaxed);
        // As if the store stopped halfway through a write.
        t.entries[i].seq.store(seq + 1, Relaxed);
        assert_eq!(w.reader().lookup(b"busy"), Lookup::Busy);
        t.entries[i].seq.store(seq + 2, Relaxed);
        let s = found(&w.reader(), b"busy");
        assert_eq!(s.seq, seq + 2);
    }

    #[test]
    fn reader_retries_across_a_finished_write() {
        // The write finishes while the reader spins: a writer thread holds `seq` odd for a
        // while, the reader must come back with the new version or Busy, never the old words
        // mixed with the new.
        let t = table(2);
        let (i, _) = t.writer().publish(&object(b"r", 1)).unwrap();
        let e = &t.entries[i];
        let start = std::sync::Barrier::new(2);
        std::thread::scope(|sc| {
            sc.spawn(|| {
                let s = e.seq.load(Relaxed);
                e.seq.store(s + 1, Relaxed);
                start.wait();
                e.object_id.store(2, Relaxed);
                e.offset.store(20, Relaxed);
                e.seq.store(s + 2, Release);
            });
            start.wait();
            match Directory::new(&t.entries).lookup(b"r") {
                Lookup::Found(s) => assert_eq!((s.object_id, s.offset), (2, 20)),
                Lookup::Busy => {}
                Lookup::Missing => panic!("a live name went missing"),
            }
        });
    }

    #[test]
    fn concurrent_reader_never_sees_a_torn_entry() {
        // The store republishes one name over and over, every word derived from a version
        // number; readers check each snapshot is one version.
        let t = table(4);
        let rounds = 20_000u64;
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|sc| {
            sc.spawn(|| {
                let mut w = t.writer();
                let mut cur = w.publish(&object(b"hot", 1)).unwrap();
                for v in 2..rounds {
                    w.unpublish(cur.0, cur.1).unwrap();
                    cur = w.publish(&object(b"hot", v)).unwrap();
                }
                done.store(true, Relaxed);
            });
            {
                sc.spawn(|| {
                    let dir = Directory::new(&t.entries);
                    let (mut seen, mut busy) = (0u64, 0u64);
                    while !done.load(Relaxed) || seen == 0 {
                        match dir.lookup(b"hot") {
                            Lookup::Found(s) => {
                                let v = s.object_id;
                                assert_eq!(s.generation, v, "generation of another version");
                                assert_eq!(
                                    (s.segment as u64, s.offset, s.size, s.meta_offset),
                                    (v, v * 10, v * 100, v * 1000),
                                    "torn entry"
                                );
                                assert_eq!(
                                    (s.meta_len, s.flags, s.version),
                                    (v + 1, v + 2, v + 3),
                                    "torn entry"
                                );
                                seen += 1;
                            }
                            Lookup::Busy => busy += 1,
                            Lookup::Missing => {}
                        }
                    }
                    assert!(seen > 0, "never found it ({busy} busy)");
                });
            }
        });
    }

    #[test]
    fn stamp_is_outside_the_seqlock() {
        let t = table(2);
        let mut w = t.writer();
        let (i, _) = w.publish(&object(b"s", 1)).unwrap();
        let s = found(&w.reader(), b"s");
        w.set_stamp(i, 42);
        w.set_stamp(99, 1); // out of range: ignored
        assert_eq!(t.entries[i].stamp.load(Relaxed), 42);
        assert!(
            w.reader().still_valid(&s),
            "a stamp must not invalidate readers"
        );
    }

    #[test]
    fn empty_table_is_harmless() {
        let t = table(0);
        let dir = Directory {
            entries: &t.entries,
        };
        assert_eq!(dir.lookup(b"a"), Lookup::Missing);
        let mut w = DirectoryWriter {
            header: &t.header,
            entries: &t.entries,
        };
        assert!(matches!(
            w.publish(&object(b"a", 1)),
            Err(ShmError::DirectoryFull { capacity: 0 })
        ));
    }
}
