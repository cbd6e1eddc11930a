//! Byte layouts shared by the store and every client: the one place they are written down.
//! The `#[repr(C)]` structs below are the layouts, the tables here describe them, and the
//! test `tests::layout_is_pinned` pins every offset, size and constant value in these tables,
//! so a change to either that is not made to both fails `cargo test -p vovp-shm`.
//!
//! Every word is a little-endian `u64` accessed atomically (no byte is ever read or written
//! non-atomically, so a reader racing the writer reads stale or mixed words, never undefined
//! behaviour; the seqlock throws mixed reads away). Any change to these layouts or to
//! [`name_hash`] bumps [`LAYOUT_VERSION`] (now 5: 2 added the lend words, 3 grew the headers
//! to 128 bytes for `puts_sent`, 4 added `holding`, 5 the entries' `version`); a mapping whose header disagrees with
//! this build is refused. Offsets are in bytes.
//!
//! **Directory header** ([`DirHeader`], [`HEADER_SIZE`] = 128 B, at 0), written by the store
//! before the fd is handed out:
//!
//! | offset | word | value |
//! |---|---|---|
//! | 0 | `magic` | [`DIR_MAGIC`], `"VOVPDIR1"` |
//! | 8 | `version_entry_size` | [`LAYOUT_VERSION`] (5) \| [`ENTRY_SIZE`] (384) << 32 |
//! | 16 | `capacity` | entries, a power of two ≤ [`MAX_CAPACITY`] (2^24) |
//! | 24 | `name_max` | [`NAME_MAX`] (256, the store's name limit) |
//! | 32 | `entries_offset` | [`HEADER_SIZE`] (128) |
//! | 40 | `live` | live entries (store bookkeeping, ignored by readers) |
//! | 48 | `next_generation` | the next generation to hand out (store bookkeeping) |
//! | 56..128 | `reserved` | 9 words |
//!
//! **Directory entry** `i` ([`Entry`], [`ENTRY_SIZE`] = 384 B, six cache lines, at
//! `128 + 384 i`), written only by the store under its seqlock:
//!
//! | offset | word | value |
//! |---|---|---|
//! | 0 | `seq` | seqlock: even = stable, odd = being written |
//! | 8 | `state` | [`STATE_EMPTY`] 0, [`STATE_LIVE`] 1, [`STATE_TOMBSTONE`] 2 |
//! | 16 | `hash` | [`name_hash`] (FNV-1a 64) of the name |
//! | 24 | `object_id` | the store's object id (informational) |
//! | 32 | `generation` | unique per publication for the directory's life, never 0: what a hold names |
//! | 40 | `segment_name_len` | segment (low 32 bits) \| name length << 32 |
//! | 48 | `offset` | the data: `offset .. offset + size` in the segment |
//! | 56 | `size` | |
//! | 64 | `meta_offset` | the metadata: `meta_offset .. meta_offset + meta_len`, same segment |
//! | 72 | `meta_len` | |
//! | 80 | `flags` | store-defined, carried, not interpreted here |
//! | 88 | `stamp` | the store's LRU stamp; **outside** the seqlock (advisory) |
//! | 96 | `version` | the name's version this object is (1, 2, ...: a replace publishes the next) |
//! | 104..128 | `reserved` | 3 words |
//! | 128..384 | `name` | 32 words: the name's bytes, zero-padded, packed little-endian |
//!
//! **Hold table header** ([`HoldHeader`], [`HEADER_SIZE`] = 128 B, at 0), one table per
//! client; the store writes words 0..40 when it creates the table, the other words are
//! written by whoever is named:
//!
//! | offset | word | value |
//! |---|---|---|
//! | 0 | `magic` | [`HOLD_MAGIC`], `"VOVPHLD1"` |
//! | 8 | `version_slot_size` | [`LAYOUT_VERSION`] (5) \| [`SLOT_SIZE`] (32) << 32 |
//! | 16 | `slots` | slots, a power of two ≤ [`MAX_CAPACITY`] (the store's `SharedConfig` makes 4096) |
//! | 24 | `slots_offset` | [`HEADER_SIZE`] (128) |
//! | 32 | `client_id` | the store's id for the client (informational) |
//! | 40 | `lend_writers` | client: puts writing into its lend now ([`crate::lend`]) |
//! | 48 | `lend_revoked` | store: the id of the lend taken back, 0 if none |
//! | 56 | `lend_client` | client: [`LEND_CLIENT`] (`"VOVPLEND"`) once it takes part in the lend handshake |
//! | 64 | `puts_sent` | client: puts sent without waiting for their replies, ever ([`crate::sent`]) |
//! | 72 | `holding` | client: slots in use; 0 lets the store skip the table |
//! | 80 | `shared_gets` | client: gets it served from the directory (holds taken), ever; for metrics |
//! | 88 | `shared_get_bytes` | client: the data bytes of those gets, ever; for metrics |
//! | 96..128 | `reserved` | 4 words |
//!
//! `shared_gets` and `shared_get_bytes` were reserved words before (`LAYOUT_VERSION` 5 did
//! not change for them): the store zeroes a table it creates and an older client never writes
//! them, so a store reads 0 gets from it, which is all the difference. They are the client's
//! word about itself and only feed the store's metrics (a client can inflate its own count,
//! nothing else); the client bumps them with plain `Relaxed` stores (it is their only writer,
//! under its reader's lock), so a get costs no locked instruction for them.
//!
//! **Hold slot** `i` ([`HoldSlot`], [`SLOT_SIZE`] = 32 B, at `128 + 32 i`), written only by
//! its client, read by the store:
//!
//! | offset | word | value |
//! |---|---|---|
//! | 0 | `generation` | the generation held; 0 = free |
//! | 8 | `object_id` | informational (STATS, `list`) |
//! | 16 | `stamp` | the client's access time (monotonic ns), kept after release, for the LRU fold |
//! | 24 | `reserved` | |
//!
//! How the store and the clients use these words, and why it is safe: the crate doc (the hold
//! protocol, the `holding` count), [`crate::directory`] (the seqlock), [`crate::lend`] (the lend
//! handshake) and [`crate::sent`] (`puts_sent`).

