//! The inline-put sizes, defined here once: the store's limit and each writer's choice below
//! it. The daemon announces [`MAX_INLINE_PUT`] in HELLO's `max_inline`; socket clients send
//! inline up to [`CLIENT_INLINE_PUT`] of that; the embedded engine up to [`INLINE_PUT_LIMIT`].

/// Largest PUT payload the store takes (bigger objects: create, write the mapping, seal). The
/// store copies an inline payload in itself, on its one thread, so this bounds how long one
/// request can keep every other client waiting. Enforced by [`Session::put_inline`](crate::Session::put_inline).
pub const MAX_INLINE_PUT: usize = 1 << 20;

/// Largest put a socket client sends inline (at most the daemon's `max_inline`): beyond ~256
/// KiB, CREATE + a parallel copy into the mapping + SEAL beats pushing the bytes through the
/// socket (vovp-bench: 1 MiB inline ~305 µs vs 150-195 µs through the mapping). The Python
/// client makes the same choice (`INLINE_LIMIT` in python/vovp/client.py).
pub const CLIENT_INLINE_PUT: usize = 256 * 1024;

/// Largest put the embedded engine sends inside one message (one actor round trip, the engine
/// copying); larger ones are created, copied by the caller (in parallel) and sealed. Lower than
/// a socket client's: in-process, the create-copy-seal path costs no socket round trips.
pub const INLINE_PUT_LIMIT: usize = 64 * 1024;

const _: () = assert!(INLINE_PUT_LIMIT <= MAX_INLINE_PUT && CLIENT_INLINE_PUT <= MAX_INLINE_PUT);
