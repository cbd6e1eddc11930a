//! vovp's actors: the allocator actor (memfd segments, TLSF-style offset allocation) and the
//! eviction/refcount actor (object table, per-holder references, LRU), plus the plain data
//! types they exchange and the one error type. This is the engine's private core: only the
//! `vovp` crate sends these messages (through its `Session`, whoever the client is) and wires
//! the actors to the GPU actor; everyone else uses the types it re-exports.

pub mod allocator;
pub mod copy;
mod error;
pub mod lends;
pub mod memory_room;
pub mod pipelined;
pub mod segment;
pub mod shared;
pub mod table;
pub mod table_actor;
mod types;

pub use error::Error;
pub use types::*;
