//! A client's whole read side in one value: the directory mapped read-only and its own hold
//! table, behind a mutex so any thread of the client may get and release. What the Rust
//! client (and through it the Python one) and the embedded engine use.

use std::fs::File;
use std::sync::Mutex;

use crate::directory::Snapshot;
use crate::error::{Result, ShmError};
use crate::hold::{Get, Hold};
use crate::region::{DirectoryMap, HoldMap};

/// The directory and one hold table, mapped.
pub struct SharedReader {
    directory: DirectoryMap,
    holds: Mutex<HoldMap>,
}

impl SharedReader {
    /// Maps the directory's (read-only) fd and the hold table's fd, checking both headers.
    pub fn open(directory: &File, holds: &File) -> Result<Self> {
        Ok(SharedReader {
            directory: DirectoryMap::open(directory)?,
            holds: Mutex::new(HoldMap::open(holds)?),
        })
    }

    /// A validated hold on `name`: no syscall, no message. `None` when the store must answer
    /// instead (not published, an entry being rewritten, a full hold table).
    pub fn hold(&self, name: &str) -> Option<Hold> {
        let mut holds = self.holds.lock().ok()?;
        let dir = self.directory.reader();
        let stamp = crate::now_stamp();
        match holds.with_holds(|h| h.get(&dir, name.as_bytes(), stamp)) {
            Ok(Get::Held(hold)) => Some(hold),
            Ok(Get::Missing | Get::Busy) | Err(_) => None,
        }
    }

    /// Clears the hold on `snapshot` in `slot` (the object may be freed from then on).
    pub fn release(&self, slot: usize, snapshot: Snapshot) -> Result<()> {
        let mut holds = self.holds.lock().map_err(|_| ShmError::NotHeld {
            slot,
            generation: snapshot.generation,
        })?;
        holds.with_holds(|h| h.release(Hold { slot, snapshot }))
    }
}
