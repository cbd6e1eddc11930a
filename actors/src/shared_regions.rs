//! The store's side of the shared object directory and the clients' hold tables (vovp-shm):
//! what the object table publishes on seal and takes back before freeing, and the scans that
//! tell it whether any client still holds an object through its table. Kept apart from the
//! table so its life-cycle code reads the same with the directory on or off.
//!
//! Gets through the directory send no message, so the store learns of them from the clients:
//! each hold table's header counts its client's gets and their bytes (vovp-shm's
//! `shared_gets`, bumped by the client's reader). [`SharedRegions::shared_gets`] adds them up
//! into a total that never goes down: it remembers the count each table had when last read and
//! adds only what grew since, and a departing table's growth is added before it goes. The
//! counts are the clients' word: a client can inflate them, never lower the total.

use std::collections::{HashMap, HashSet};
use std::fs::File;

use vovp_shm::{DirectoryRegion, HoldRegion, HoldsView, Publish};

use vovp_types::HolderId;
use vovp_types::{Counted, Error};

/// Sizes of the shared directory and of each client's hold table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedConfig {
    /// Directory entries (a power of two). Objects beyond what fits are simply not published:
    /// gets of them take the socket path.
    pub directory_entries: usize,
    /// Hold slots per client (a power of two): the objects one client can hold at once
    /// through its table; more holds take the socket path.
    pub hold_slots: usize,
}

impl SharedConfig {
    /// A directory of one entry per 4 KiB of store (at most twice the object limit), within
    /// 2^10..2^16 entries: 384 KiB to 24 MiB, which is also what it can cost resident (entries
    /// are spread by hash, so a few live objects touch as many pages). A store of many more
    /// small objects than that publishes only the first three quarters' worth; the rest are
    /// got over the socket.
    pub fn for_store(capacity: u64, max_objects: u64) -> Self {
        let entries = (capacity / 4096)
            .min(max_objects.saturating_mul(2))
            .clamp(1 << 10, 1 << 16)
            .next_power_of_two() as usize;
        SharedConfig {
            directory_entries: entries,
            hold_slots: 4096,
        }
    }
}

/// Where a published object is in the directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Published {
    pub index: usize,
    pub generation: u64,
}

/// What a client gets to map: the directory (read-only fd) and its own hold table.
#[derive(Debug)]
pub struct SharedFds {
    pub directory: File,
    pub holds: File,
    pub hold_slots: usize,
}

/// The directory and the live clients' hold tables (vovp-shm's regions, from the store's side).
pub(crate) struct SharedRegions {
    directory: DirectoryRegion,
    tables: HashMap<HolderId, HoldRegion>,
    hold_slots: usize,
    /// The directory gets of every table the store has had (see the module doc).
    gets: GetsTotal,
}

/// The shared-directory gets added up over hold tables, monotonically.
#[derive(Default)]
struct GetsTotal {
    total: Counted,
    /// Per live table: its (gets, bytes) when last read.
    last: HashMap<HolderId, (u64, u64)>,
}

impl GetsTotal {
    /// Adds what `holder`'s table counted since it was last read: (gets, bytes) now.
    fn fold(&mut self, holder: HolderId, now: (u64, u64)) {
        let last = self.last.entry(holder).or_default();
        // A count that went down was rewritten by its client: it counts again from there.
        self.total.count = self
            .total
            .count
            .saturating_add(now.0.saturating_sub(last.0));
        self.total.bytes = self
            .total
            .bytes
            .saturating_add(now.1.saturating_sub(last.1));
        *last = now;
    }
}

impl SharedRegions {
    pub(crate) fn new(config: SharedConfig) -> Result<Self, Error> {
        let directory = DirectoryRegion::create(config.directory_entries)
            .map_err(|e| Error::Memory(format!("creating the shared directory: {e}")))?;
        Ok(SharedRegions {
            directory,
            tables: HashMap::new(),
            hold_slots: config.hold_slots,
            gets: GetsTotal::default(),
        })
    }

    /// Gives `holder` a hold table (a second ask gives the same one) and the fds to map.
    pub(crate) fn attach(&mut self, holder: HolderId) -> Result<SharedFds, Error> {
        let table = match self.tables.entry(holder) {
            std::collections::hash_map::Entry::Occupied(t) => t.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => v.insert(
                HoldRegion::create(self.hold_slots, holder.get())
                    .map_err(|e| Error::Memory(format!("creating a hold table: {e}")))?,
            ),
        };
        let dup = |f: &File, what: &str| {
            f.try_clone()
                .map_err(|e| Error::Memory(format!("duplicating the {what} fd: {e}")))
        };
        Ok(SharedFds {
            directory: dup(self.directory.read_only_fd(), "directory")?,
            holds: dup(table.fd(), "hold table")?,
            hold_slots: table.slots(),
        })
    }

