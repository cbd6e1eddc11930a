//! Hold tables: one per client, a fixed array of [`HoldSlot`]s that only the client writes and
//! the store reads. The hazard-pointer protocol (Michael, 2004) keyed on generations:
//!
//! * **get** (client): look the name up (a seqlocked [`Snapshot`]), write the snapshot's
//!   generation into a free slot, `fence(SeqCst)`, then re-load the entry's `seq`: unchanged
//!   means the entry was still live *after* the hold became visible, so the hold counts.
//!   Changed: clear the slot and retry.
//! * **free** (store): unpublish the entry (a seqlocked write, so its `seq` changes),
//!   `fence(SeqCst)`, then scan every hold table for the generation ([`is_held`]); free the
//!   memory only if no slot names it, else park it and scan again later ([`held_generations`]).
//!
//! The two SeqCst fences are totally ordered. If the store's comes first, the client's `seq`
//! load (after its fence) sees the unpublish, and the client drops its hold without touching
//! the object. If the client's comes first, the store's scan (after its fence) sees the hold
//! (or the client's later release), so the store defers. Either way no client holds memory
//! the store freed. The release is a `Release` store of 0 that the scan loads with `Acquire`,
//! so everything the client read from the object happens before the store reuses it.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};

use crate::directory::{Directory, Lookup, Snapshot};
use crate::error::{Result, ShmError};
use crate::layout::HoldSlot;
use crate::sync::{fence, AtomicU64};

/// How many times a get retries after its entry changed under it before giving up.
/// Under loom one retry covers the retry path; more only multiplies the interleavings.
#[cfg(not(loom))]
const GET_TRIES: usize = 4;
#[cfg(loom)]
const GET_TRIES: usize = 2;

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
/// store never writes the table), so finding a slot costs no shared-memory traffic. It is a
/// queue, not a stack: a released slot is reused last, so the access stamp it keeps for the
/// store's LRU fold survives as many gets as the table has slots.
#[derive(Debug)]
pub struct Holds<'a> {
    slots: &'a [HoldSlot],
    free: VecDeque<usize>,
    /// The table header's `holding` count: kept equal to the number of slots in use, so the
    /// store may skip the table when it is 0 ([`HoldsView::counted`]). Raised before a hold's
    /// fence, lowered after its release, so whenever a slot names a generation it is not 0.
    /// Not optional: a client path that forgot it would leave 0 there while holding, and the
    /// store would free what it holds.
    holding: &'a AtomicU64,
}

impl<'a> Holds<'a> {
    /// Takes over a table and its header's `holding` count; slots that are not 0 are taken to
    /// be this client's own earlier holds (a table re-opened by the same client, already
    /// counted) and are left alone.
    pub fn new(slots: &'a [HoldSlot], holding: &'a AtomicU64) -> Self {
        let free = (0..slots.len())
            .filter(|&i| slots[i].generation.load(Relaxed) == 0)
            .collect();
        Holds::with_free(slots, free, holding)
    }

    /// A table whose free-slot list the caller kept from an earlier [`Holds::into_free`]
    /// (an owner that keeps the mapping keeps the list, instead of rescanning every slot).
    pub fn with_free(slots: &'a [HoldSlot], free: VecDeque<usize>, holding: &'a AtomicU64) -> Self {
        Holds {
            slots,
            free,
            holding,
        }
    }

