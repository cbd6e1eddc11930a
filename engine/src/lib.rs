//! vovp: a shared-memory tensor store. One process puts a tensor under a name; any process on
//! the machine gets the same memory back by name alone, zero-copy.
//!
//! This crate is the embedded store and the public API: [`Engine::spawn`] embeds the store
//! in-process, [`Session`] is one holder's raw operations (the daemon runs one per connection),
//! [`Store`] / [`AsyncStore`] are the operations (also implemented by the socket client in
//! `vovp-client`), [`tensor`] carries dtype/shape with each object. The vocabulary (ids,
//! [`Error`], views, the traits) is `vovp-types`', re-exported here whole.
//!
//! ```
//! use vovp::{Config, Engine, Store};
//!
//! let store = Engine::spawn(Config::with_capacity(64 << 20))?;
//! store.put("greeting", b"hello", b"", Default::default())?;
//! let view = store.get_one("greeting", None)?;
//! assert_eq!(&view[..], b"hello");
//! # Ok::<(), vovp::Error>(())
//! ```

#![warn(unreachable_pub, missing_debug_implementations)]

mod config;
mod core;
mod engine;
mod session;
mod shared_reads;

pub use config::{parse_size, Config, SpillConfig};
pub use engine::{Engine, EngineHandle};
pub use session::{LentObject, Notifications, Session};
pub use vovp_types::*;

pub use vovp_actors::gpu::{parse_gpu_memory, GpuConfig};
pub use vovp_actors::Segment;
pub use vovp_actors::SegmentGrant;
pub use vovp_actors::SharedFds;
pub use vovp_actors::{available_memory, BACKING_MARGIN};
pub use vovp_gpu::CudaStore;
pub use vovp_shm::copy::parallel_copy;
