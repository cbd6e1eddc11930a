//! loom model checks of the seqlocked directory read, the hold/validate/free protocol (one and
//! two readers, the store's own `is_held` and `held_generations`, a replace racing a reader),
//! taking a lend back (with the
//! populate thread and the PUBLISH reply), and the `puts_sent` barrier. Run:
//! `RUSTFLAGS="--cfg loom" cargo test -p vovp-shm --release --test loom` (about 5 minutes on two
//! cores). Each model runs with at most [`PREEMPTIONS`] preemptions (`LOOM_MAX_PREEMPTIONS`
//! overrides it). Each model was seen to fail with its protocol step removed or reordered.
//!
//! Object memory is a `loom::cell::UnsafeCell`: the store writing it (free/reuse) while a
//! reader that holds it reads it is a data race loom reports as a failure. So "a reader never
//! reads memory the store freed" is checked in every explored execution, not sampled.
#![cfg(loom)]

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::thread;

use vovp_shm::layout::{DirHeader, Entry, HoldHeader, HoldSlot};
use vovp_shm::{
    held_generations, is_held, Directory, DirectoryWriter, Get, Holds, HoldsView, LendRevoker,
    LendWriters, Lookup, Publish, SentPuts, Snapshot,
};

/// Preemption bound per execution for the hold models, unless `LOOM_MAX_PREEMPTIONS` says
/// otherwise (about 90 s each in release on two cores).
const PREEMPTIONS: usize = 2;

fn model<F: Fn() + Sync + Send + 'static>(f: F) {
    model_bounded(PREEMPTIONS, f)
}

fn model_bounded<F: Fn() + Sync + Send + 'static>(bound: usize, f: F) {
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(bound);
    }
    b.check(f);
}

/// Two objects' memory. Value = the generation that owns it (a generation tag).
struct Memory([UnsafeCell<u64>; 2]);
// SAFETY: accesses are ordered by the protocol under test; loom checks that claim.
unsafe impl Sync for Memory {}

struct Shared {
    header: DirHeader,
    entries: Vec<Entry>,
    slots: Vec<HoldSlot>,
    /// The hold table's header: its `holding` count, as the daemon's tables have one.
    hold_header: HoldHeader,
    /// A second client's table (the two-reader model).
    slots2: Vec<HoldSlot>,
    hold_header2: HoldHeader,
    memory: Memory,
}

fn shared(entries: usize, slots: usize) -> Arc<Shared> {
    let header = DirHeader::new();
    header
        .next_generation
        .store(1, std::sync::atomic::Ordering::Relaxed);
    Arc::new(Shared {
        header,
        entries: (0..entries).map(|_| Entry::new()).collect(),
        slots: (0..slots).map(|_| HoldSlot::new()).collect(),
        hold_header: HoldHeader::new(),
        slots2: (0..slots).map(|_| HoldSlot::new()).collect(),
        hold_header2: HoldHeader::new(),
        memory: Memory([UnsafeCell::new(0), UnsafeCell::new(0)]),
    })
}

