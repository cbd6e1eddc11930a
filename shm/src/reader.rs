//! A client's whole read side in one value: the directory mapped read-only and its own hold
//! table, behind a mutex so any thread of the client may get and release. What the Rust
//! client (and through it the Python one) and the embedded engine use.

use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, Once};

use crate::directory::Snapshot;
use crate::error::{Result, ShmError};
use crate::hold::{Get, Hold};
use crate::region::{DirectoryMap, HoldMap};

/// Forks of this process since the first reader was opened (bumped in the child).
static FORKS: AtomicU64 = AtomicU64::new(0);

extern "C" fn forked_child() {
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// What [`SharedReader::begin_lend_write`] answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LendWrite {
    /// Write, then end the write after PUBLISH's reply.
    Granted,
    /// The store took the lend back: write nothing into it; a new lend may be asked for.
    Revoked,
    /// This reader cannot announce writes (a forked child, a poisoned lock): put another way,
    /// and ask for no lend.
    Unusable,
}

/// The directory and one hold table, mapped.
#[derive(Debug)]
pub struct SharedReader {
    directory: DirectoryMap,
    holds: Mutex<HoldMap>,
    /// [`FORKS`] when opened. A forked child shares the parent's hold table (a `MAP_SHARED`
    /// mapping) but has a copy of its free-slot list: its holds would overwrite the parent's,
    /// and its releases clear them. So in a child the reader does nothing; gets go the socket
    /// way, as if nothing were published.
    forks: u64,
}

impl SharedReader {
    /// Maps the directory's (read-only) fd and the hold table's fd, checking both headers.
    pub fn open(directory: &File, holds: &File) -> Result<Self> {
        static AT_FORK: Once = Once::new();
        // SAFETY: registers a handler that only bumps an atomic (async-signal-safe).
        AT_FORK.call_once(|| unsafe {
            libc::pthread_atfork(None, None, Some(forked_child));
        });
        let holds = HoldMap::open(holds)?;
        // This client counts its puts into its lend (`begin_lend_write`): the store may lend.
        holds.lend_writers().declare();
        Ok(SharedReader {
            directory: DirectoryMap::open(directory)?,
            holds: Mutex::new(holds),
            forks: FORKS.load(Ordering::Relaxed),
        })
    }

    /// Whether this process is the one that opened the reader (not a forked child).
    fn ours(&self) -> bool {
        FORKS.load(Ordering::Relaxed) == self.forks
    }

    /// A validated hold on `name`: no syscall, no message. `None` when the store must answer
    /// instead (not published, an entry being rewritten, a full hold table).
    pub fn hold(&self, name: &str) -> Option<Hold> {
        if !self.ours() {
            return None;
        }
        let mut holds = self.holds.lock().ok()?;
        let dir = self.directory.reader();
        let stamp = crate::now_stamp();
        match holds.with_holds(|h| h.get(&dir, name.as_bytes(), stamp)) {
            Ok(Get::Held(hold)) => {
                // For the store's metrics: gets with no message are counted by their client.
                holds.count_shared_get(hold.snapshot.size);
                Some(hold)
            }
            Ok(Get::Missing | Get::Busy) | Err(_) => None,
        }
    }

    /// Clears the hold on `snapshot` in `slot` (the object may be freed from then on).
    pub fn release(&self, slot: usize, snapshot: Snapshot) -> Result<()> {
        let not_held = || ShmError::NotHeld {
            slot,
            generation: snapshot.generation,
        };
        if !self.ours() {
            // The parent's hold, not ours to clear.
            return Err(not_held());
        }
        let mut holds = self.holds.lock().map_err(|_| not_held())?;
        holds.with_holds(|h| h.release(Hold { slot, snapshot }))
    }

    /// Whether this process may announce puts into a lend (not a forked child of the one that
    /// opened the reader: the child shares the parent's connection and hold table, and a LEND
    /// it sent would retire the lend the parent may be writing into).
    pub fn can_announce(&self) -> bool {
        self.ours()
    }

    /// Whether `name` is published now: a hit is authoritative for "the name is taken" (as of
    /// the lookup), a miss is not (ask the store).
    pub fn is_published(&self, name: &str) -> bool {
        self.ours()
            && matches!(
                self.directory.reader().lookup(name.as_bytes()),
                crate::directory::Lookup::Found(_)
            )
    }

    /// Counts a put about to be sent without waiting for its reply ([`crate::sent`]); `false`
    /// (nothing counted) in a forked child or on a poisoned lock: send it the waiting way.
    pub fn count_sent_put(&self) -> bool {
        if !self.ours() {
            return false;
        }
        match self.holds.lock() {
            Ok(holds) => {
                holds.sent_puts().count();
                true
            }
            Err(_) => false,
        }
    }

    /// Announces a put about to write into lend `lend` ([`crate::lend`]). Only
    /// [`LendWrite::Granted`] lets it write (and then [`SharedReader::end_lend_write`] must
    /// follow).
    pub fn begin_lend_write(&self, lend: u64) -> LendWrite {
        if !self.ours() {
            return LendWrite::Unusable;
        }
        match self.holds.lock() {
            Ok(holds) if holds.lend_writers().begin(lend) => LendWrite::Granted,
            Ok(_) => LendWrite::Revoked,
            Err(_) => LendWrite::Unusable,
        }
    }

    /// Ends a put that [`SharedReader::begin_lend_write`] let write (after its PUBLISH's reply,
    /// or when it gave up).
    pub fn end_lend_write(&self) {
        if !self.ours() {
            return;
        }
        // A poisoned lock still guards a valid mapping; the count must come down.
        let holds = self.holds.lock().unwrap_or_else(|p| p.into_inner());
        holds.lend_writers().end();
    }
}
