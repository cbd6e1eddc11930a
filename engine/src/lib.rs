//! vovp: a shared-memory tensor store. One process puts a tensor under a name; any process on
//! the machine gets the same memory back by name alone, zero-copy.
//!
//! This crate is the public API: [`Engine::spawn`] embeds the store in-process, [`Store`] /
//! [`AsyncStore`] are the operations (also implemented by the socket client in
//! `vovp-client`), [`tensor`] carries dtype/shape with each object.

mod config;
mod engine;
mod error;
pub mod memory_room;
mod store;
pub mod tensor;
mod view;

pub use config::{parse_size, Config};
pub use engine::{Engine, EngineActors, EngineHandle, INLINE_PUT_LIMIT};
pub use error::Error;
pub use store::{AsyncStore, Store};
pub use tensor::{DType, Tensor, TensorMeta, TensorView};
pub use view::{ObjectBuffer, ObjectSink, ObjectView};
pub use vovp_actors::copy::parallel_copy;
pub use vovp_actors::{
    CreateOptions, Device, HolderId, Location, Notification, NotificationKind, ObjectId,
    ObjectInfo, ObjectName, ObjectRef, StoreStats, ALIGNMENT, MAX_METADATA_LEN, MAX_NAME_LEN,
    MAX_OBJECTS,
};
pub use vovp_gpu::{DeviceBlock, GpuConfig};
