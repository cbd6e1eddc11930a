//! vovp's actors: the allocator actor (memfd segments, TLSF-style offset allocation), the
//! eviction/refcount actor (object table, per-holder references, LRU) and the GPU actor (device
//! pools). This is the engine's private core: only the `vovp` crate sends these messages
//! (through its `Session`, whoever the client is) and wires the actors together; the values
//! they exchange are `vovp-types`'.

pub mod allocator;
mod answer;
pub mod gpu;
pub mod lends;
pub mod memory_room;
pub mod pipelined;
pub mod segment;
pub mod shared;
pub mod table;
pub mod table_actor;

pub use answer::{Answer, StoreFailure};
