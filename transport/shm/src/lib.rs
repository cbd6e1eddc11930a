//! vovp's shared object directory and per-client hold tables (issue 13), in memfd-backed
//! shared memory, with no sockets and no actors so that the daemon, the Rust client and the
//! Python native core can all use it. **Not yet wired into the daemon or the clients.**
//!
//! * [`directory`]: name → object location, written only by the store under per-entry
//!   seqlocks, read by clients through a read-only mapping.
//! * [`hold`]: each client's hold table (hazard pointers keyed on generations), the store's
//!   [`hold::is_held`] check and [`hold::Retired`] list for frees deferred while held.
//! * `region` (not under loom): creating and mapping the memfds, with header checks.
//!
//! The protocol and its correctness argument: the module docs of [`directory`] and [`hold`],
//! and ARCHITECTURE.md, "Shared directory and hold tables". Model-checked with loom:
//! `RUSTFLAGS="--cfg loom" cargo test -p vovp-shm --release --test loom`.

pub mod directory;
pub mod error;
pub mod hold;
pub mod layout;
#[cfg(not(loom))]
mod region;
mod sync;

pub use directory::{Directory, DirectoryWriter, Lookup, Publish, Snapshot};
pub use error::{Result, ShmError};
pub use hold::{is_held, Get, HeldSlot, Hold, Holds, HoldsView, Retired};
#[cfg(not(loom))]
pub use region::{DirectoryMap, DirectoryRegion, HoldMap, HoldRegion};

/// A monotonic access stamp in nanoseconds (vDSO clock read, no syscall), never 0.
#[cfg(not(loom))]
pub fn now_stamp() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    (t.tv_sec as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(t.tv_nsec as u64)
        .max(1)
}