    /// Whether `holder` has mapped its hold table and declared that it counts its puts into
    /// its lend there (vovp-shm's `lend` handshake): only such a client may be lent memory.
    pub(crate) fn takes_part_in_lends(&self, holder: HolderId) -> bool {
        self.tables
            .get(&holder)
            .is_some_and(|t| t.lend_revoker().client_takes_part())
    }

    /// Marks `holder`'s lend `lend` taken back; `true` when no put of it writes into the lend,
    /// so it may be retired now (vovp-shm's `lend` handshake). `false` without a hold table.
    pub(crate) fn revoke_lend(&self, holder: HolderId, lend: u64) -> bool {
        self.tables
            .get(&holder)
            .is_some_and(|t| t.lend_revoker().revoke(lend))
    }

    /// Clears `holder`'s revocation mark: it asked for a new lend, so it writes into none.
    pub(crate) fn clear_lend_revocation(&self, holder: HolderId) {
        if let Some(t) = self.tables.get(&holder) {
            t.lend_revoker().clear();
        }
    }

    /// (holder, pipelined puts it says it sent) of every table with a nonzero count
    /// (vovp-shm's `sent`).
    pub(crate) fn puts_sent(&self) -> Vec<(HolderId, u64)> {
        self.tables
            .iter()
            .map(|(h, t)| (*h, t.puts_sent()))
            .filter(|&(_, n)| n > 0)
            .collect()
    }

    /// The holder is gone: its holds no longer pin anything (its gets stay counted).
    pub(crate) fn detach(&mut self, holder: HolderId) -> bool {
        let Some(table) = self.tables.remove(&holder) else {
            return false;
        };
        self.gets.fold(holder, table.shared_gets());
        self.gets.last.remove(&holder);
        true
    }

    /// Gets served from the directory, ever, with their data bytes: every table's count added
    /// up, departed ones' included (see the module doc).
    pub(crate) fn shared_gets(&mut self) -> Counted {
        for (holder, table) in &self.tables {
            self.gets.fold(*holder, table.shared_gets());
        }
        self.gets.total
    }

    /// Publishes a sealed host object; `None` when it cannot be (directory full): its gets then
    /// take the socket path, which is always correct.
    pub(crate) fn publish(&mut self, p: &Publish<'_>) -> Option<Published> {
        let most = self.directory.capacity() / 4 * 3;
        let mut writer = self.directory.writer();
        // Three quarters full at most: linear probing stays short (and a full table would
        // make every publish scan all of it).
        if writer.live() >= most {
            return None;
        }
        match writer.publish(p) {
            Ok((index, generation)) => Some(Published { index, generation }),
            Err(e) => {
                tracing::debug!("not published in the shared directory: {e}");
                None
            }
        }
    }

    /// Takes an object out of the directory: no new hold on it can validate after this.
    pub(crate) fn unpublish(&mut self, p: Published) {
        if let Err(e) = self.directory.writer().unpublish(p.index, p.generation) {
            // Only a table bug gets here: the table unpublishes each publication once.
            tracing::error!("shared directory out of step with the table: {e}");
        }
    }

    /// Whether any client's table names `generation`. The caller unpublished it first;
    /// `vovp_shm::is_held` (the code the loom models check) fences, then scans.
    pub(crate) fn is_held(&self, generation: u64) -> bool {
        vovp_shm::is_held(self.views(), generation)
    }

    /// Every generation some table names now: `vovp_shm::held_generations` (fence, then
    /// scan; the code the loom models check).
    pub(crate) fn held(&self) -> HashSet<u64> {
        vovp_shm::held_generations(self.views())
    }

    /// Holds per generation (STATS, `list`). A snapshot.
    pub(crate) fn hold_counts(&self) -> HashMap<u64, u32> {
        let mut counts = HashMap::new();
        for s in self.views().flat_map(|v| v.scan()) {
            *counts.entry(s.generation).or_insert(0) += 1;
        }
        counts
    }

    /// Per holder with a hold table, the generations its holds name now (a snapshot).
    pub(crate) fn holds_by_holder(&self) -> Vec<(HolderId, Vec<u64>)> {
        self.tables
            .iter()
            .map(|(h, t)| {
                (
                    *h,
                    t.view().scan().map(|s| s.generation).collect::<Vec<_>>(),
                )
            })
            .filter(|(_, held)| !held.is_empty())
            .collect()
    }

    /// Holders with at least one hold now.
    pub(crate) fn holders_holding(&self) -> HashSet<HolderId> {
        self.tables
            .iter()
            .filter(|(_, t)| t.view().scan().next().is_some())
            .map(|(h, _)| *h)
            .collect()
    }

    /// (object id, access stamp) of every slot's last get, held or released (the LRU fold).
    pub(crate) fn stamps(&self) -> Vec<(u64, u64)> {
        self.views().flat_map(|v| v.stamps()).collect()
    }

    fn views(&self) -> impl Iterator<Item = HoldsView<'_>> {
        self.tables.values().map(HoldRegion::view)
    }
}
