//! Hold tables: one per client, a fixed array of [`HoldSlot`]s that only the client writes and
//! the store reads. The hazard-pointer protocol (Michael, 2004) keyed on generations:
//!
//! * **get** (client): look the name up (a seqlocked [`Snapshot`]), write the snapshot's
//!   generation into a free slot, `fence(SeqCst)`, then re-load the entry's `seq`: unchanged
//!   means the entry was still live *after* the hold became visible, so the hold counts.
//!   Changed: clear the slot and retry.
//! * **free** (store): unpublish the entry (a seqlocked write, so its `seq` changes),
//!   `fence(SeqCst)`, then scan every hold table for the generation ([`is_held`]); free the
//!   memory only if no slot names it, else keep it retired ([`Retired`]) and scan again later.
//!
//! The two SeqCst fences are totally ordered. If the store's comes first, the client's `seq`
//! load (after its fence) sees the unpublish, and the client drops its hold without touching
//! the object. If the client's comes first, the store's scan (after its fence) sees the hold
//! (or the client's later release), so the store defers. Either way no client holds memory
//! the store freed. The release is a `Release` store of 0 that the scan loads with `Acquire`,
//! so everything the client read from the object happens before the store reuses it.

use std::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};

use crate::directory::{Directory, Lookup, Snapshot};
use crate::error::{Result, ShmError};
use crate::layout::HoldSlot;
use crate::sync::fence;

/// How many times a get retries after its entry changed under it before giving up.
const GET_TRIES: usize = 4;

/// A validated hold: the object (as of `snapshot`) cannot be freed or reused until
/// [`Holds::release`]. Not `Clone`: one release per hold.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a hold pins the object until released"]
pub struct Hold {
    pub slot: usize,
    pub snapshot: Snapshot,
}

/// What a get found.
#[derive(Debug, PartialEq, Eq)]
pub enum Get {
    Held(Hold),
    /// Not (or no longer) in the directory: ask the store over the socket.
    Missing,
    /// The entry kept changing: ask the store over the socket.
    Busy,
}

/// The client's side of its hold table. The free-slot list is private to the client (the
/// store never writes the table), so finding a slot costs no shared-memory traffic.
pub struct Holds<'a> {
    slots: &'a [HoldSlot],
    free: Vec<u32>,
}

impl<'a> Holds<'a> {
    /// Takes over a table; slots that are not 0 are taken to be this client's own earlier
    /// holds (a table re-opened by the same client) and are left alone.
    pub fn new(slots: &'a [HoldSlot]) -> Self {
        let free = (0..slots.len() as u32)
            .rev()
            .filter(|&i| slots[i as usize].generation.load(Relaxed) == 0)
            .collect();
        Holds { slots, free }
    }

    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    pub fn in_use(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Get = lookup, publish the hold, re-validate. No syscall, no message. `stamp` is the
    /// access time the store's LRU fold sees ([`crate::now_stamp`]).
    pub fn get(&mut self, dir: &Directory<'_>, name: &[u8], stamp: u64) -> Result<Get> {
        for _ in 0..GET_TRIES {
            let snapshot = match dir.lookup(name) {
                Lookup::Found(s) => s,
                Lookup::Missing => return Ok(Get::Missing),
                Lookup::Busy => return Ok(Get::Busy),
            };
            let Some(&slot) = self.free.last() else {
                return Err(ShmError::HoldTableFull {
                    slots: self.slots.len(),
                });
            };
            let s = &self.slots[slot as usize];
            s.object_id.store(snapshot.object_id, Relaxed);
            s.stamp.store(stamp, Relaxed);
            s.generation.store(snapshot.generation, Relaxed);
            // Orders the hold's store before the re-validation's load against the store's
            // unpublish-then-scan (module docs).
            fence(SeqCst);
            if dir.still_valid(&snapshot) {
                self.free.pop();
                return Ok(Get::Held(Hold {
                    slot: slot as usize,
                    snapshot,
                }));
            }
            // Never used the object: no ordering needed for the clear.
            s.generation.store(0, Relaxed);
        }
        Ok(Get::Busy)
    }

    /// Release = clear the slot; no syscall. `Release`: every read of the object so far
    /// happens before the store, seeing 0, frees it.
    pub fn release(&mut self, hold: Hold) -> Result<()> {
        let s = self.slots.get(hold.slot).ok_or(ShmError::NotHeld {
            slot: hold.slot,
            generation: hold.snapshot.generation,
        })?;
        if s.generation.load(Relaxed) != hold.snapshot.generation {
            return Err(ShmError::NotHeld {
                slot: hold.slot,
                generation: hold.snapshot.generation,
            });
        }
        s.generation.store(0, Release);
        self.free.push(hold.slot as u32);
        Ok(())
    }
}

/// The store's read-only view of one client's hold table. The store never trusts the table's
/// contents for anything but "is this generation held" (a bogus value can only pin what it
/// names, which a client can do with GET anyway), and never reads its header after creating it.
#[derive(Clone, Copy)]
pub struct HoldsView<'a> {
    slots: &'a [HoldSlot],
}