/// The store's parked collection (`collect_parked`) reduced to the protocol: entries whose
/// generation `held_generations` (the store's own scan) does not name come out, to be freed.
fn collect<T>(parked: &mut Vec<(u64, T)>, tables: &[HoldsView<'_>]) -> Vec<T> {
    let held = held_generations(tables.iter().copied());
    let (free, keep) = parked.drain(..).partition(|(g, _)| !held.contains(g));
    *parked = keep;
    free.into_iter().map(|(_, t)| t).collect()
}

/// Every word of an object's location derives from `v`, so a torn read shows.
fn publish(w: &mut DirectoryWriter<'_>, name: &[u8], v: u64) -> (usize, u64) {
    w.publish(&Publish {
        name,
        object_id: v,
        segment: v as u32,
        offset: v,
        size: v,
        meta_offset: v,
        meta_len: v,
        flags: v,
        version: v,
    })
    .expect("publish")
}

/// "a" published (generation 1) in the memory of cell 0, tagged with that generation.
fn publish_a(s: &Shared) -> (usize, u64) {
    let mut w = DirectoryWriter::new(&s.header, &s.entries);
    s.memory.0[0].with_mut(|p| unsafe { *p = 1 });
    publish(&mut w, b"a", 0)
}

/// A reader's get of "a" through the hold table `slots` (counted in `header`): when it holds
/// it, `check` is given the snapshot it accepted and the tag the memory it names carries (the
/// read loom watches), then the hold is released.
fn hold_a_and_read(
    r: &Shared,
    slots: &[HoldSlot],
    header: &HoldHeader,
    check: impl FnOnce(&Snapshot, u64),
) {
    let dir = Directory::new(&r.entries);
    let mut holds = Holds::new(slots, &header.holding);
    if let Get::Held(h) = holds.get(&dir, b"a", 1).expect("get") {
        let tag = r.memory.0[h.snapshot.offset as usize].with(|p| unsafe { *p });
        check(&h.snapshot, tag);
        holds.release(h).expect("release");
    }
}

/// A writer republishing an entry while a reader looks it up: the reader sees one whole
/// version (or nothing), never words of two.
#[test]
fn seqlock_read_is_never_torn() {
    model_bounded(2, || {
        let s = shared(1, 1);
        // Version 1 is published before the reader starts; the race is the rewrite.
        let (i, g) = publish(&mut DirectoryWriter::new(&s.header, &s.entries), b"a", 1);
        let r = s.clone();
        let reader = thread::spawn(move || {
            let dir = Directory::new(&r.entries);
            for _ in 0..2 {
                if let Lookup::Found(snap) = dir.lookup(b"a") {
                    let v = snap.object_id;
                    assert!(v == 1 || v == 2, "object id {v}");
                    assert_eq!(snap.generation, v, "generation from another version");
                    assert_eq!(
                        [
                            snap.segment as u64,
                            snap.offset,
                            snap.size,
                            snap.meta_offset,
                            snap.meta_len,
                            snap.flags,
                            snap.version
                        ],
                        [v; 7],
                        "torn entry"
                    );
                }
            }
        });
        {
            let mut w = DirectoryWriter::new(&s.header, &s.entries);
            w.unpublish(i, g).expect("unpublish");
            let (_, g2) = publish(&mut w, b"a", 2);
            assert_eq!(g2, 2);
        }
        reader.join().unwrap();
    });
}

/// The required model: a reader doing lookup → hold → re-validate → read → release, racing
/// the store doing remove → `is_held` → free and reuse (the memory rewritten for a new object
/// published under the same name, in the same entry) or, when held, a deferred free after the
/// reader is done. loom fails on any read of the memory racing the store's write; the reader
/// also checks the generation tag the memory carries against the hold it accepted.
#[test]
fn hold_never_sees_freed_memory() {
    model(|| {
        let s = shared(1, 1);
        let (index, generation) = publish_a(&s);
        assert_eq!(generation, 1);
        let r = s.clone();
        let reader = thread::spawn(move || {
            hold_a_and_read(&r, &r.slots, &r.hold_header, |snap, tag| {
                assert_eq!(tag, snap.generation, "freed or reused memory accepted");
            });
        });
        let mut retired = Vec::new();
        let mut w = DirectoryWriter::new(&s.header, &s.entries);
        w.unpublish(index, generation).expect("unpublish");
        let views = [HoldsView::new(&s.slots).counted(&s.hold_header.holding)];
        if is_held(views, generation) {
            retired.push((generation, 0usize));
        } else {
            // Free and reuse at once: a new object (generation 2) in the same memory, under
            // the same name, in the same (only) entry.
            s.memory.0[0].with_mut(|p| unsafe { *p = 2 });
            let (i2, g2) = publish(&mut w, b"a", 0);
            assert_eq!((i2, g2), (index, 2));
        }
        reader.join().unwrap();
        // After the reader is done, a deferred free goes through.
        for cell in collect(&mut retired, &views) {
            s.memory.0[cell].with_mut(|p| unsafe { *p = 0xdead });
        }
        assert!(retired.is_empty(), "hold left behind");
    });
}

/// Deferred free concurrent with the release: the store retires, then polls `collect` until
/// the reader's release lets it reuse the memory for a new object under the same name.
/// Checks release → collect ordering (the reader's read happens before the reuse).
#[test]
fn deferred_free_waits_for_release_then_reuses() {
    model(|| {
        let s = shared(1, 1);
        let (index, generation) = publish_a(&s);
        let r = s.clone();
        let reader = thread::spawn(move || {
            hold_a_and_read(&r, &r.slots, &r.hold_header, |snap, tag| {
                assert_eq!(tag, snap.generation, "freed or reused memory");
            });
        });
        let mut w = DirectoryWriter::new(&s.header, &s.entries);
        w.unpublish(index, generation).expect("unpublish");
        let mut retired = vec![(generation, 0usize)];
        let views = [HoldsView::new(&s.slots).counted(&s.hold_header.holding)];
        let cell = loop {
            if let Some(c) = collect(&mut retired, &views).pop() {
                break c;
            }
            thread::yield_now();
        };
        // Reuse the freed memory for the next object of the same name (generation 2).
        s.memory.0[cell].with_mut(|p| unsafe { *p = 2 });
        let (_, g2) = publish(&mut w, b"a", cell as u64);
        assert_eq!(g2, 2);
        reader.join().unwrap();
    });
}

/// A replace racing a reader (the store's seal of a replacement, `ObjectTable::seal`): the
/// previous version is unpublished, `is_held` decides between freeing its memory now (then
/// reused) and parking it, and the new version is published under the same name in other
/// memory; parked, it is freed once no hold names it. The reader gets the name once: it holds
/// one whole version (the entry's version word matches the version its memory carries), or
/// finds nothing (it would then ask the store, which has the new version already), and never
/// reads memory the store freed.
#[test]
fn a_replace_racing_a_reader_gives_one_whole_version() {
    model(|| {
        // One entry: the new version's publish reuses the entry the old one's unpublish left
        // (the same name hashes to the same place), as in the store.
        let s = shared(1, 1);
        // Version 1 in cell 0; its memory carries its version number.
        s.memory.0[0].with_mut(|p| unsafe { *p = 1 });
        let version = |w: &mut DirectoryWriter<'_>, cell: u64, v: u64| {
            w.publish(&Publish {
                name: b"a",
                object_id: v,
                segment: 0,
                offset: cell,
                size: 8,
                meta_offset: cell,
                meta_len: 0,
                flags: 0,
                version: v,
            })
            .expect("publish")
        };
        let (index, generation) = version(&mut DirectoryWriter::new(&s.header, &s.entries), 0, 1);
        let r = s.clone();
        let reader = thread::spawn(move || {
            hold_a_and_read(&r, &r.slots, &r.hold_header, |snap, tag| {
                assert_eq!(
                    (snap.offset, snap.version),
                    (snap.version - 1, snap.version)
                );
                assert_eq!(tag, snap.version, "a version's entry over other memory");
            });
        });
        // Version 2 was written into cell 1 by its client before the seal.
        s.memory.0[1].with_mut(|p| unsafe { *p = 2 });
        let mut w = DirectoryWriter::new(&s.header, &s.entries);
        let mut parked = Vec::new();
        w.unpublish(index, generation).expect("unpublish");
        let views = [HoldsView::new(&s.slots).counted(&s.hold_header.holding)];
        if is_held(views, generation) {
            parked.push((generation, 0usize));
        } else {
            // Freed and reused at once.
            s.memory.0[0].with_mut(|p| unsafe { *p = 0xdead });
        }
        version(&mut w, 1, 2);
        reader.join().unwrap();
        for cell in collect(&mut parked, &views) {
            s.memory.0[cell].with_mut(|p| unsafe { *p = 0xdead });
        }
        assert!(parked.is_empty(), "hold left behind");
    });
}

