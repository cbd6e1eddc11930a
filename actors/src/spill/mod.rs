//! Spilling: when memory is needed and an unreferenced sealed host object would be evicted,
//! its bytes go to a file in the spill directory instead, and the next get reads them back.
//! Off unless the store is given a directory (`--spill-dir`, [`SpillConfig`]).
//!
//! An object's states (the table's [`crate::table::Residency`]): *resident* → *spilling* (its
//! block still holds the bytes while the file is written; a get meanwhile is answered from
//! memory, and the spill is then abandoned: the file goes, the object stays) → *spilled* (on
//! disk only: listed as spilled, not in the shared directory, its memory given back) →
//! *restoring* (a new block allocated, the file being read into it; gets wait, and one read
//! serves them all) → resident. The file stays after a restore (and after a spill abandoned
//! because of a get): the object is sealed, so the next time it is a victim it is on disk only
//! at once, with no write. A delete, replace or eviction of an object removes its file. Ephemeral objects are never spilled (they never wait unreferenced), nor CUDA ones
//! (their victims are evicted as before).
//!
//! Who does what:
//! - [`file`]: the file format and its checks (header checksum, the object's identity, the
//!   data's CRC-32C): a damaged, truncated, swapped or missing file is a typed error naming the
//!   object ([`vovp_types::Error::SpillDamaged`]), never wrong bytes;
//! - [`dir`]: the directory at start (locked against a second daemon, cleaned; why cleaned and
//!   not restored is there);
//! - [`worker`]: the IO thread (io_uring, `O_DIRECT`, several IOs in flight): no actor waits
//!   on a disk;
//! - [`index`]: which objects have files, and the bounds (`--spill-max`, the object limit);
//! - [`Spill`] (here): the above as the table actor uses them, and the counters STATS reports.
//!
//! The table actor's side (`table_actor/spilling.rs`) decides when: a create (or a restore)
//! short of memory spills LRU victims instead of evicting them and waits, without holding up
//! the actor's other messages, until their writes land and free the memory; past
//! `--spill-max`, or when a write fails (the disk full), the victim is evicted as without
//! spilling, counted in `spill_failures` and logged, so the create succeeds as it would have.
//! Memory stays within `-m` throughout: a spilling object keeps its block until its file is
//! written, and a restore allocates its block (spilling others if need be) before reading.

mod dir;
pub(crate) mod file;
mod index;
pub(crate) mod worker;

use std::path::PathBuf;

use vovp_types::{Error, StoreStats};

use crate::table::SpillChoice;

use dir::SpillDir;
use index::SpillIndex;
use worker::{Job, Sink, Worker};

pub(crate) use file::Header;
pub(crate) use worker::{Done, Memory};

/// Where and how much to spill.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpillConfig {
    /// The directory spill files go to (created if missing, cleaned at start, one daemon
    /// each).
    pub dir: PathBuf,
    /// Most bytes of spill files (`--spill-max`; `None`: as much as the disk takes). Past it,
    /// victims are evicted.
    pub max_bytes: Option<u64>,
}

/// What the store spilled and restored, ever (STATS).
#[derive(Debug, Default)]
struct Counters {
    spills: u64,
    spill_bytes: u64,
    restores: u64,
    restore_bytes: u64,
    spill_failures: u64,
    restore_failures: u64,
}

/// Spilling as the table actor uses it.
#[derive(Debug)]
pub(crate) struct Spill {
    /// The directory, held here until the worker starts (it then holds it).
    dir: Option<SpillDir>,
    path: PathBuf,
    worker: Option<Worker>,
    max_bytes: u64,
    max_objects: usize,
    index: SpillIndex,
    counters: Counters,
    /// Fallbacks to eviction logged so far (the first ones are logged, then every 1000th).
    logged_fallbacks: u64,
}

impl Spill {
    /// Takes the directory (locked, cleaned). `max_objects`: most spill files at once (the
    /// store's object limit: every spilled object keeps its table entry).
    pub(crate) fn open(config: &SpillConfig, max_objects: usize) -> Result<Spill, Error> {
        let (dir, removed) = SpillDir::open(&config.dir)?;
        if removed > 0 {
            tracing::info!(
                "--spill-dir {}: removed {removed} spill files a previous daemon left (a \
                 restarted store starts empty)",
                config.dir.display()
            );
        }
        Ok(Spill {
            dir: Some(dir),
            path: config.dir.clone(),
            worker: None,
            max_bytes: config.max_bytes.unwrap_or(u64::MAX),
            max_objects,
            index: SpillIndex::default(),
            counters: Counters::default(),
            logged_fallbacks: 0,
        })
    }

    /// Starts the IO worker with `sink` for its completions, if it is not running yet.
    pub(crate) fn start(&mut self, sink: impl FnOnce() -> Sink) -> Result<(), Error> {
        if self.worker.is_some() {
            return Ok(());
        }
        let Some(dir) = self.dir.take() else {
            return Err(Error::Internal("the spill worker stopped".into()));
        };
        let worker = Worker::start(dir, sink())
            .map_err(|e| Error::Internal(format!("cannot start the spill worker: {e}")))?;
        self.worker = Some(worker);
        Ok(())
    }

