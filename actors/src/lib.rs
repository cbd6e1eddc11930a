//! vovp's actors: the allocator actor (memfd segments, TLSF-style offset allocation) and the
//! eviction/refcount actor (object table, per-holder references, LRU), plus the plain data
//! types they exchange. The engine crate wires them together; transport's connection actors
//! and the GPU actor talk to them by message.

pub mod allocator;
pub mod copy;
mod error;
pub mod memory_room;
pub mod segment;
pub mod table;
pub mod table_actor;
mod types;

pub use error::StoreError;
pub use types::*;
