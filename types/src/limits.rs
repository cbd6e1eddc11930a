//! Every fixed limit of the store, its wire protocol and its clients, defined here once (in
//! code; PROTOCOL.md, "Limits", states them in prose once, and other docs link there):
//!
//! * objects: [`MAX_NAME_LEN`], [`MAX_METADATA_LEN`], [`MAX_OBJECTS`];
//! * inline puts: the store's limit and each writer's choice below it. The daemon announces
//!   [`MAX_INLINE_PUT`] in HELLO's `max_inline`; socket clients send inline up to
//!   [`CLIENT_INLINE_PUT`] of that; the embedded engine up to [`INLINE_PUT_LIMIT`];
//! * [`lends`]: the size of a store's lends and of the small lend, and which objects go there
//!   (the one statement of the lend-size rule: [`lends::lend_size`]);
//! * [`wire`]: what one frame or request may carry (re-exported by `vovp-proto`);
//! * [`transfer`]: what one transfer between engines may ask and how long a ticket lives.
//!
//! The daemon's per-connection limits that are flags (`--handshake-timeout`, `--write-timeout`,
//! `--max-connections`) have their defaults with the server (`vovp-transport`'s
//! `server::Limits`), and the store's memory its `-m`.

/// Largest PUT payload the store takes (bigger objects: create, write the mapping, seal). The
/// store copies an inline payload in itself, on its one thread, so this bounds how long one
/// request can keep every other client waiting. Enforced by the store's inline put.
pub const MAX_INLINE_PUT: usize = 1 << 20;

/// Largest put a socket client sends inline (at most the daemon's `max_inline`): beyond ~256
/// KiB, CREATE + a parallel copy into the mapping + SEAL beats pushing the bytes through the
/// socket (vovp-bench: 1 MiB inline ~305 µs vs 150-195 µs through the mapping). The Python
/// client reads it from its native core (`vovp._native.INLINE_LIMIT`).
pub const CLIENT_INLINE_PUT: usize = 256 * 1024;

/// Largest put the embedded engine sends inside one message (one actor round trip, the engine
/// copying); larger ones are created, copied by the caller (in parallel) and sealed. Lower than
/// a socket client's: in-process, the create-copy-seal path costs no socket round trips.
pub const INLINE_PUT_LIMIT: usize = 64 * 1024;

const _: () = assert!(INLINE_PUT_LIMIT <= MAX_INLINE_PUT && CLIENT_INLINE_PUT <= MAX_INLINE_PUT);

/// Longest object name, in UTF-8 bytes.
pub const MAX_NAME_LEN: usize = 256;
/// Largest metadata blob stored with an object (tensor headers are far smaller).
pub const MAX_METADATA_LEN: usize = 64 * 1024;
/// Most objects the store holds at once (named or waiting for their last holder): the
/// allocator preallocates one node per possible object (PROTOCOL.md, `TooManyObjects`).
pub const MAX_OBJECTS: u64 = 1 << 20;

/// What one frame or request may carry: the daemon refuses more (PROTOCOL.md, "Limits").
pub mod wire {
    /// Largest payload of one frame.
    pub const MAX_PAYLOAD: usize = 64 << 20;
    /// Most names one GET may ask for. A waiting GET keeps every name, a result slot and a waiter
    /// entry per name (~250 bytes each), so this bounds what one request can pin in the daemon
    /// (~4 MiB) whatever the frame size.
    pub const MAX_GET_NAMES: usize = 16 * 1024;
    /// Most objects one PUBLISH_MANY may publish (a client pipelines at most 64 puts; the
    /// daemon believes at most 128 unanswered, `vovp-actors`' `MAX_IN_FLIGHT`).
    pub const MAX_PUBLISH_MANY: usize = 64;
    /// Entries of one LIST page when the request does not say.
    pub const LIST_PAGE_ENTRIES: u32 = 4096;
    /// The most entries a LIST request may ask for in one page.
    pub const MAX_LIST_PAGE_ENTRIES: u32 = 64 * 1024;
    /// A LIST page stops growing past this many bytes, so every reply stays far below the frame
    /// limit whatever the names and metadata.
    pub const LIST_PAGE_BYTES: usize = 8 << 20;
}