    /// What becomes of a victim of `size` data bytes whose block is charged `frees`: on disk
    /// only at once when its file from an earlier spill is still there; else a file is
    /// reserved for it; else (`--spill-max` or the object bound reached) it is evicted,
    /// counted and logged here.
    pub(crate) fn choose(&mut self, id: u64, name: &str, size: u64, frees: u64) -> SpillChoice {
        if self.index.file(id).is_some() {
            self.index.set_resident(id, false);
            return SpillChoice::OnDisk;
        }
        if self
            .index
            .admit(id, size, frees, self.max_bytes, self.max_objects)
        {
            return SpillChoice::Write;
        }
        self.fallback(name, "--spill-max is reached");
        SpillChoice::Evict
    }

    /// Whether object `id` has a complete file (on disk only, or kept after a restore).
    pub(crate) fn has_file(&self, id: u64) -> bool {
        self.index.file(id).is_some()
    }

    /// A victim evicted although spilling is on: counted, and logged (sparingly).
    pub(crate) fn fallback(&mut self, name: &str, why: &str) {
        self.counters.spill_failures += 1;
        if self.logged_fallbacks < 10 || self.counters.spill_failures.is_multiple_of(1000) {
            tracing::warn!(
                "evicting {name:?} instead of spilling it: {why} (spill failures so far: {}; \
                 spill directory {})",
                self.counters.spill_failures,
                self.path.display()
            );
        }
        self.logged_fallbacks += 1;
    }

    /// Starts writing an admitted victim's file from `src` (its block).
    pub(crate) fn write(&mut self, header: Header, src: Memory) -> bool {
        self.submit(Job::Write { header, src })
    }

    /// The write of `id` ended (`kept`, with the data's CRC-32C: the file holds the object,
    /// which is on disk only, or `resident` too when it was used meanwhile; else its file is
    /// gone or about to be removed).
    pub(crate) fn written(&mut self, id: u64, kept: Option<u32>, resident: bool) {
        if let Some(w) = self.index.written(id, kept, resident) {
            if kept.is_some() {
                self.counters.spills += 1;
                self.counters.spill_bytes += w.size;
            }
        }
    }

    /// Starts reading the file of `id` (of `name`, `version`) back into `dst` (its new
    /// block): `false` when it has no file or the worker is gone.
    pub(crate) fn read(&mut self, id: u64, name: &str, version: u64, dst: Memory) -> bool {
        let Some((size, crc)) = self.index.file(id) else {
            return false;
        };
        self.index.reading(id);
        let expect = Header {
            id,
            size,
            version,
            name: name.to_owned(),
            crc,
        };
        self.submit(Job::Read { expect, dst })
    }

    /// The read of `id` ended: `restored` (counted; the file stays, see [`index`]), or the
    /// file was damaged (counted; it goes).
    pub(crate) fn read_done(&mut self, id: u64, restored: bool) {
        self.index.read_done(id, restored);
        match (restored, self.index.file(id)) {
            (true, Some((size, _))) => {
                self.counters.restores += 1;
                self.counters.restore_bytes += size;
            }
            (true, None) => {}
            (false, _) => {
                self.counters.restore_failures += 1;
                self.remove(id);
            }
        }
    }

    /// The read of `id` ended after the object went: its file goes, nothing is counted.
    pub(crate) fn read_abandoned(&mut self, id: u64) {
        self.index.read_done(id, false);
        self.remove(id);
    }

    /// Removes the file of `id`, if it has one or one is being written (the object is gone,
    /// or back in memory).
    pub(crate) fn remove(&mut self, id: u64) {
        self.index.forget(id);
        self.submit(Job::Remove { id });
    }

    /// Whether an IO of `id` is in flight: its memory must not be freed before it reports.
    pub(crate) fn in_flight(&self, id: u64) -> bool {
        self.index.in_flight(id)
    }

    /// Memory the writes in flight free when they complete.
    pub(crate) fn freeing(&self) -> u64 {
        self.index.freeing()
    }

    fn submit(&self, job: Job) -> bool {
        self.worker.as_ref().is_some_and(|w| w.submit(job))
    }

    /// Fills the spill fields of STATS.
    pub(crate) fn fill_stats(&self, s: &mut StoreStats) {
        let c = &self.counters;
        (s.spilled_objects, s.spilled_bytes) = self.index.spilled();
        s.spills = c.spills;
        s.spill_bytes = c.spill_bytes;
        s.restores = c.restores;
        s.restore_bytes = c.restore_bytes;
        s.spill_failures = c.spill_failures;
        s.restore_failures = c.restore_failures;
    }

    /// The index's invariants (tests).
    pub(crate) fn check(&self) -> Result<(), String> {
        self.index.check()
    }
}
