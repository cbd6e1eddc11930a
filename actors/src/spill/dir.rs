//! The spill directory at start: one daemon per directory, and an empty one.
//!
//! A restart **cleans** the directory rather than restoring it. Objects live in memory and die
//! with the daemon; the files in DIR are the *least recently used* part of the old store, so
//! bringing only them back would make the new store's contents an accident of what was cold
//! when the old one died (versions from a line of replaces whose newer versions are gone, names
//! a client deleted while the daemon died mid-unlink). Every client of the old daemon got a
//! connection error and knows its objects are gone (README, "Restarts"); a spill file is a
//! cache line of the store, not a durable copy. So the files are written without `fsync`, and
//! a daemon starting on DIR removes the spill files it finds there (`*.spill`, nothing else).
//!
//! The exclusive lock (`flock` on `DIR/.vovp-spill.lock`, held for the daemon's life and
//! released by the kernel when it dies, SIGKILL included) makes a second daemon given the same
//! DIR refuse to start, instead of deleting the first one's files under it.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use vovp_types::Error;

use super::file::SUFFIX;

const LOCK: &str = ".vovp-spill.lock";

/// A spill directory this daemon holds the lock of.
#[derive(Debug)]
pub(crate) struct SpillDir {
    path: PathBuf,
    /// Holds the `flock` while open.
    _lock: File,
}

impl SpillDir {
    /// Creates `path` if need be, takes its lock (or fails: another daemon uses it), and
    /// removes the spill files a previous daemon left: how many.
    pub(crate) fn open(path: &Path) -> Result<(SpillDir, usize), Error> {
        let config = |what: &str, e: std::io::Error| {
            Error::Config(format!("--spill-dir {}: {what}: {e}", path.display()))
        };
        std::fs::create_dir_all(path).map_err(|e| config("cannot create it", e))?;
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path.join(LOCK))
            .map_err(|e| config("cannot open its lock file", e))?;
        match rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(rustix::io::Errno::WOULDBLOCK) => {
                return Err(Error::Config(format!(
                    "--spill-dir {}: another vovp-engine spills there (it holds {LOCK}); \
                     give each daemon a directory of its own",
                    path.display()
                )))
            }
            Err(e) => return Err(config("cannot lock it", e.into())),
        }
        let removed = remove_spill_files(path).map_err(|e| config("cannot clean it", e))?;
        Ok((
            SpillDir {
                path: path.to_owned(),
                _lock: lock,
            },
            removed,
        ))
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

/// Removes every spill file in `dir` (and only those): how many.
pub(crate) fn remove_spill_files(dir: &Path) -> std::io::Result<usize> {
    let mut removed = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let is_spill = entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.ends_with(SUFFIX));
        if is_spill && entry.file_type()?.is_file() {
            match std::fs::remove_file(entry.path()) {
                Ok(()) => removed += 1,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("vovp-spilldir-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_directory_is_cleaned_of_spill_files_only_and_locked_once() {
        let d = temp_dir("lock");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("0000000000000001.spill"), b"old").unwrap();
        std::fs::write(d.join("notes.txt"), b"mine").unwrap();
        let (held, removed) = SpillDir::open(&d).unwrap();
        assert_eq!(removed, 1);
        assert!(d.join("notes.txt").exists());
        assert_eq!(held.path(), d.as_path());
        // A second daemon on the same directory is refused, and removes nothing.
        std::fs::write(d.join("0000000000000002.spill"), b"live").unwrap();
        let second = SpillDir::open(&d).unwrap_err();
        assert!(
            second.to_string().contains("another vovp-engine"),
            "{second}"
        );
        assert!(d.join("0000000000000002.spill").exists());
        // Once the first is gone (its lock with it), the directory can be taken again.
        drop(held);
        let (_again, removed) = SpillDir::open(&d).unwrap();
        assert_eq!(removed, 1);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
