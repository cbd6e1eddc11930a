//! What the store has done since it started and who holds what now: the numbers the daemon's
//! metrics report beside [`StoreStats`] (`Session::metrics`, one message to the object table).
//! Not on the wire: STATS stays as PROTOCOL.md has it; a METRICS reply carries these as text.
//!
//! Every counter only grows. Counts of objects come with their data bytes (what the clients
//! asked to store, not the 64-byte-rounded blocks).

use crate::{HolderId, StoreStats};

/// A count of events and the data bytes they concerned.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counted {
    pub count: u64,
    pub bytes: u64,
}

impl Counted {
    /// One more event of `bytes`.
    pub fn add(&mut self, bytes: u64) {
        self.count += 1;
        self.bytes = self.bytes.saturating_add(bytes);
    }
}

/// What the store did, ever.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreActivity {
    /// Objects sealed (a CREATE's SEAL, an inline PUT, a PUBLISH), replacements included.
    pub seals: Counted,
    /// Of the seals, those that made a name's next version (a replace).
    pub replaces: Counted,
    /// Objects deleted by name (DELETE).
    pub deletes: Counted,
    /// Names a get by message answered with an object (GET, GET_NEWER; each name once).
    pub socket_hits: Counted,
    /// Names a get by message answered without one (not sealed in time).
    pub socket_misses: u64,
    /// Gets served from the shared directory (no message): what clients' hold tables say,
    /// summed over every table the store has had (a departed client's last count is kept).
    pub shared_gets: Counted,
    /// Lends made (LEND), with their sizes.
    pub lends: Counted,
    /// Objects published from lends (PUBLISH, each item of PUBLISH_MANY).
    pub publishes: Counted,
}

/// What one holder (a connection, an embedded session) holds now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HolderUsage {
    pub holder: HolderId,
    /// References it holds, hold-table holds included (as STATS `references` counts them).
    pub references: u64,
    /// Data bytes of the distinct objects it holds.
    pub bytes: u64,
}

/// Everything the store reports for its metrics, read in one message.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreMetrics {
    /// What STATS says.
    pub stats: StoreStats,
    /// Host memory the store's segments may have backed by the kernel now: allocated blocks
    /// plus freed pages not yet given back (an upper bound, at most the capacity).
    pub resident_bytes: u64,
    /// Lends alive now (current ones, and retired ones objects still live in).
    pub live_lends: u64,
    pub activity: StoreActivity,
    /// Every holder that holds something, in no order.
    pub holders: Vec<HolderUsage>,
}
