//! The spilled-object index: which objects have a file (complete, or being written or read),
//! what the files take of `--spill-max`, and the memory the writes in flight will free.
//! Plain data, no IO: the table actor asks it before starting a spill ([`SpillIndex::admit`])
//! and tells it what each IO did.
//!
//! A complete file stays after its object is read back (*resident with a file*): the object is
//! sealed and so unchanged, and the next time it is a victim it goes to disk only at once,
//! without writing it again (as Ray keeps a restored object's spilled copy). Only a delete,
//! replace or eviction of the object removes its file.
//!
//! Invariants (checked by [`SpillIndex::check`]): `disk_bytes` is the sum of the file lengths
//! of every file (complete or being written); `data_bytes` the sum of the data sizes of the
//! complete files of objects on disk only; `freeing` the sum of the memory the writes in
//! flight free when they complete; an object is being written or has a complete file, never
//! both; an object being read has a complete file.

use std::collections::{HashMap, HashSet};

use super::file::file_len;

/// A complete file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct File {
    size: u64,
    /// The data's CRC-32C.
    crc: u32,
    /// Its object is in memory too (read back, or used while its file was written).
    resident: bool,
}

/// A spill in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Writing {
    pub size: u64,
    /// Memory its completion frees (the object's block's charge).
    pub frees: u64,
}

#[derive(Debug, Default)]
pub(crate) struct SpillIndex {
    /// Complete files: object id → what it holds.
    files: HashMap<u64, File>,
    writing: HashMap<u64, Writing>,
    /// Objects whose file is being read back (they have a complete file too).
    reading: HashSet<u64>,
    disk_bytes: u64,
    data_bytes: u64,
    freeing: u64,
}

impl SpillIndex {
    /// Reserves a file for object `id` of `size` data bytes, if the files stay within
    /// `max_bytes` and `max_objects`: `false` (nothing reserved) when they would not.
    pub(crate) fn admit(
        &mut self,
        id: u64,
        size: u64,
        frees: u64,
        max_bytes: u64,
        max_objects: usize,
    ) -> bool {
        let len = file_len(size);
        let fits = self
            .disk_bytes
            .checked_add(len)
            .is_some_and(|total| total <= max_bytes)
            && self.files.len() + self.writing.len() < max_objects;
        if !fits || self.writing.contains_key(&id) || self.files.contains_key(&id) {
            return false;
        }
        self.disk_bytes += len;
        self.freeing += frees;
        self.writing.insert(id, Writing { size, frees });
        true
    }

    /// The write of `id` ended; with `kept` (the data's CRC-32C), its file now holds the
    /// object (else it is gone, or about to be, and its reservation is returned), which is
    /// `resident` too when it was used meanwhile. What the write was, if it was one.
    pub(crate) fn written(
        &mut self,
        id: u64,
        kept: Option<u32>,
        resident: bool,
    ) -> Option<Writing> {
        let w = self.writing.remove(&id)?;
        self.freeing -= w.frees;
        if let Some(crc) = kept {
            self.files.insert(
                id,
                File {
                    size: w.size,
                    crc,
                    resident,
                },
            );
            if !resident {
                self.data_bytes += w.size;
            }
        } else {
            self.disk_bytes -= file_len(w.size);
        }
        Some(w)
    }

    /// The object's file is being read back.
    pub(crate) fn reading(&mut self, id: u64) {
        if self.files.contains_key(&id) {
            self.reading.insert(id);
        }
    }

    /// The read of `id` ended (`restored`: its object is in memory again, its file kept).
    pub(crate) fn read_done(&mut self, id: u64, restored: bool) -> bool {
        if restored {
            self.set_resident(id, true);
        }
        self.reading.remove(&id)
    }

    /// The object of `id`, resident with a file, is on disk only again (`false`), or the
    /// reverse.
    pub(crate) fn set_resident(&mut self, id: u64, resident: bool) {
        if let Some(f) = self.files.get_mut(&id).filter(|f| f.resident != resident) {
            f.resident = resident;
            if resident {
                self.data_bytes -= f.size;
            } else {
                self.data_bytes += f.size;
            }
        }
    }

    /// The data size and CRC-32C of `id`'s complete file.
    pub(crate) fn file(&self, id: u64) -> Option<(u64, u32)> {
        self.files.get(&id).map(|f| (f.size, f.crc))
    }