    /// The free-slot list, for [`Holds::with_free`].
    pub fn into_free(self) -> VecDeque<usize> {
        self.free
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
            if let Some(hold) = self.hold(dir, snapshot, stamp)? {
                return Ok(Get::Held(hold));
            }
        }
        Ok(Get::Busy)
    }

    /// The second half of a get: publish a hold on `snapshot`'s generation, then re-validate
    /// the entry. `None` (and the slot cleared again) when the entry changed since the
    /// snapshot was read: the object may already be on its way to being freed, so it must not
    /// be touched; look it up again.
    pub fn hold(
        &mut self,
        dir: &Directory<'_>,
        snapshot: Snapshot,
        stamp: u64,
    ) -> Result<Option<Hold>> {
        // Generation 0 means "free slot": a hold on it would be invisible to the store. Only
        // a corrupt directory publishes it; refuse rather than read unpinned memory.
        if snapshot.generation == 0 {
            return Ok(None);
        }
        let Some(&slot) = self.free.front() else {
            return Err(ShmError::HoldTableFull {
                slots: self.slots.len(),
            });
        };
        let s = &self.slots[slot];
        s.object_id.store(snapshot.object_id, Relaxed);
        s.stamp.store(stamp, Relaxed);
        s.generation.store(snapshot.generation, Relaxed);
        // Before the fence, like the slot: the store's load after its own fence sees it. A
        // plain store of the client's own count (it is the table's only writer), not a
        // read-modify-write, so no locked instruction on every get and release.
        self.holding.store(self.in_use() as u64 + 1, Relaxed);
        // Orders the hold's store before the re-validation's load against the store's
        // unpublish-then-scan (module docs).
        fence(SeqCst);
        if dir.still_valid(&snapshot) {
            self.free.pop_front();
            return Ok(Some(Hold { slot, snapshot }));
        }
        // Never used the object: no ordering needed for the clear.
        s.generation.store(0, Relaxed);
        // `Release`, as every store that can lower the count to 0: the store's `Acquire` load
        // of that 0 then synchronises with it, and through program order with every earlier
        // release of this client.
        self.holding.store(self.in_use() as u64, Release);
        Ok(None)
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
        self.free.push_back(hold.slot);
        // After the clear, `Release`: a store that reads 0 here has synchronised with it, so
        // the client's reads of the object happen before a free.
        self.holding.store(self.in_use() as u64, Release);
        Ok(())
    }
}

/// The store's read-only view of one client's hold table. The store never trusts the table's
/// contents for anything but "is this generation held" (a bogus value can only pin what it
/// names, which a client can do with GET anyway). Of the header it reads only the `holding`
/// count ([`HoldsView::counted`]), whose only effect is skipping this client's own table.
#[derive(Debug, Clone, Copy)]
pub struct HoldsView<'a> {
    slots: &'a [HoldSlot],
    holding: Option<&'a AtomicU64>,
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
        HoldsView {
            slots,
            holding: None,
        }
    }

    /// Reads the table's `holding` count before scanning it: 0 means no slot can name
    /// anything, so the scan is skipped. Why that is safe: a get raises the count before its
    /// fence, so a store whose fence comes later loads the raised count (or a later value);
    /// every store of the count that can write 0 is a `Release` made after the slots' clears,
    /// so an `Acquire` load of 0 synchronises with it and, through the client's program order,
    /// with every release before it. A client that under-counts can only lose its own holds'
    /// protection: it alone reads through them.
    pub fn counted(mut self, holding: &'a AtomicU64) -> Self {
        self.holding = Some(holding);
        self
    }

    /// Whether any slot names `generation`. Call [`is_held`] (which fences first) unless
    /// a fence(SeqCst) already separates this scan from the unpublish.
    pub fn holds(&self, generation: u64) -> bool {
        if self.holding.is_some_and(|n| n.load(Acquire) == 0) {
            return false;
        }
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
pub fn is_held<'a>(tables: impl IntoIterator<Item = HoldsView<'a>>, generation: u64) -> bool {
    fence(SeqCst);
    tables.into_iter().any(|t| t.holds(generation))
}

