//! vovp's vocabulary: the words the store, the wire protocol and every client share, and
//! nothing that does I/O. Everything else in the workspace builds on this crate; it builds on
//! nothing of vovp's.
//!
//! * [`object`](crate::ObjectRef): ids, names, where an object lives ([`Location`]) and what a
//!   get, `list`, `stats` and a subscription hand back;
//! * [`StoreMetrics`]: what the store did and who holds what, for the daemon's metrics;
//! * [`put`]: what a put or a create asks for ([`PutOptions`]) and which way a put goes
//!   ([`put::route`]), decided once for every client and the embedded engine;
//! * [`Error`]: the one error type of the store and its clients;
//! * [`tensor`]: the tensor header (dtype, shape, device) stored as each object's metadata;
//! * [`ObjectView`] / [`ObjectBuffer`]: zero-copy handles that release on drop, through an
//!   [`ObjectSink`] the engine or a client provides;
//! * [`Store`] / [`AsyncStore`]: the one API, embedded or remote;
//! * the limits, every one defined once in `limits` ([`MAX_INLINE_PUT`], [`lends`], [`wire`], [`transfer`],
//!   ...).
//!
//! ```
//! use vovp_types::tensor::{DType, TensorMeta};
//! use vovp_types::Device;
//!
//! let meta = TensorMeta { dtype: DType::F32, shape: vec![2, 3], device: Device::Cpu, little_endian: true };
//! assert_eq!(meta.nbytes(), 24);
//! assert_eq!(TensorMeta::decode(&meta.encode()).unwrap(), meta);
//! ```

#![warn(unreachable_pub, missing_debug_implementations)]

mod activity;
mod error;
mod limits;
mod object;
pub mod put;
mod store;
pub mod tensor;
mod view;

pub use activity::{Counted, HolderUsage, StoreActivity, StoreMetrics};
pub use error::Error;
pub use limits::{
    lends, transfer, wire, CLIENT_INLINE_PUT, INLINE_PUT_LIMIT, MAX_INLINE_PUT, MAX_METADATA_LEN,
    MAX_NAME_LEN, MAX_OBJECTS,
};
pub use object::*;
pub use put::{PutOptions, PutPaths, Route};
pub use store::{AsyncStore, Store};
pub use tensor::{DType, Tensor, TensorMeta, TensorView};
pub use view::{Mapped, ObjectBuffer, ObjectSink, ObjectView};
