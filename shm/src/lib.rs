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
//! ARCHITECTURE.md, "Shared directory and hold tables", has the protocol in full.

#![warn(unreachable_pub, missing_debug_implementations)]
// Offsets and lengths in shared memory are another process's words: a silent truncation is
// a wrong address. (Tests build their data with casts at will.)
#![cfg_attr(not(test), warn(clippy::cast_possible_truncation))]
#![cfg_attr(not(test), warn(clippy::cast_sign_loss))]
#![cfg_attr(not(test), warn(clippy::cast_possible_wrap))]

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
