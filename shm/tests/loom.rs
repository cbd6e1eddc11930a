//! loom model checks of the seqlocked directory read and the hold/validate/free protocol.
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p vovp-shm --release --test loom`. Each model
//! runs with at most [`PREEMPTIONS`] preemptions (bounded, so it finishes in under two minutes on two
//! cores; `LOOM_MAX_PREEMPTIONS` overrides it).
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
    is_held, Directory, DirectoryWriter, Get, Holds, HoldsView, LendRevoker, LendWriters, Lookup,
    Publish, Retired,
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
        memory: Memory([UnsafeCell::new(0), UnsafeCell::new(0)]),
    })
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
    })
    .expect("publish")
}

/// A writer republishing an entry while a reader looks it up: the reader sees one whole
/// version (or nothing), never words of two.
#[test]
fn seqlock_read_is_never_torn() {
    // One preemption already lets the writer run a whole rewrite in the middle of a read
    // (the torn case the re-check must catch); the entry's many words make two take minutes.
    model_bounded(1, || {
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
                            snap.flags
                        ],
                        [v; 6],
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
        let (index, generation) = {
            let mut w = DirectoryWriter::new(&s.header, &s.entries);
            s.memory.0[0].with_mut(|p| unsafe { *p = 1 });
            publish(&mut w, b"a", 0)
        };
        assert_eq!(generation, 1);
        let r = s.clone();
        let reader = thread::spawn(move || {
            let dir = Directory::new(&r.entries);
            let mut holds = Holds::new(&r.slots, &r.hold_header.holding);
            if let Get::Held(h) = holds.get(&dir, b"a", 1).expect("get") {
                let tag = r.memory.0[h.snapshot.offset as usize].with(|p| unsafe { *p });
                assert_eq!(
                    tag, h.snapshot.generation,
                    "freed or reused memory accepted"
                );
                holds.release(h).expect("release");
            }
        });
        let mut retired = Retired::new();
        let mut w = DirectoryWriter::new(&s.header, &s.entries);
        w.unpublish(index, generation).expect("unpublish");
        let views = [HoldsView::new(&s.slots).counted(&s.hold_header.holding)];
        if is_held(views, generation) {
            retired.retire(generation, 0usize);
        } else {
            // Free and reuse at once: a new object (generation 2) in the same memory, under
            // the same name, in the same (only) entry.
            s.memory.0[0].with_mut(|p| unsafe { *p = 2 });
            let (i2, g2) = publish(&mut w, b"a", 0);
            assert_eq!((i2, g2), (index, 2));
        }
        reader.join().unwrap();
        // After the reader is done, a deferred free goes through.
        for cell in retired.collect(&views) {
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
        let (index, generation) = {
            let mut w = DirectoryWriter::new(&s.header, &s.entries);
            s.memory.0[0].with_mut(|p| unsafe { *p = 1 });
            publish(&mut w, b"a", 0)
        };
        let r = s.clone();
        let reader = thread::spawn(move || {
            let dir = Directory::new(&r.entries);
            let mut holds = Holds::new(&r.slots, &r.hold_header.holding);
            if let Get::Held(h) = holds.get(&dir, b"a", 1).expect("get") {
                let tag = r.memory.0[h.snapshot.offset as usize].with(|p| unsafe { *p });
                assert_eq!(tag, h.snapshot.generation, "freed or reused memory");
                holds.release(h).expect("release");
            }
        });
        let mut w = DirectoryWriter::new(&s.header, &s.entries);
        w.unpublish(index, generation).expect("unpublish");
        let mut retired = Retired::new();
        retired.retire(generation, 0usize);
        let views = [HoldsView::new(&s.slots).counted(&s.hold_header.holding)];
        let cell = loop {
            if let Some(c) = retired.collect(&views).pop() {
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
        let freed = loop {
            if revoker.revoke(1) {
                break true;
            }
            thread::yield_now();
        };
        if freed {
            // Retired and freed: the memory goes to another object of the same client.
            lend.memory.with_mut(|p| unsafe { *p = 99 });
        }
        client.join().unwrap();
    });
}