/// Taking a lend back: a client putting into its lend (begin → write → end, twice, as a put
/// loop does) races the store revoking the lend and, when that says no put writes, freeing and
/// reusing its memory. loom fails on any client write racing the store's; the client also
/// checks that no write of its own was ever overwritten while it was writing.
#[test]
fn a_revoked_lend_is_never_written() {
    struct Lend {
        header: HoldHeader,
        memory: UnsafeCell<u64>,
    }
    // SAFETY: accesses are ordered by the protocol under test; loom checks that claim.
    unsafe impl Sync for Lend {}
    model(|| {
        let lend = Arc::new(Lend {
            header: HoldHeader::new(),
            memory: UnsafeCell::new(0),
        });
        let c = lend.clone();
        let client = thread::spawn(move || {
            let writers = LendWriters::new(&c.header);
            for put in 1..=2u64 {
                if !writers.begin(1) {
                    return; // taken back: the client asks for a new lend, writes nothing here
                }
                c.memory.with_mut(|p| unsafe { *p = put });
                let back = c.memory.with(|p| unsafe { *p });
                assert_eq!(
                    back, put,
                    "the store wrote the lend while a put was writing it"
                );
                writers.end();
            }
        });
        let revoker = LendRevoker::new(&lend.header);
        // Once no put writes into it, the lend is retired and freed: the memory goes to
        // another object of the same client.
        while !revoker.revoke(1) {
            thread::yield_now();
        }
        lend.memory.with_mut(|p| unsafe { *p = 99 });
        client.join().unwrap();
    });
}