    /// The object's complete file goes (the object is gone, or back in memory): whether it
    /// had one.
    pub(crate) fn forget(&mut self, id: u64) -> bool {
        let Some(f) = self.files.remove(&id) else {
            return false;
        };
        self.reading.remove(&id);
        self.disk_bytes -= file_len(f.size);
        if !f.resident {
            self.data_bytes -= f.size;
        }
        true
    }

    /// Whether an IO of `id` is in flight (its memory is the IO's until it reports).
    pub(crate) fn in_flight(&self, id: u64) -> bool {
        self.writing.contains_key(&id) || self.reading.contains(&id)
    }

    /// Objects on disk only, and their data bytes.
    pub(crate) fn spilled(&self) -> (u64, u64) {
        let away = self.files.values().filter(|f| !f.resident).count();
        (away as u64, self.data_bytes)
    }

    /// Memory the writes in flight free when they complete.
    pub(crate) fn freeing(&self) -> u64 {
        self.freeing
    }

    /// File bytes, complete or being written (what `--spill-max` bounds).
    #[cfg(test)]
    pub(crate) fn disk_bytes(&self) -> u64 {
        self.disk_bytes
    }

    /// The invariants in the module doc.
    pub(crate) fn check(&self) -> Result<(), String> {
        let disk: u64 = self
            .files
            .values()
            .map(|f| f.size)
            .chain(self.writing.values().map(|w| w.size))
            .map(file_len)
            .sum();
        let data: u64 = self
            .files
            .values()
            .filter(|f| !f.resident)
            .map(|f| f.size)
            .sum();
        let freeing: u64 = self.writing.values().map(|w| w.frees).sum();
        if (disk, data, freeing) != (self.disk_bytes, self.data_bytes, self.freeing) {
            return Err(format!(
                "spill index counts {:?}, entries say {:?}",
                (self.disk_bytes, self.data_bytes, self.freeing),
                (disk, data, freeing)
            ));
        }
        if self.writing.keys().any(|id| self.files.contains_key(id)) {
            return Err("an object both spilled and being spilled".into());
        }
        if self.reading.iter().any(|id| !self.files.contains_key(id)) {
            return Err("a read of an object without a file".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spill::file::BLOCK;

    #[test]
    fn files_are_admitted_within_the_byte_and_object_bounds() {
        let mut ix = SpillIndex::default();
        let max = 3 * BLOCK + 10;
        assert!(ix.admit(1, 100, 128, max, 10));
        // A second file of two blocks would pass the bound.
        assert!(!ix.admit(2, BLOCK, 4096, max, 10));
        assert!(!ix.admit(1, 1, 64, u64::MAX, 10), "one file per object");
        assert_eq!((ix.disk_bytes(), ix.freeing()), (2 * BLOCK, 128));
        assert!(ix.in_flight(1));
        ix.check().unwrap();
        // The object bound.
        assert!(!ix.admit(3, 1, 64, u64::MAX, 1));
        ix.check().unwrap();
    }

    #[test]
    fn a_failed_write_returns_its_reservation_a_kept_one_counts_until_forgotten() {
        let mut ix = SpillIndex::default();
        assert!(ix.admit(1, 100, 128, u64::MAX, 10));
        assert!(ix.admit(2, 5000, 5056, u64::MAX, 10));
        assert_eq!(
            ix.written(1, None, false),
            Some(Writing {
                size: 100,
                frees: 128
            })
        );
        assert_eq!(ix.written(2, Some(7), false).map(|w| w.frees), Some(5056));
        assert_eq!(ix.written(2, Some(7), false), None, "reported once");
        assert_eq!(ix.spilled(), (1, 5000));
        assert_eq!(ix.file(2), Some((5000, 7)));
        assert_eq!((ix.disk_bytes(), ix.freeing()), (3 * BLOCK, 0));
        ix.reading(2);
        assert!(ix.in_flight(2));
        assert!(ix.read_done(2, true));
        assert!(!ix.in_flight(2));
        // Read back: in memory again, its file kept (and still counted against the bound).
        assert_eq!((ix.spilled(), ix.file(2)), ((0, 0), Some((5000, 7))));
        assert_eq!(ix.disk_bytes(), 3 * BLOCK);
        ix.set_resident(2, false);
        assert_eq!(ix.spilled(), (1, 5000));
        ix.check().unwrap();
        assert!(ix.forget(2));
        assert!(!ix.forget(2));
        assert_eq!((ix.spilled(), ix.disk_bytes()), ((0, 0), 0));
        ix.check().unwrap();
    }
}
