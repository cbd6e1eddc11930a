//! `vovp::Error`: every failure of the public API, embedded or remote.

use vovp_actors::StoreError;
use vovp_gpu::GpuError;

/// Errors of the vovp API. Store-side errors keep their meaning whether the store is embedded or
/// reached over the socket.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    #[error("object {0:?} not found")]
    NotFound(String),
    #[error("object {0:?} already exists; delete it first or use another name")]
    AlreadyExists(String),
    #[error(
        "out of memory: requested {requested} bytes, only {available} bytes can be freed \
         (the rest is held by referenced or unsealed objects)"
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
    #[error("object id {0} is not held (already released?)")]
    NotHeld(u64),
    #[error("GPU unavailable: {0}")]
    GpuUnavailable(String),
    #[error("GPU error: {0}")]
    Gpu(String),
    #[error("shared memory: {0}")]
    Memory(String),
    #[error("the store is shutting down")]
    ShuttingDown,
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("tensor: {0}")]
    Tensor(String),
    #[error("connection to the store: {0}")]
    Connection(String),
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("request too large: {0}")]
    TooLarge(String),
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<StoreError> for Error {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::NotFound(n) => Error::NotFound(n),
            StoreError::AlreadyExists(n) => Error::AlreadyExists(n),
            StoreError::OutOfMemory {
                requested,
                available,
            } => Error::OutOfMemory {
                requested,
                available,
            },
            StoreError::TooManyObjects { limit } => Error::TooManyObjects { limit },
            StoreError::NotSealed(n) => Error::NotSealed(n),
            StoreError::AlreadySealed(n) => Error::AlreadySealed(n),
            StoreError::NotCreator(n) => Error::NotCreator(n),
            StoreError::InvalidName(n) => Error::InvalidName(n),
            StoreError::MetadataTooLarge { len, max } => Error::MetadataTooLarge { len, max },
            StoreError::NotHeld(id) => Error::NotHeld(id),
            StoreError::Gpu(g) => g.into(),
            StoreError::Segment(s) => Error::Memory(s),
            StoreError::ShuttingDown => Error::ShuttingDown,
        }
    }
}

impl From<GpuError> for Error {
    fn from(e: GpuError) -> Self {
        match e {
            GpuError::GpuUnavailable(r) => Error::GpuUnavailable(r),
            GpuError::OutOfMemory {
                requested,
                available,
                ..
            } => Error::OutOfMemory {
                requested,
                available,
            },
            other => Error::Gpu(other.to_string()),
        }
    }
}

impl<M, E: Into<Error>> From<kameo::error::SendError<M, E>> for Error {
    fn from(e: kameo::error::SendError<M, E>) -> Self {
        match e {
            kameo::error::SendError::HandlerError(e) => e.into(),
            _ => Error::ShuttingDown,
        }
    }
}

impl From<kameo::error::Infallible> for Error {
    fn from(_: kameo::error::Infallible) -> Self {
        Error::Internal("infallible".into())
    }
}