/// Two readers, each through a hold table of its own, race the store's delete: the store asks
/// `is_held` of both tables (one of which may show `holding` 0 at any moment, so its scan is
/// skipped) and, when held, parks the object and frees it once `held_generations` (the
/// store's parked collection) names it no more. Neither reader ever reads freed memory.
#[test]
fn two_readers_in_two_tables_never_see_freed_memory() {
    model(|| {
        let s = shared(1, 1);
        let (index, generation) = publish_a(&s);
        let readers: Vec<_> = [false, true]
            .into_iter()
            .map(|second| {
                let r = s.clone();
                thread::spawn(move || {
                    let (slots, header) = if second {
                        (&r.slots2, &r.hold_header2)
                    } else {
                        (&r.slots, &r.hold_header)
                    };
                    hold_a_and_read(&r, slots, header, |snap, tag| {
                        assert_eq!(tag, snap.generation, "freed memory accepted");
                    });
                })
            })
            .collect();
        let views = [
            HoldsView::new(&s.slots).counted(&s.hold_header.holding),
            HoldsView::new(&s.slots2).counted(&s.hold_header2.holding),
        ];
        DirectoryWriter::new(&s.header, &s.entries)
            .unpublish(index, generation)
            .expect("unpublish");
        let mut parked = Vec::new();
        if is_held(views, generation) {
            parked.push((generation, 0usize));
        } else {
            s.memory.0[0].with_mut(|p| unsafe { *p = 0xdead });
        }
        while !parked.is_empty() {
            for cell in collect(&mut parked, &views) {
                s.memory.0[cell].with_mut(|p| unsafe { *p = 0xdead });
            }
            thread::yield_now();
        }
        for r in readers {
            r.join().unwrap();
        }
    });
}

