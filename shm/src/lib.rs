//! vovp's shared object directory and per-client hold tables (issue 13), in memfd-backed
//! shared memory, with no sockets and no actors so that the daemon, the Rust client (and
//! through it the Python native core) and the embedded engine all use the same code.
//!
//! * [`directory`]: name → object location, written only by the store under per-entry
//!   seqlocks, read by clients through a read-only mapping.
//! * [`hold`]: each client's hold table (hazard pointers keyed on generations), the store's
//!   [`hold::is_held`] check and [`hold::held_generations`] for frees deferred while held.
//! * [`lend`]: the handshake over two hold-table header words by which the store takes back a
//!   lend no put is writing into.
//! * [`copy`]: host copies into shared memory, split across a rayon pool above 1 MB.
//! * [`content_hash`]: 64-bit content hashes of tensors, computed in the copy's pass.
//! * [`fdpass`]: passing the memfds over the Unix socket (SCM_RIGHTS).
//! * [`held`]: views got through the hold table (the engine's and the clients' one read path).
//! * [`put`]: create, copy, seal (the engine's and the clients' one put of large objects).
//! * `region` (not under loom): creating and mapping the memfds, with header checks. The
//!   directory's memfd is sealed `F_SEAL_FUTURE_WRITE` once the store has mapped it, so the
//!   read-only fd clients get cannot be turned into a writable mapping, not even by reopening
//!   `/proc/self/fd/N`.
//!
//! # Byte layouts
//!
//! Written once, in [`layout`]: the tables of the directory header, entry, hold-table header
//! and hold slot, beside the structs they describe and the test that pins them.
//!
//! # Why a reader never sees freed memory
//!
//! A get stores the snapshot's generation into a hold slot, runs `fence(SeqCst)`, and reloads
//! the entry's `seq`; it uses the object only if `seq` is unchanged. The store, before freeing
//! or reusing an object's memory, unpublishes it (a seqlocked write: `seq` moves on), runs
//! `fence(SeqCst)`, and scans every live table for the generation. The two fences are totally
//! ordered: if the store's is first, the reader's reload sees the new `seq` and the reader
//! never touches the object; if the reader's is first, the store's scan sees the hold (or its
//! `Release` clear, which makes the reader's reads happen before the free), so the store
//! defers. Generations are never reused, so a stale hold pins nothing newer and a stale
//! snapshot never validates. The loom models (`tests/loom.rs`) check this exhaustively within
//! a preemption bound: `RUSTFLAGS="--cfg loom" cargo test -p vovp-shm --release --test loom`.
//!
//! # Who does what
//!
//! * *Publish* (the store's object table at seal, and again when a parked object is let go):
//!   a sealed, named, non-ephemeral **host** object gets a directory entry (name, object id, a
//!   new generation, segment, offset, size, where its metadata is). The store writes the
//!   metadata into the object's own block at create, after the data padded to 64 bytes, so a
//!   reader finds it in shared memory. CUDA, unsealed and ephemeral objects are never
//!   published (an ephemeral object must go at its last release, which the store only sees
//!   over the socket). A full directory just leaves an object unpublished.
//! * *Attach* (SHARED, right after HELLO; `Session::attach_shared` for the embedded engine):
//!   the store creates the holder's hold table (4096 slots, 128 KiB) and hands out its
//!   read-write fd and the directory's read-only fd. The daemon's `--no-shared-reads`
//!   answers "not published" (every get is then a message); a client opts out alone with
//!   `ClientOptions::no_shared_reads` (Python `shared_reads=False`).
//! * *Get* (client, no system call): [`held`]. The object's segment must already be mapped
//!   here (segment 0 always is; another client's arena while a view into it lives, and the
//!   client keeps the last few it mapped); the metadata is copied out of the held block. A
//!   view got this way keeps its client's connection open while it lives, like one got over
//!   the socket, because the store honours a hold table only while its connection is open.
//!   Names this path cannot serve (missing, unsealed, busy, a full table, an unmapped
//!   segment) go in one GET, which waits as GET always does.
//! * *Free, reuse, evict* (store): unpublish, `fence(SeqCst)`, then scan the live tables
//!   ([`hold::is_held`]). A deleted object that only holds name is *parked* (the name is free
//!   at once); eviction skips held objects, and a victim a client took a hold on between the
//!   first look and the unpublish is parked instead and the next one tried. Parked objects
//!   are collected ([`hold::held_generations`]) every 5 ms while any is parked, when a create
//!   is short of memory and when a holder goes: the unheld deleted ones are freed, the unheld
//!   named ones re-published (a new generation) and put back in the LRU.
//! * *Counting*: STATS' `references` and LIST's `refcount` include holds (a scan of the
//!   tables), STATS' `shared_holds` counts them alone, `holders` counts holders of either kind.
//! * *LRU*: each slot keeps the access stamp (monotonic ns) of its last get after release,
//!   and slots are reused first-in first-out, so the stamps of a client's last 4096 gets
//!   survive; before evicting, the store moves every object whose stamp is newer than its LRU
//!   position to that stamp (a client's stamp capped at the store's clock).
//! * *A dead client*: its table leaves the scans first, then what it alone held is collected.
//!
//! # The `holding` count
//!
//! Why a free does not read every slot of every client: each table's header carries the
//! number of its slots in use, written only by its client (plain stores, no
//! read-modify-write: no locked instruction per get). A get stores the raised count
//! (`Relaxed`) right after the slot, before its fence; a release (or a rejected hold) stores
//! the lowered count with `Release` after clearing the slot. The store loads it (`Acquire`)
//! after its fence and skips the table's slots when it is 0, as idle clients' are. Safe by
//! the fences' argument above: if the reader's fence comes first the store sees the raised
//! count; every store of 0 is a `Release` after the slots' clears, which the store's `Acquire`
//! synchronises with. A client that under-counts only loses the protection of its own holds.
//! Measured: a Python delete with 16 idle clients connected went from 136 µs to ~50 µs
//! (benches/FINDINGS.md, finding 13).
//!
//! # Limits, by design
//!
//! A client that closes its socket but keeps running keeps reading what it held, now unpinned:
//! its own use-after-free, as with a buffer kept after ABORT. A same-uid client can write its
//! own hold table at will; the store only ever asks "is this generation held", so a bogus slot
//! can pin what it names (a GET can too), never free anything, and a wrong `holding` count only
//! exposes the client's own holds. Holds of CUDA objects go over the socket.
//!
//! # Tests
//!
//! `cargo test -p vovp-shm`: unit tests of the directory and hold tables (threaded torn-read and
//! freed-memory stress included), region tests (header checks; no writable mapping of the
//! directory fd, even after a `/proc` reopen) and a cross-process test (a child holding an
//! object dies; a child writing the directory dies of SIGSEGV). The loom models above call the
//! functions the store itself calls; removing the get's `SeqCst` fence fails them at once.
//! Wired in: `tests/tests/shared_reads.rs` (real daemon, clients in other processes: no request
//! per get yet counted in STATS and `list`, delete while held, a SIGKILLed holder, eviction
//! sparing held objects, the opt-outs, the async client, and a 12 s stress of readers checking
//! checksums while writers delete, re-put and evict and a reader is SIGKILLed every 300 ms),
//! `engine/tests/lifecycle.rs` and `python/tests/test_shared_reads.py`.