use crate::sync::AtomicU64;

/// `"VOVPDIR1"` as a little-endian word.
pub const DIR_MAGIC: u64 = u64::from_le_bytes(*b"VOVPDIR1");
/// `"VOVPHLD1"` as a little-endian word.
pub const HOLD_MAGIC: u64 = u64::from_le_bytes(*b"VOVPHLD1");
/// What a client writes into its hold table's `lend_client` word: it takes part in the lend
/// handshake ([`crate::lend`]).
pub const LEND_CLIENT: u64 = u64::from_le_bytes(*b"VOVPLEND");
/// Bumped on any change of these layouts or of [`name_hash`].
pub const LAYOUT_VERSION: u32 = 5;

/// Longest name an entry holds inline: the store's own limit (`vovp::MAX_NAME_LEN`), so every
/// object can be published.
pub const NAME_MAX: usize = 256;
pub(crate) const NAME_WORDS: usize = NAME_MAX / 8;

/// Bytes of a directory or hold-table header; the entries or slots follow it.
pub const HEADER_SIZE: usize = 128;
/// Bytes of one directory entry (six cache lines).
pub const ENTRY_SIZE: usize = 384;
/// Bytes of one hold slot.
pub const SLOT_SIZE: usize = 32;
/// Largest directory (entries) and hold table (slots) this build accepts.
pub const MAX_CAPACITY: usize = 1 << 24;

/// Entry states (the `state` word).
pub const STATE_EMPTY: u64 = 0;
pub const STATE_LIVE: u64 = 1;
pub const STATE_TOMBSTONE: u64 = 2;

fn zero_words<const N: usize>() -> [AtomicU64; N] {
    std::array::from_fn(|_| AtomicU64::new(0))
}

/// The directory's header. Written by the store before the fd is handed out, except `live`
/// and `next_generation` (store-only bookkeeping; readers ignore them).
#[repr(C)]
#[derive(Debug)]
pub struct DirHeader {
    pub magic: AtomicU64,
    /// `LAYOUT_VERSION | ENTRY_SIZE << 32`.
    pub version_entry_size: AtomicU64,
    /// Number of entries, a power of two.
    pub capacity: AtomicU64,
    pub name_max: AtomicU64,
    /// Offset of entry 0 from the start of the region.
    pub entries_offset: AtomicU64,
    /// Live entries.
    pub live: AtomicU64,
    /// The next generation the store hands out; generations are unique for the directory's life.
    pub next_generation: AtomicU64,
    pub reserved: [AtomicU64; 9],
}

impl DirHeader {
    pub fn new() -> Self {
        let [magic, version_entry_size, capacity, name_max, entries_offset, live, next_generation] =
            zero_words::<7>();
        DirHeader {
            magic,
            version_entry_size,
            capacity,
            name_max,
            entries_offset,
            live,
            next_generation,
            reserved: zero_words(),
        }
    }
}

impl Default for DirHeader {
    fn default() -> Self {
        Self::new()
    }
}