/// Transfers between engines (FETCH / GATHER and the TCP transfer port; PROTOCOL.md,
/// "Transfers between engines").
pub mod transfer {
    use std::time::Duration;

    /// Most base ranges one FETCH may name (each is copied locally instead of fetched).
    pub const MAX_FETCH_RANGES: usize = 1 << 20;
    /// Most ranges one ASK on the transfer port may name.
    pub const MAX_ASK_RANGES: usize = 1 << 20;
    /// Largest message on the transfer port (OPEN, HEADER, ASK, GO): an ASK of 8 Mi row ids.
    pub const MAX_MESSAGE: usize = 64 << 20;
    /// Longest a ticket may be valid for, from its minting: a holder remembers each used
    /// (nonce, stream) until its ticket expires, so this bounds that memory as well as a stolen
    /// ticket's life.
    pub const MAX_TICKET_LIFE: Duration = Duration::from_secs(600);
    /// How long a FETCH or GATHER may take when its request says 0 or less.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
}

/// The arithmetic of lends (LEND / PUBLISH), the same for the store and its clients.
pub mod lends {
    use crate::ALIGNMENT;

    /// The size of the lends of a store of `capacity` bytes, `None` when the store is too small to
    /// lend (under 64 MiB a lend would be a large share of it, and eviction, which can only give
    /// back whole lends, would lose its precision). A lend is 1/64 of the store, from 1 MiB to
    /// 16 MiB; objects up to a quarter of it go into lends.
    pub fn lend_size(capacity: u64) -> Option<u64> {
        const MIN: u64 = 1 << 20;
        const MAX: u64 = 16 << 20;
        let size = capacity / 64;
        (size >= MIN).then(|| size.min(MAX) / ALIGNMENT * ALIGNMENT)
    }

    /// The smallest object a client puts through its lend: smaller ones go inline (PUT: the
    /// bytes ride in the frame, the store copies them), where the socket copy is cheap, and
    /// small objects packed into lends would pin whole lends (a lend's memory comes back only
    /// with its last object).
    pub const MIN_OBJECT: usize = 64 * 1024;

    /// The size of a small lend (LEND with SMALL): objects published without waiting for the
    /// reply, up to [`SMALL_MAX_BLOCK`] each. Small, because a live small object keeps its
    /// whole lend (a lend's memory comes back with its last object): at most this much per
    /// small object that outlives the objects around it.
    pub const SMALL_LEND_SIZE: u64 = 64 * 1024;

    /// The largest block a client writes into its small lend: a 64-byte tensor with its header
    /// takes two 64-byte lines; 4 KiB keeps at least 16 objects per small lend.
    pub const SMALL_MAX_BLOCK: u64 = 4096;

    /// The largest block (data padded to 64 bytes, then metadata) a lend of `size` is made for.
    pub fn max_object(size: u64) -> u64 {
        size / 4
    }

    /// The bytes an object of `size` data bytes and `metadata_len` metadata bytes takes in a lend,
    /// and in any host block: data padded to [`ALIGNMENT`], then the metadata (`None`: overflow).
    pub fn block_len(size: u64, metadata_len: u64) -> Option<u64> {
        size.checked_next_multiple_of(ALIGNMENT)?
            .checked_add(metadata_len)?
            .checked_next_multiple_of(ALIGNMENT)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        const MIB: u64 = 1 << 20;

        #[test]
        fn lend_size_follows_the_store_and_small_stores_lend_nothing() {
            assert_eq!(lend_size(63 * MIB), None);
            assert_eq!(lend_size(64 * MIB), Some(MIB));
            assert_eq!(lend_size(256 * MIB), Some(4 * MIB));
            assert_eq!(lend_size(64 << 30), Some(16 * MIB));
            assert_eq!(max_object(4 * MIB), MIB);
            assert_eq!(block_len(100, 0), Some(128));
            assert_eq!(block_len(64, 1), Some(128));
            assert_eq!(block_len(0, 0), Some(0));
            assert_eq!(block_len(u64::MAX - 10, 0), None);
        }
    }
}