#![warn(unreachable_pub, missing_debug_implementations)]
// Offsets and lengths in shared memory are another process's words: a silent truncation is
// a wrong address. (Tests build their data with casts at will.)
#![cfg_attr(not(test), warn(clippy::cast_possible_truncation))]
#![cfg_attr(not(test), warn(clippy::cast_sign_loss))]
#![cfg_attr(not(test), warn(clippy::cast_possible_wrap))]

#[cfg(not(loom))]
pub mod content_hash;
#[cfg(not(loom))]
pub mod copy;
pub mod directory;
pub mod error;
#[cfg(not(loom))]
pub mod fdpass;
#[cfg(not(loom))]
pub mod held;
pub mod hold;
pub mod layout;
pub mod lend;
#[cfg(not(loom))]
pub mod put;
#[cfg(not(loom))]
mod reader;
#[cfg(not(loom))]
mod region;
pub mod sent;
mod sync;

pub use directory::{Directory, DirectoryWriter, Lookup, Publish, Snapshot};
pub use error::{Result, ShmError};
pub use hold::{held_generations, is_held, Get, HeldSlot, Hold, Holds, HoldsView};
pub use lend::{LendRevoker, LendWriters};
#[cfg(not(loom))]
pub use reader::{LendWrite, SharedReader};
#[cfg(not(loom))]
pub use region::{DirectoryMap, DirectoryRegion, HoldMap, HoldRegion};
pub use sent::SentPuts;

/// A monotonic access stamp in nanoseconds (vDSO clock read, no syscall), never 0.
#[cfg(not(loom))]
pub fn now_stamp() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    (t.tv_sec.cast_unsigned())
        .wrapping_mul(1_000_000_000)
        .wrapping_add(t.tv_nsec.cast_unsigned())
        .max(1)
}

// Offsets into the shared regions are u64 on the wire and in the layouts; this process addresses
// them as usize, which must not lose bits.
#[cfg(not(target_pointer_width = "64"))]
compile_error!("vovp addresses shared memory by 64-bit offsets: 64-bit targets only");

/// A u64 offset, length or count as this (64-bit) process's `usize`: lossless.
#[allow(clippy::cast_possible_truncation)]
pub(crate) fn to_usize(v: u64) -> usize {
    v as usize
}

/// The low half of a packed word (`segment | name_len << 32`, `LAYOUT_VERSION | size << 32`).
#[allow(clippy::cast_possible_truncation)]
pub(crate) fn low32(word: u64) -> u32 {
    (word & 0xFFFF_FFFF) as u32
}