/// One directory entry. Every word but `stamp` is covered by `seq` (the seqlock): even =
/// stable, odd = the store is writing it.
#[repr(C)]
#[derive(Debug)]
pub struct Entry {
    pub seq: AtomicU64,
    pub state: AtomicU64,
    /// [`name_hash`] of the name.
    pub hash: AtomicU64,
    /// The store's object id (informational: holds key on `generation`).
    pub object_id: AtomicU64,
    /// Unique per publication for the directory's life, never 0: what a hold names.
    pub generation: AtomicU64,
    /// `segment (u32) | name_len << 32`.
    pub segment_name_len: AtomicU64,
    /// Data: `offset .. offset + size` in `segment`.
    pub offset: AtomicU64,
    pub size: AtomicU64,
    /// Metadata bytes: `meta_offset .. meta_offset + meta_len` in the same segment.
    pub meta_offset: AtomicU64,
    pub meta_len: AtomicU64,
    /// Store-defined flags (e.g. ephemeral); carried, not interpreted here.
    pub flags: AtomicU64,
    /// The store's LRU stamp as last folded in. Outside the seqlock: the store updates it
    /// without making readers retry; it is advisory.
    pub stamp: AtomicU64,
    /// The name's version this object is.
    pub version: AtomicU64,
    pub reserved: [AtomicU64; 3],
    /// The name's bytes, zero-padded, packed little-endian into words.
    pub name: [AtomicU64; NAME_WORDS],
}

impl Entry {
    pub fn new() -> Self {
        let [seq, state, hash, object_id, generation, segment_name_len, offset, size, meta_offset, meta_len, flags, stamp, version] =
            zero_words::<13>();
        Entry {
            seq,
            state,
            hash,
            object_id,
            generation,
            segment_name_len,
            offset,
            size,
            meta_offset,
            meta_len,
            flags,
            stamp,
            version,
            reserved: zero_words(),
            name: zero_words(),
        }
    }
}

impl Default for Entry {
    fn default() -> Self {
        Self::new()
    }
}

/// A hold table's header, written by the store when it creates the table.
#[repr(C)]
#[derive(Debug)]
pub struct HoldHeader {
    pub magic: AtomicU64,
    /// `LAYOUT_VERSION | SLOT_SIZE << 32`.
    pub version_slot_size: AtomicU64,
    pub slots: AtomicU64,
    pub slots_offset: AtomicU64,
    /// The store's id for the client (informational).
    pub client_id: AtomicU64,
    /// Puts of this client writing into its lend now (written by the client; [`crate::lend`]).
    pub lend_writers: AtomicU64,
    /// The id of the client's lend the store has taken back, 0 if none (written by the store).
    pub lend_revoked: AtomicU64,
    /// [`LEND_CLIENT`] once the client has mapped the table and takes part in the lend
    /// handshake (written by the client; the store lends to no one else).
    pub lend_client: AtomicU64,
    /// Puts this client sent without waiting for their replies, ever (written by the client
    /// before each is sent; [`crate::sent`]).
    pub puts_sent: AtomicU64,
    /// How many slots hold something, kept by the client: the store skips scanning a table
    /// whose count is 0 (most tables, most of the time), so a free costs a load per client
    /// instead of a scan of every slot. A client that under-counts only exposes itself.
    pub holding: AtomicU64,
    /// Gets this client served from the directory (each a hold taken), ever (written by the
    /// client, read by the store's metrics).
    pub shared_gets: AtomicU64,
    /// The data bytes of those gets, ever (as `shared_gets`).
    pub shared_get_bytes: AtomicU64,
    pub reserved: [AtomicU64; 4],
}

impl HoldHeader {
    pub fn new() -> Self {
        let [magic, version_slot_size, slots, slots_offset, client_id, lend_writers, lend_revoked, lend_client, puts_sent, holding, shared_gets, shared_get_bytes] =
            zero_words::<12>();
        HoldHeader {
            magic,
            version_slot_size,
            slots,
            slots_offset,
            client_id,
            lend_writers,
            lend_revoked,
            lend_client,
            puts_sent,
            holding,
            shared_gets,
            shared_get_bytes,
            reserved: zero_words(),
        }
    }
}

impl Default for HoldHeader {
    fn default() -> Self {
        Self::new()
    }
}

/// One hold: written only by its client, read by the store.
#[repr(C)]
#[derive(Debug)]
pub struct HoldSlot {
    /// The generation held; 0 = free. The only word the free/evict decision reads.
    pub generation: AtomicU64,
    /// Informational (STATS, `list`): the object id of the held entry.
    pub object_id: AtomicU64,
    /// The client's access time (monotonic ns) for the store's LRU fold. Kept after release.
    pub stamp: AtomicU64,
    pub reserved: AtomicU64,
}

impl HoldSlot {
    pub fn new() -> Self {
        let [generation, object_id, stamp, reserved] = zero_words::<4>();
        HoldSlot {
            generation,
            object_id,
            stamp,
            reserved,
        }
    }
}

impl Default for HoldSlot {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(not(loom))]
const _: () = {
    assert!(std::mem::size_of::<DirHeader>() == HEADER_SIZE);
    assert!(std::mem::size_of::<HoldHeader>() == HEADER_SIZE);
    assert!(std::mem::size_of::<Entry>() == ENTRY_SIZE);
    assert!(std::mem::size_of::<HoldSlot>() == SLOT_SIZE);
};

