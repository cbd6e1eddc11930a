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
    name_hash, name_word, DirHeader, Entry, NAME_MAX, STATE_EMPTY, STATE_LIVE,
    STATE_TOMBSTONE,
};
use crate::sync::{fence, spin};

/// How many times a reader re-reads an entry the store is writing before giving up.
const SEQ_TRIES: usize = 64;

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
}

enum Probe {
    Empty,
    Tombstone,
    Other,
    Match(Snapshot),
}

/// Read side: what every client (and the store itself) looks names up with.
#[derive(Clone, Copy)]
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
        if name.is_empty() || name.len() > NAME_MAX {
            return Lookup::Missing;
        }
        let hash = name_hash(name);
        let mask = self.entries.len() - 1;
        let start = hash as usize & mask;
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
        self.entries[snapshot.index].seq.load(Acquire) == snapshot.seq
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
                    let seg_len = e.segment_name_len.load(Relaxed);
                    let len = (seg_len >> 32) as usize;
                    let same = len == name.len()
                        && (0..name.len().div_ceil(8))
                            .all(|i| e.name[i].load(Relaxed) == name_word(name, i));
                    if same {
                        Probe::Match(Snapshot {
                            index,
                            seq: s1,
                            object_id: e.object_id.load(Relaxed),
                            generation: e.generation.load(Relaxed),
                            segment: seg_len as u32,
                            offset: e.offset.load(Relaxed),
                            size: e.size.load(Relaxed),
                            meta_offset: e.meta_offset.load(Relaxed),
                            meta_len: e.meta_len.load(Relaxed),
                            flags: e.flags.load(Relaxed),
                        })
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
        self.header.live.load(Relaxed) as usize
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
        let hash = name_hash(p.name);
        let mask = self.entries.len() - 1;
        let start = hash as usize & mask;
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
    /// [`crate::hold::Retired`]).
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
        let seg_len = e.segment_name_len.load(Relaxed);
        Some(Snapshot {
            index,
            seq: e.seq.load(Relaxed),
            object_id: e.object_id.load(Relaxed),
            generation: e.generation.load(Relaxed),
            segment: seg_len as u32,
            offset: e.offset.load(Relaxed),
            size: e.size.load(Relaxed),
            meta_offset: e.meta_offset.load(Relaxed),
            meta_len: e.meta_len.load(Relaxed),
            flags: e.flags.load(Relaxed),
        })
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
