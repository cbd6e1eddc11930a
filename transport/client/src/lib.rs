//! The Rust client of `vovp-engine`: [`Client`] (blocking) and `AsyncClient` (tokio; the
//! `async` feature, on by default) speak PROTOCOL.md (through `vovp-proto`) and implement the
//! same [`vovp_types::Store`] / [`vovp_types::AsyncStore`] traits as the embedded engine, so a
//! framework switches between them in one line. Got objects are zero-copy views into the
//! mapped segments; dropping a view releases its reference.
//!
//! Layout: `core` is the connection state both clients share (request ids, queued releases,
//! the current mappings and connection generation, reply decoding, the ways a put may take,
//! reconnect bookkeeping), with no socket in it; `ops` is every store operation, written once
//! as async code over a driver (the put and get routes among them); `blocking` and
//! `nonblocking` are the two drivers, and the blocking client's puts that do not wait for
//! their reply (`blocking/puts.rs`, `blocking/kept.rs`); `lent` is the lend a client writes
//! into, `pending` the store's copy of a put before its reply, `notify` a subscription's
//! frames; `mapping` turns locations into addresses; `io` is blocking socket I/O on any fd.

#![warn(unreachable_pub, missing_debug_implementations)]

mod blocking;
mod core;
mod io;
mod lent;
mod mapping;
#[cfg(feature = "async")]
mod nonblocking;
mod notify;
mod ops;
mod pending;
mod private;
mod shared;
#[cfg(test)]
mod test_support;

pub use blocking::{Client, Subscription, SubscriptionCloser};
#[cfg(feature = "async")]
pub use nonblocking::{AsyncClient, AsyncSubscription};
pub use ops::{FetchBase, FetchOptions, Put, TransferInfo};
pub use pending::PipelinedView;
/// `put_cuda_tensor` on a [`Client`] (as on any `Store`).
pub use vovp_gpu::CudaStore;
/// The vocabulary (`Error`, `Store`, views, tensors, ...), so that a client program needs no
/// other vovp crate.
pub use vovp_types::*;

/// Puts smaller than this go inline rather than through this client's lend
/// ([`vovp_types::lends::MIN_OBJECT`]).
pub const CLIENT_LEND_MIN: usize = vovp_types::lends::MIN_OBJECT;

/// How a [`Client`] or an `AsyncClient` connects.
#[derive(Clone, Copy, Debug, Default)]
pub struct ClientOptions {
    /// When the daemon has gone away (stopped, killed, restarted), connect again on the next
    /// call and retry it once on the new connection. Objects that died with the old daemon are
    /// simply not found there; views taken before keep their (old, intact) memory until
    /// dropped, and their releases are not sent to the new daemon. Off by default: a dead
    /// daemon is then an `Error::Connection` on every call.
    pub reconnect: bool,
    /// Got CUDA objects come back unmapped (`cuda_ptr()` None; the location has the IPC
    /// handle): for a caller that decides per object whether and how to map it (the Python
    /// package, which checks its framework and driver first). Created objects are mapped.
    /// Blocking client only.
    pub defer_cuda_mapping: bool,
    /// Dropped views' RELEASEs are queued: they ride in front of the next request (same
    /// write), or a small thread sends them after this delay if the client stays idle (if a
    /// call is in flight then, such as a GET waiting for its object, within 20 ms of its end:
    /// the thread never waits for the connection, so the call's return never waits for it). On a
    /// small machine this halves the cost of a get whose view is dropped at once (waking the
    /// daemon for each release costs as much as the request). None (the default): each
    /// release is sent when its view drops (when the connection is free). Blocking client only.
    pub release_delay: Option<std::time::Duration>,
    /// Do not map the store's shared directory: every get is a message (as before issue 13;
    /// for comparison and for debugging). Off by default: gets of sealed host objects read the
    /// directory and record a hold in this connection's hold table, with no message, and fall
    /// back to the socket for everything else.
    pub no_shared_reads: bool,
    /// Do not put through a lend. By default objects from 64 KiB to a lend's largest (PROTOCOL.md,
    /// "Limits") go through a part of this client's own arena the store lends
    /// it: the client copies the bytes there and one PUBLISH creates and seals the object (one
    /// round trip where CREATE + SEAL take two; no bytes through the socket). The store takes
    /// an empty, idle lend back when it is short of memory; a lend's memory comes back with
    /// its last object. Needs the hold table, so `no_shared_reads` implies this. See
    /// `lent.rs` (the client's side) and `vovp_shm::lend` (the handshake).
    pub no_lend_puts: bool,
    /// Wait for the store's answer to every put. By default a [`Client`]'s `put` of an
    /// object small enough to ride in the request (below 64 KiB, where lends start; 256 KiB
    /// with lends off; no reference kept), and [`Client::put_view_later`], return once
    /// the request is written, without waiting for the reply: a put costs a write, not a
    /// round trip. What stays true: a name already published fails at once
    /// (`AlreadyExists`); any other process that learns of the name after `put` returned and
    /// asks for it is answered after the put was applied (the put is counted in the hold
    /// table first; `blocking/puts.rs`, "Pipelined puts: the promises"); this client's own later requests
    /// come after it. What changes: a put that fails in the store (a name taken meanwhile by
    /// a racing put, full memory) is logged when its reply is read and reported by
    /// [`Client::sync`], not by the `put` (nor by unrelated later calls). Needs the hold table,
    /// so `no_shared_reads` implies this. Blocking client only (an `AsyncClient` always waits).
    pub no_pipelined_puts: bool,
}

/// Milliseconds since the epoch (for display).
pub fn unix_millis(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The README's Rust example, compiled (not run: it needs a daemon) with the doctests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeExample;