/// A client's two writers of one lend: the populate thread (faulting the pages in, a write)
/// and a put that writes its object, sends PUBLISH and ends its write only after the reply.
/// The store, between handling PUBLISHes, takes the lend back and frees it when no object was
/// published from it. loom fails on any client write racing the free; a PUBLISH never names
/// a lend the store freed (its object would be lost); a published object is never freed.
#[test]
fn a_lend_is_freed_only_after_populate_and_publish_reply() {
    use loom::sync::atomic::AtomicBool;
    use std::sync::atomic::Ordering::{Acquire, Release};
    struct Lend {
        header: HoldHeader,
        /// [0]: a page the populate thread faults in; [1]: the put's object.
        memory: [UnsafeCell<u64>; 2],
        publish_sent: AtomicBool,
        publish_answered: AtomicBool,
        put_done: AtomicBool,
    }
    // SAFETY: accesses are ordered by the protocol under test; loom checks that claim.
    unsafe impl Sync for Lend {}
    model(|| {
        let lend = Arc::new(Lend {
            header: HoldHeader::new(),
            memory: [UnsafeCell::new(0), UnsafeCell::new(0)],
            publish_sent: AtomicBool::new(false),
            publish_answered: AtomicBool::new(false),
            put_done: AtomicBool::new(false),
        });
        let p = lend.clone();
        let populate = thread::spawn(move || {
            let writers = LendWriters::new(&p.header);
            if writers.begin(1) {
                p.memory[0].with_mut(|m| unsafe { *m = 7 });
                writers.end();
            }
        });
        let c = lend.clone();
        let put = thread::spawn(move || {
            let writers = LendWriters::new(&c.header);
            if writers.begin(1) {
                c.memory[1].with_mut(|m| unsafe { *m = 42 });
                c.publish_sent.store(true, Release);
                while !c.publish_answered.load(Acquire) {
                    thread::yield_now();
                }
                // Only now: until the reply, the PUBLISH may still be unprocessed.
                writers.end();
            }
            c.put_done.store(true, Release);
        });
        let revoker = LendRevoker::new(&lend.header);
        let (mut published, mut retired, mut freed) = (false, false, false);
        while !(retired && lend.put_done.load(Acquire)) {
            if !published && lend.publish_sent.load(Acquire) {
                assert!(!freed, "a PUBLISH names a lend the store freed");
                published = true; // the object is live in the lend
                lend.publish_answered.store(true, Release);
            }
            if !retired && revoker.revoke(1) {
                retired = true;
                if !published {
                    // Retired with no object: freed, its memory handed to another object.
                    for cell in &lend.memory {
                        cell.with_mut(|m| unsafe { *m = 99 });
                    }
                    freed = true;
                }
            }
            thread::yield_now();
        }
        populate.join().unwrap();
        put.join().unwrap();
        if published {
            assert_eq!(lend.memory[1].with(|m| unsafe { *m }), 42);
        }
    });
}

/// The `puts_sent` barrier: client A counts a pipelined PUT, sends it and tells client B the
/// name (any channel); B, if told, sends a GET of it. The store handles the two sockets in
/// any order; before answering "missing" it loads A's `puts_sent` and waits until it applied
/// that many of A's puts. So a GET sent after A's put returned is never answered "missing".
#[test]
fn a_get_after_a_pipelined_put_returned_finds_it() {
    use loom::sync::atomic::{AtomicBool, AtomicU8};
    use std::sync::atomic::Ordering::{Acquire, Release};
    const NOT_YET: u8 = 0;
    const GET_SENT: u8 = 1;
    const NO_GET: u8 = 2;
    struct Sockets {
        header: HoldHeader,
        put_sent: AtomicBool,
        told: AtomicBool,
        b: AtomicU8,
    }
    model(|| {
        let s = Arc::new(Sockets {
            header: HoldHeader::new(),
            put_sent: AtomicBool::new(false),
            told: AtomicBool::new(false),
            b: AtomicU8::new(NOT_YET),
        });
        let a = s.clone();
        let client_a = thread::spawn(move || {
            SentPuts::new(&a.header).count();
            a.put_sent.store(true, Release); // the PUT, in A's socket
            a.told.store(true, Release); // put returned; A tells B
        });
        let b = s.clone();
        let client_b = thread::spawn(move || {
            let state = if b.told.load(Acquire) {
                GET_SENT
            } else {
                NO_GET
            };
            b.b.store(state, Release);
        });
        // The store: A's socket and B's, in whatever order they become readable.
        let mut applied = 0u64;
        loop {
            if applied == 0 && s.put_sent.load(Acquire) {
                applied = 1;
            }
            match s.b.load(Acquire) {
                NOT_YET => {}
                GET_SENT if applied > 0 => break, // found
                GET_SENT => {
                    // Missing so far: only once every put A counted was applied.
                    assert!(
                        applied < SentPuts::new(&s.header).sent(),
                        "a put that had returned would be answered missing"
                    );
                }
                _ => break, // B was never told: no GET
            }
            thread::yield_now();
        }
        client_a.join().unwrap();
        client_b.join().unwrap();
    });
}
