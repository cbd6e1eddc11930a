//! A spill file: one spilled object, named by its object id (`<id as 16 hex digits>.spill`),
//! a header block then the data. Everything a restore checks before it hands a byte out is
//! here: the header's own checksum, that the file is the object asked for (id, size, version,
//! name), and the data's CRC-32C (hardware-accelerated: SSE 4.2 / ARMv8 CRC), so a damaged,
//! truncated, swapped or missing file is a [`Damage`], never wrong bytes.
//!
//! Layout (little-endian; offsets are multiples of [`BLOCK`] so the data can move with
//! `O_DIRECT`):
//!
//! ```text
//! offset size  field
//! 0      8     magic "VOVPSPL1"
//! 8      4     u32 CRC-32C of bytes 12..BLOCK of this header
//! 12     4     u32 CRC-32C of the data (its `size` bytes, not the padding)
//! 16     8     u64 object id
//! 24     8     u64 data size
//! 32     8     u64 version
//! 40     2     u16 name length n (1..=256)
//! 42     n     name (UTF-8)
//! ..     ..    zeros up to BLOCK
//! BLOCK  size  data, then zeros up to a multiple of BLOCK
//! ```
//!
//! The object's metadata is not in the file: the table keeps every object's metadata in
//! memory (it is charged to the object's block while resident, and is at most 64 KiB), and
//! the store writes it into the block again when the object is restored.

use std::path::{Path, PathBuf};

/// The unit of `O_DIRECT` transfers (file offsets, lengths and buffer addresses are multiples
/// of it): 4 KiB, what every common file system and device accepts.
pub(crate) const BLOCK: u64 = 4096;

const MAGIC: &[u8; 8] = b"VOVPSPL1";
/// Bytes of the header before the name.
const FIXED: usize = 42;

/// The suffix of spill files: what a cleaning of the directory removes, and nothing else.
pub(crate) const SUFFIX: &str = ".spill";

/// What a spill file says about its object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub id: u64,
    pub size: u64,
    pub version: u64,
    pub name: String,
    /// CRC-32C of the data.
    pub crc: u32,
}

/// Why a spill file cannot give its object back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Damage {
    Missing,
    Truncated {
        have: u64,
        need: u64,
    },
    /// The header's magic or checksum is wrong.
    BadHeader,
    /// A sound header of another object (a file swapped or left behind).
    NotThisObject,
    /// The data's checksum is not the one written.
    Checksum {
        expected: u32,
        found: u32,
    },
    Io(String),
}

impl std::fmt::Display for Damage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Damage::Missing => write!(f, "its spill file is gone"),
            Damage::Truncated { have, need } => {
                write!(f, "its spill file is truncated ({have} of {need} bytes)")
            }
            Damage::BadHeader => write!(f, "its spill file's header is damaged"),
            Damage::NotThisObject => write!(f, "its spill file holds another object"),
            Damage::Checksum { expected, found } => write!(
                f,
                "its spill file's data fails the checksum (CRC-32C {found:#010x}, written \
                 {expected:#010x})"
            ),
            Damage::Io(e) => write!(f, "reading its spill file failed: {e}"),
        }
    }
}

/// The file of object `id` in `dir`.
pub(crate) fn path_of(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id:016x}{SUFFIX}"))
}

/// `n` rounded up to whole [`BLOCK`]s.
pub(crate) fn blocks(n: u64) -> u64 {
    n.div_ceil(BLOCK) * BLOCK
}

/// The length of the file of an object of `size` data bytes: what it takes of `--spill-max`.
pub(crate) fn file_len(size: u64) -> u64 {
    BLOCK + blocks(size)
}