/// One non-empty slot, as scanned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeldSlot {
    pub slot: usize,
    pub generation: u64,
    pub object_id: u64,
    pub stamp: u64,
}

impl<'a> HoldsView<'a> {
    pub fn new(slots: &'a [HoldSlot]) -> Self {
        HoldsView { slots }
    }

    /// Whether any slot names `generation`. Call [`is_held`] (which fences first) unless
    /// a fence(SeqCst) already separates this scan from the unpublish.
    pub fn holds(&self, generation: u64) -> bool {
        generation != 0
            && self
                .slots
                .iter()
                .any(|s| s.generation.load(Acquire) == generation)
    }

    /// Every non-empty slot (STATS, `list`, and the LRU fold). A snapshot: racing gets and
    /// releases may or may not show.
    pub fn scan(&self) -> impl Iterator<Item = HeldSlot> + 'a {
        self.slots.iter().enumerate().filter_map(|(slot, s)| {
            let generation = s.generation.load(Acquire);
            (generation != 0).then(|| HeldSlot {
                slot,
                generation,
                object_id: s.object_id.load(Relaxed),
                stamp: s.stamp.load(Relaxed),
            })
        })
    }

    /// The last access stamp in each slot, held or since released (for the LRU fold: a
    /// released slot keeps the stamp of its last get until the slot is reused).
    pub fn stamps(&self) -> impl Iterator<Item = (u64, u64)> + 'a {
        self.slots
            .iter()
            .map(|s| (s.object_id.load(Relaxed), s.stamp.load(Relaxed)))
            .filter(|&(_, stamp)| stamp != 0)
    }
}

/// The store's check before freeing, reusing or evicting memory of `generation`, which it
/// must already have unpublished: fence, then scan every live client's table. A dead client's
/// table is simply no longer passed in: its holds die with it.
pub fn is_held(tables: &[HoldsView<'_>], generation: u64) -> bool {
    fence(SeqCst);
    tables.iter().any(|t| t.holds(generation))
}

/// Unpublished objects whose memory waits for the last hold to go (delete deferred while
/// held). `T` is whatever the store needs to free the memory (its block, its object id).
pub struct Retired<T> {
    pending: Vec<(u64, T)>,
}

impl<T> Default for Retired<T> {
    fn default() -> Self {
        Retired {
            pending: Vec::new(),
        }
    }
}

impl<T> Retired<T> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Retires an object the store has just unpublished.
    pub fn retire(&mut self, generation: u64, what: T) {
        self.pending.push((generation, what));
    }

    pub fn len(&self) -> usize {
        self.pending.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Hands back every retired object no table holds any more: its memory may be reused.
    pub fn collect(&mut self, tables: &[HoldsView<'_>]) -> Vec<T> {
        fence(SeqCst);
        let mut freed = Vec::new();
        let mut i = 0;
        while i < self.pending.len() {
            if tables.iter().any(|t| t.holds(self.pending[i].0)) {
                i += 1;
            } else {
                freed.push(self.pending.swap_remove(i).1);
            }
        }
        freed
    }
}