/// FNV-1a, 64-bit. Written out here rather than taken from std because it is part of the
/// shared layout: the store and every client (daemon, Rust client, Python native core, built
/// at different times) must agree on it bit for bit, which std's `DefaultHasher` does not
/// promise. Changing it means bumping [`LAYOUT_VERSION`].
pub fn name_hash(name: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in name {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Word `i` of the zero-padded name.
pub(crate) fn name_word(name: &[u8], i: usize) -> u64 {
    let mut w = [0u8; 8];
    let start = i * 8;
    if start < name.len() {
        let end = (start + 8).min(name.len());
        w[..end - start].copy_from_slice(&name[start..end]);
    }
    u64::from_le_bytes(w)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::mem::offset_of;

    /// Every offset, size and value in the module doc's tables. Change a layout and this
    /// fails until the tables (and `LAYOUT_VERSION`) are brought along.
    #[test]
    fn layout_is_pinned() {
        use std::mem::size_of;
        assert_eq!(LAYOUT_VERSION, 5);
        assert_eq!(DIR_MAGIC.to_le_bytes(), *b"VOVPDIR1");
        assert_eq!(HOLD_MAGIC.to_le_bytes(), *b"VOVPHLD1");
        assert_eq!(LEND_CLIENT.to_le_bytes(), *b"VOVPLEND");
        assert_eq!(
            [
                HEADER_SIZE,
                ENTRY_SIZE,
                SLOT_SIZE,
                NAME_MAX,
                NAME_WORDS,
                MAX_CAPACITY
            ],
            [128, 384, 32, 256, 32, 1 << 24]
        );
        assert_eq!([STATE_EMPTY, STATE_LIVE, STATE_TOMBSTONE], [0, 1, 2]);
        assert_eq!(
            [
                size_of::<DirHeader>(),
                size_of::<Entry>(),
                size_of::<HoldHeader>(),
                size_of::<HoldSlot>(),
            ],
            [HEADER_SIZE, ENTRY_SIZE, HEADER_SIZE, SLOT_SIZE]
        );
        assert_eq!(
            [
                offset_of!(DirHeader, magic),
                offset_of!(DirHeader, version_entry_size),
                offset_of!(DirHeader, capacity),
                offset_of!(DirHeader, name_max),
                offset_of!(DirHeader, entries_offset),
                offset_of!(DirHeader, live),
                offset_of!(DirHeader, next_generation),
                offset_of!(DirHeader, reserved),
            ],
            [0, 8, 16, 24, 32, 40, 48, 56]
        );
        assert_eq!(
            [
                offset_of!(Entry, seq),
                offset_of!(Entry, state),
                offset_of!(Entry, hash),
                offset_of!(Entry, object_id),
                offset_of!(Entry, generation),
                offset_of!(Entry, segment_name_len),
                offset_of!(Entry, offset),
                offset_of!(Entry, size),
                offset_of!(Entry, meta_offset),
                offset_of!(Entry, meta_len),
                offset_of!(Entry, flags),
                offset_of!(Entry, stamp),
                offset_of!(Entry, version),
                offset_of!(Entry, reserved),
                offset_of!(Entry, name),
            ],
            [0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 128]
        );
        assert_eq!(
            [
                offset_of!(HoldHeader, magic),
                offset_of!(HoldHeader, version_slot_size),
                offset_of!(HoldHeader, slots),
                offset_of!(HoldHeader, slots_offset),
                offset_of!(HoldHeader, client_id),
                offset_of!(HoldHeader, lend_writers),
                offset_of!(HoldHeader, lend_revoked),
                offset_of!(HoldHeader, lend_client),
                offset_of!(HoldHeader, puts_sent),
                offset_of!(HoldHeader, holding),
                offset_of!(HoldHeader, shared_gets),
                offset_of!(HoldHeader, shared_get_bytes),
                offset_of!(HoldHeader, reserved),
            ],
            [0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96]
        );
        assert_eq!(
            [
                offset_of!(HoldSlot, generation),
                offset_of!(HoldSlot, object_id),
                offset_of!(HoldSlot, stamp),
                offset_of!(HoldSlot, reserved),
            ],
            [0, 8, 16, 24]
        );
    }

    #[test]
    fn name_hash_and_words_are_fixed() {
        // FNV-1a test vectors: part of the shared layout, must never change silently.
        assert_eq!(name_hash(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(name_hash(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(
            name_word(b"abcdefghij", 1),
            u64::from_le_bytes(*b"ij\0\0\0\0\0\0")
        );
        assert_eq!(name_word(b"abc", 3), 0);
    }
}
