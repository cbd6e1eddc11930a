//! How much memory this machine can really back (the check lives with the allocator in
//! `vovp_actors::memory_room`, which also checks every create): re-exported for the start-time
//! check and for callers that want the same figure.

pub use vovp_actors::memory_room::{available_memory, BACKING_MARGIN};