/// Every generation some table names now: the store's check before freeing the memory of
/// objects it unpublished earlier and kept while held (its *parked* entries), all at once.
/// Fence, then scan, as [`is_held`]; a table whose `holding` count is 0 is skipped, as there.
/// An object whose generation is not in the set may be freed or reused.
pub fn held_generations<'a>(tables: impl IntoIterator<Item = HoldsView<'a>>) -> HashSet<u64> {
    fence(SeqCst);
    tables
        .into_iter()
        .filter(|t| t.holding.is_none_or(|n| n.load(Acquire) != 0))
        .flat_map(|t| t.scan().map(|s| s.generation))
        .collect()
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::directory::{DirectoryWriter, Publish};
    use crate::layout::{DirHeader, Entry};

    /// The store's parked collection (`collect_parked`) reduced to the protocol: entries
    /// whose generation [`held_generations`] does not name come out, to be freed.
    fn collect<T>(parked: &mut Vec<(u64, T)>, tables: &[HoldsView<'_>]) -> Vec<T> {
        let held = held_generations(tables.iter().copied());
        let (free, keep) = parked.drain(..).partition(|(g, _)| !held.contains(g));
        *parked = keep;
        free.into_iter().map(|(_, t)| t).collect()
    }

    struct Store {
        header: DirHeader,
        entries: Vec<Entry>,
    }

    fn store(capacity: usize) -> Store {
        let header = DirHeader::new();
        header.next_generation.store(1, Relaxed);
        Store {
            header,
            entries: (0..capacity).map(|_| Entry::new()).collect(),
        }
    }

    impl Store {
        fn writer(&self) -> DirectoryWriter<'_> {
            DirectoryWriter::new(&self.header, &self.entries)
        }
        fn dir(&self) -> Directory<'_> {
            Directory::new(&self.entries)
        }
    }

    fn table(slots: usize) -> Vec<HoldSlot> {
        (0..slots).map(|_| HoldSlot::new()).collect()
    }

    fn publish(w: &mut DirectoryWriter<'_>, name: &[u8], object_id: u64) -> (usize, u64) {
        w.publish(&Publish {
            name,
            object_id,
            segment: 0,
            offset: object_id * 64,
            size: 64,
            meta_offset: 0,
            meta_len: 0,
            flags: 0,
            version: 1,
        })
        .unwrap()
    }

    fn held(g: Get) -> Hold {
        match g {
            Get::Held(h) => h,
            other => panic!("not held: {other:?}"),
        }
    }

    #[test]
    fn the_holding_count_follows_holds_and_lets_the_store_skip_empty_tables() {
        let st = store(8);
        let (ia, ga) = publish(&mut st.writer(), b"a", 1);
        let (_, gb) = publish(&mut st.writer(), b"b", 2);
        let slots = table(4);
        let holding = AtomicU64::new(0);
        let mut holds = Holds::new(&slots, &holding);
        let view = [HoldsView::new(&slots).counted(&holding)];
        let a = held(holds.get(&st.dir(), b"a", 1).unwrap());
        let b = held(holds.get(&st.dir(), b"b", 1).unwrap());
        assert_eq!(holding.load(Relaxed), 2);
        assert!(is_held(view, ga) && is_held(view, gb));
        holds.release(a).unwrap();
        assert_eq!(holding.load(Relaxed), 1);
        assert!(!is_held(view, ga) && is_held(view, gb));
        holds.release(b).unwrap();
        assert_eq!(holding.load(Relaxed), 0);
        assert!(!is_held(view, gb));
        // A get of a name no longer published takes no slot and leaves the count alone.
        st.writer().unpublish(ia, ga).unwrap();
        assert_eq!(holds.get(&st.dir(), b"a", 1).unwrap(), Get::Missing);
        assert_eq!(holding.load(Relaxed), 0);
        // A hold rejected by its re-validation (the entry changed after the lookup) gives
        // its count back.
        let Lookup::Found(stale) = st.dir().lookup(b"b") else {
            panic!("b is published");
        };
        let ib = stale.index;
        st.writer().unpublish(ib, gb).unwrap();
        assert_eq!(holds.hold(&st.dir(), stale, 1).unwrap(), None);
        assert_eq!(holding.load(Relaxed), 0);
        assert_eq!(holds.in_use(), 0);
        // The count is the client's word: one that says 0 while a slot names a generation
        // (a client lying about itself) has that hold ignored; an uncounted view still sees it.
        slots[3].generation.store(gb, Relaxed);
        assert!(!is_held(view, gb));
        assert!(is_held([HoldsView::new(&slots)], gb));
    }

    #[test]
    fn hold_is_held_release() {
        let st = store(8);
        let (_, gen) = publish(&mut st.writer(), b"a", 1);
        let slots = table(4);
        let n = AtomicU64::new(0);
        let mut holds = Holds::new(&slots, &n);
        let view = [HoldsView::new(&slots)];
        assert!(!is_held(view, gen));
        let h = held(holds.get(&st.dir(), b"a", 5).unwrap());
        assert_eq!((h.snapshot.generation, h.snapshot.object_id), (gen, 1));
        assert_eq!(holds.in_use(), 1);
        assert!(is_held(view, gen));
        assert!(!is_held(view, gen + 1));
        assert!(!is_held(view, 0), "generation 0 is never held");
        assert_eq!(
            view[0].scan().collect::<Vec<_>>(),
            [HeldSlot {
                slot: h.slot,
                generation: gen,
                object_id: 1,
                stamp: 5
            }]
        );
        // A second get of the same object is a second hold.
        let h2 = held(holds.get(&st.dir(), b"a", 6).unwrap());
        assert_ne!(h2.slot, h.slot);
        holds.release(h).unwrap();
        assert!(is_held(view, gen), "the second hold still pins it");
        holds.release(h2).unwrap();
        assert!(!is_held(view, gen));
        assert_eq!(holds.in_use(), 0);
        assert_eq!(view[0].scan().count(), 0);
        // Released slots keep their last access stamps for the LRU fold.
        let mut stamps: Vec<_> = view[0].stamps().collect();
        stamps.sort();
        assert_eq!(stamps, [(1, 5), (1, 6)]);
    }

    #[test]
    fn get_of_a_missing_or_busy_name() {
        let st = store(4);
        let slots = table(2);
        let n = AtomicU64::new(0);
        let mut holds = Holds::new(&slots, &n);
        assert_eq!(holds.get(&st.dir(), b"nope", 1).unwrap(), Get::Missing);
        let (i, _) = publish(&mut st.writer(), b"b", 1);
        let seq = st.entries[i].seq.load(Relaxed);
        st.entries[i].seq.store(seq + 1, Relaxed);
        assert_eq!(holds.get(&st.dir(), b"b", 1).unwrap(), Get::Busy);
        assert_eq!(holds.in_use(), 0, "no slot left behind");
        assert!(slots.iter().all(|s| s.generation.load(Relaxed) == 0));
    }

    #[test]
    fn retired_object_is_freed_only_when_no_table_holds_it() {
        let st = store(8);
        let mut w = st.writer();
        let (ia, ga) = publish(&mut w, b"a", 1);
        let (ib, gb) = publish(&mut w, b"b", 2);
        let (t1, t2) = (table(2), table(2));
        let (n1, n2) = (AtomicU64::new(0), AtomicU64::new(0));
        let (mut c1, mut c2) = (Holds::new(&t1, &n1), Holds::new(&t2, &n2));
        let ha1 = held(c1.get(&st.dir(), b"a", 1).unwrap());
        let ha2 = held(c2.get(&st.dir(), b"a", 1).unwrap());
        let views = [HoldsView::new(&t1), HoldsView::new(&t2)];
        // Delete both: "b" is not held, so it goes at once; "a" waits.
        let mut retired = vec![];
        w.unpublish(ia, ga).unwrap();
        w.unpublish(ib, gb).unwrap();
        retired.push((ga, "block a"));
        retired.push((gb, "block b"));
        assert_eq!(collect(&mut retired, &views), ["block b"]);
        assert_eq!(retired.len(), 1);
        // Gone from the directory: no new holds on it.
        assert_eq!(c1.get(&st.dir(), b"a", 2).unwrap(), Get::Missing);
        c1.release(ha1).unwrap();
        assert!(
            collect(&mut retired, &views).is_empty(),
            "client 2 still holds it"
        );
        c2.release(ha2).unwrap();
        assert_eq!(collect(&mut retired, &views), ["block a"]);
        assert!(retired.is_empty());
    }

    #[test]
    fn dead_clients_table_is_dropped() {
        let st = store(8);
        let mut w = st.writer();
        let (i, g) = publish(&mut w, b"a", 1);
        let (alive, dead) = (table(2), table(2));
        let n = AtomicU64::new(0);
        let mut dying = Holds::new(&dead, &n);
        // The client dies holding it: never released (a `Hold` has no destructor).
        let _never_released = held(dying.get(&st.dir(), b"a", 1).unwrap());
        drop(dying);
        w.unpublish(i, g).unwrap();
        let mut retired = vec![(g, ())];
        let both = [HoldsView::new(&alive), HoldsView::new(&dead)];
        assert!(collect(&mut retired, &both).is_empty());
        // The store notices the death and stops passing the dead table.
        assert_eq!(collect(&mut retired, &[HoldsView::new(&alive)]).len(), 1);
    }

    #[test]
    fn revalidation_rejects_an_entry_reused_after_the_lookup() {
        // The reader looks "a" up; before it publishes its hold the store deletes "a", finds
        // it unheld, frees the memory and reuses the same entry for a new "a" (a new
        // generation). The reader's hold must fail validation.
        let st = store(1); // one entry: the republish reuses it for sure
        let mut w = st.writer();
        let (i, g1) = publish(&mut w, b"a", 1);
        let slots = table(2);
        let n = AtomicU64::new(0);
        let mut holds = Holds::new(&slots, &n);
        let Lookup::Found(stale) = st.dir().lookup(b"a") else {
            panic!("not found")
        };
        w.unpublish(i, g1).unwrap();
        assert!(!is_held([HoldsView::new(&slots)], g1));
        let (i2, g2) = publish(&mut w, b"a", 2);
        assert_eq!(i2, i);
        assert_ne!(g2, g1);
        assert_eq!(holds.hold(&st.dir(), stale, 1).unwrap(), None);
        assert_eq!(holds.in_use(), 0);
        assert!(
            !is_held([HoldsView::new(&slots)], g1),
            "rejected hold cleared"
        );
        // A fresh get goes through and names the new generation only.
        let h = held(holds.get(&st.dir(), b"a", 1).unwrap());
        assert_eq!((h.snapshot.generation, h.snapshot.object_id), (g2, 2));
        let view = [HoldsView::new(&slots)];
        assert!(is_held(view, g2) && !is_held(view, g1));
        holds.release(h).unwrap();
    }

    #[test]
    fn stale_hold_does_not_pin_the_next_generation() {
        // A slot naming an old generation (say a hold the store already gave up on) pins
        // nothing that came after it.
        let st = store(2);
        let mut w = st.writer();
        let (i, g1) = publish(&mut w, b"a", 1);
        let slots = table(1);
        let n = AtomicU64::new(0);
        let mut holds = Holds::new(&slots, &n);
        let h = held(holds.get(&st.dir(), b"a", 1).unwrap());
        w.unpublish(i, g1).unwrap();
        let (_, g2) = publish(&mut w, b"a", 2);
        let view = [HoldsView::new(&slots)];
        assert!(is_held(view, g1));
        assert!(!is_held(view, g2));
        holds.release(h).unwrap();
    }

    #[test]
    fn full_hold_table_and_bad_releases() {
        let st = store(4);
        publish(&mut st.writer(), b"a", 1);
        let slots = table(2);
        let n = AtomicU64::new(0);
        let mut holds = Holds::new(&slots, &n);
        let h1 = held(holds.get(&st.dir(), b"a", 1).unwrap());
        let h2 = held(holds.get(&st.dir(), b"a", 1).unwrap());
        assert!(matches!(
            holds.get(&st.dir(), b"a", 1),
            Err(ShmError::HoldTableFull { slots: 2 })
        ));
        assert_eq!(holds.in_use(), 2);
        let snapshot = h1.snapshot;
        let fake = |slot| Hold { slot, snapshot };
        assert!(matches!(
            holds.release(fake(7)),
            Err(ShmError::NotHeld { slot: 7, .. })
        ));
        let slot1 = h1.slot;
        holds.release(h1).unwrap();
        // Releasing the same slot twice is refused (the slot is free now).
        assert!(matches!(
            holds.release(fake(slot1)),
            Err(ShmError::NotHeld { .. })
        ));
        assert_eq!(holds.in_use(), 1);
        let h3 = held(holds.get(&st.dir(), b"a", 1).unwrap());
        holds.release(h2).unwrap();
        holds.release(h3).unwrap();
        assert_eq!(holds.in_use(), 0);
    }

    #[test]
    fn reopened_table_keeps_earlier_holds() {
        let st = store(4);
        let (_, g) = publish(&mut st.writer(), b"a", 1);
        let slots = table(3);
        let n = AtomicU64::new(0);
        let h = held(Holds::new(&slots, &n).get(&st.dir(), b"a", 1).unwrap());
        let mut again = Holds::new(&slots, &n);
        assert_eq!(again.in_use(), 1);
        let h2 = held(again.get(&st.dir(), b"a", 1).unwrap());
        assert_ne!(h2.slot, h.slot, "a live slot is not handed out again");
        again.release(h).unwrap();
        again.release(h2).unwrap();
        assert!(!is_held([HoldsView::new(&slots)], g));
    }

    #[test]
    fn concurrent_gets_never_use_freed_memory() {
        // Threads standing in for processes: a reader gets/releases "obj" while the store
        // deletes and republishes it into a recycled block. Each block carries the generation
        // that owns it; the store poisons a block when it frees it. A reader holding a
        // validated hold must always see its own generation in the block.
        use std::sync::atomic::{AtomicBool, AtomicU64};
        let st = store(4);
        let blocks: Vec<AtomicU64> = (0..2).map(|_| AtomicU64::new(0)).collect();
        let slots = table(4);
        let n = AtomicU64::new(0);
        let done = AtomicBool::new(false);
        // Validated gets so far: the store goes on until the reader has made some (on a loaded
        // machine the reader thread may start after 20,000 rounds), for at most 20 s.
        let gets = AtomicU64::new(0);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        const POISON: u64 = u64::MAX;
        std::thread::scope(|sc| {
            sc.spawn(|| {
                let mut w = st.writer();
                let mut retired: Vec<(u64, usize)> = Vec::new();
                let mut free: Vec<usize> = vec![1];
                let view = [HoldsView::new(&slots).counted(&n)];
                // Block 0 for generation 1.
                blocks[0].store(1, Relaxed);
                let mut cur = publish(&mut w, b"obj", 0);
                let mut cur_block = 0;
                let mut round = 0u64;
                while round < 20_000
                    || (gets.load(Relaxed) < 1_000 && std::time::Instant::now() < deadline)
                {
                    round += 1;
                    w.unpublish(cur.0, cur.1).unwrap();
                    if is_held(view, cur.1) {
                        retired.push((cur.1, cur_block));
                    } else {
                        free.push(cur_block);
                    }
                    free.extend(collect(&mut retired, &view));
                    let b = loop {
                        if let Some(b) = free.pop() {
                            break b;
                        }
                        // Every block pinned: wait for the reader's release.
                        std::thread::yield_now();
                        free.extend(collect(&mut retired, &view));
                    };
                    // Free (poison), then reuse for the next generation.
                    blocks[b].store(POISON, Relaxed);
                    let g = st.header.next_generation.load(Relaxed);
                    blocks[b].store(g, Release);
                    cur_block = b;
                    cur = publish(&mut w, b"obj", b as u64);
                    assert_eq!(cur.1, g);
                }
                done.store(true, Relaxed);
            });
            sc.spawn(|| {
                let dir = st.dir();
                let mut holds = Holds::new(&slots, &n);
                let mut got = 0u64;
                while !done.load(Relaxed) {
                    if let Get::Held(h) = holds.get(&dir, b"obj", 1).unwrap() {
                        let b = h.snapshot.object_id as usize;
                        for _ in 0..4 {
                            let tag = blocks[b].load(Acquire);
                            assert_eq!(tag, h.snapshot.generation, "freed or reused block");
                        }
                        got += 1;
                        gets.store(got, Relaxed);
                        holds.release(h).unwrap();
                    }
                }
                assert!(got > 0);
            });
        });
    }
}
