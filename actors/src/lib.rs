//! vovp's actors: the allocator actor (memfd segments, TLSF-style offset allocation), the
//! eviction/refcount actor (object table, per-holder references, LRU, spilling to disk) and the
//! GPU actor (device pools). This is the engine's private core: only the `vovp` crate sends these messages
//! (through its `Session`, whoever the client is) and wires the actors together; the values
//! they exchange are `vovp-types`'.

#![warn(unreachable_pub, missing_debug_implementations)]

mod allocator;
mod answer;
mod block;
pub mod gpu;
mod lend_ledger;
mod memory_room;
mod pipelined;
mod segment;
mod shared_regions;
mod spill;
mod table;
pub mod table_actor;

pub use allocator::{
    reserved_bytes, AllocatorActor, SegmentAllocator, SegmentFor, SegmentGrant, Writer,
    RESIDENT_SLACK_PAGES,
};
pub use answer::{Answer, StoreFailure};
pub use memory_room::{available_memory, BACKING_MARGIN};
pub use segment::Segment;
pub use shared_regions::{SharedConfig, SharedFds};
pub use spill::SpillConfig;
