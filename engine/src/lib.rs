//! vovp: a shared-memory tensor store. One process puts a tensor under a name; any process on
//! the machine gets the same memory back by name alone, zero-copy.
//!
//! This crate is the public API: [`Engine::spawn`] embeds the store in-process, [`Session`] is
//! one holder's raw operations (the daemon runs one per connection), [`Store`] /
//! [`AsyncStore`] are the operations (also implemented by the socket client in
//! `vovp-client`), [`tensor`] carries dtype/shape with each object.

mod config;
mod engine;
mod limits;
pub mod memory_room;
mod session;
mod shared_reads;
mod store;
pub mod tensor;
mod view;

pub use config::{parse_size, Config};
pub use engine::{Engine, EngineHandle};
pub use limits::{CLIENT_INLINE_PUT, INLINE_PUT_LIMIT, MAX_INLINE_PUT};
pub use session::{PutOptions, Session, Subscription};
pub use store::{AsyncStore, Store};
pub use tensor::{DType, Tensor, TensorMeta, TensorView};
pub use view::{ObjectBuffer, ObjectSink, ObjectView};
/// The arithmetic of lends (LEND / PUBLISH), the same for the store and its clients.
pub mod lends {
    pub use vovp_actors::lends::{block_len, lend_size, max_object};
}
pub use vovp_actors::allocator::SegmentGrant;
pub use vovp_actors::copy::parallel_copy;
pub use vovp_actors::segment::Segment;
pub use vovp_actors::shared::SharedFds;
/// The one error type of vovp (the store's and its clients'), defined with the actors so the
/// store produces these values itself.
pub use vovp_actors::Error;
pub use vovp_actors::{
    check_metadata, CreateOptions, Device, HolderId, Lend, Location, Notification,
    NotificationKind, ObjectId, ObjectInfo, ObjectName, ObjectRef, StoreStats, ALIGNMENT,
    MAX_METADATA_LEN, MAX_NAME_LEN, MAX_OBJECTS,
};
pub use vovp_gpu::{DeviceBlock, GpuConfig};