impl Header {
    /// The header block (exactly [`BLOCK`] bytes) into `out`.
    pub(crate) fn encode_into(&self, out: &mut [u8]) {
        let out = &mut out[..BLOCK as usize];
        out.fill(0);
        let name = self.name.as_bytes();
        out[..8].copy_from_slice(MAGIC);
        out[12..16].copy_from_slice(&self.crc.to_le_bytes());
        out[16..24].copy_from_slice(&self.id.to_le_bytes());
        out[24..32].copy_from_slice(&self.size.to_le_bytes());
        out[32..40].copy_from_slice(&self.version.to_le_bytes());
        // Names are at most 256 bytes (ObjectName), so they always fit the block.
        let n = name.len().min(BLOCK as usize - FIXED);
        out[40..42].copy_from_slice(&(n as u16).to_le_bytes());
        out[FIXED..FIXED + n].copy_from_slice(&name[..n]);
        let crc = crc32c::crc32c(&out[12..]);
        out[8..12].copy_from_slice(&crc.to_le_bytes());
    }

    /// Reads a header block, checking its magic and checksum.
    pub(crate) fn decode(block: &[u8]) -> Result<Header, Damage> {
        if block.len() < BLOCK as usize {
            return Err(Damage::Truncated {
                have: block.len() as u64,
                need: BLOCK,
            });
        }
        let block = &block[..BLOCK as usize];
        let u32_at = |at: usize| {
            u32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]])
        };
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&block[at..at + 8]);
            u64::from_le_bytes(b)
        };
        if &block[..8] != MAGIC || u32_at(8) != crc32c::crc32c(&block[12..]) {
            return Err(Damage::BadHeader);
        }
        let n = usize::from(u16::from_le_bytes([block[40], block[41]]));
        let name = block
            .get(FIXED..FIXED + n)
            .and_then(|b| std::str::from_utf8(b).ok())
            .ok_or(Damage::BadHeader)?;
        Ok(Header {
            crc: u32_at(12),
            id: u64_at(16),
            size: u64_at(24),
            version: u64_at(32),
            name: name.to_owned(),
        })
    }

    /// Whether `found` (a file's header) is this object's, as written (its data checksum
    /// included).
    pub(crate) fn same_object(&self, found: &Header) -> bool {
        (
            self.id,
            self.size,
            self.version,
            self.name.as_str(),
            self.crc,
        ) == (
            found.id,
            found.size,
            found.version,
            found.name.as_str(),
            found.crc,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Header {
        Header {
            id: 0x1234_0000_0007,
            size: 5000,
            version: 3,
            name: "weights/layer.0".into(),
            crc: 0xdead_beef,
        }
    }

    #[test]
    fn a_header_round_trips_and_names_its_object() {
        let mut block = vec![0u8; BLOCK as usize];
        header().encode_into(&mut block);
        let back = Header::decode(&block).unwrap();
        assert_eq!(back, header());
        assert!(header().same_object(&back));
        let other = Header {
            version: 4,
            ..header()
        };
        assert!(!other.same_object(&back));
    }

    #[test]
    fn any_flipped_header_bit_or_a_short_block_is_damage() {
        let mut block = vec![0u8; BLOCK as usize];
        header().encode_into(&mut block);
        for at in [0, 9, 13, 20, 30, 40, 45, 4000] {
            let mut bad = block.clone();
            bad[at] ^= 0x10;
            assert_eq!(Header::decode(&bad), Err(Damage::BadHeader), "byte {at}");
        }
        assert!(matches!(
            Header::decode(&block[..100]),
            Err(Damage::Truncated { have: 100, .. })
        ));
    }

    #[test]
    fn files_are_whole_blocks_named_by_id() {
        assert_eq!(file_len(0), BLOCK);
        assert_eq!(file_len(1), 2 * BLOCK);
        assert_eq!(file_len(BLOCK), 2 * BLOCK);
        assert_eq!(file_len(BLOCK + 1), 3 * BLOCK);
        assert_eq!(
            path_of(Path::new("/d"), 0xab),
            PathBuf::from("/d/00000000000000ab.spill")
        );
    }
}
