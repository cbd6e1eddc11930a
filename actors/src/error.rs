//! The store's one error type: every failure a client can cause or observe.

use vovp_gpu::GpuError;

/// Errors of the object store. Each message says what the caller can do about it.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum StoreError {
    #[error("object {0:?} not found")]
    NotFound(String),
    #[error("object {0:?} already exists; delete it first or use another name")]
    AlreadyExists(String),
    #[error(
        "out of memory: requested {requested} bytes, only {available} bytes can be freed \
         (every other byte is held by a referenced or unsealed object)"
    )]
    OutOfMemory { requested: u64, available: u64 },
    #[error(
        "too many objects: the store holds at most {limit} objects and none of them can be \
         evicted (delete or release some)"
    )]
    TooManyObjects { limit: u64 },
    #[error("object {0:?} is not sealed yet; seal or abort it first")]
    NotSealed(String),
    #[error("object {0:?} is already sealed and immutable")]
    AlreadySealed(String),
    #[error("object {0:?} was created by another client; only its creator may seal or abort it")]
    NotCreator(String),
    #[error("invalid object name: {0}")]
    InvalidName(String),
    #[error("metadata is {len} bytes; the limit is {max}")]
    MetadataTooLarge { len: usize, max: usize },
    #[error("object id {0} is not held by this client (already released?)")]
    NotHeld(u64),
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error("shared memory segment: {0}")]
    Segment(String),
    #[error("the store is shutting down")]
    ShuttingDown,
}
