//! The store's one error type, `vovp::Error`: every failure of the store, embedded or remote,
//! and of its clients. It lives at the bottom of the crate graph so that the actors produce the
//! same values the public API hands out and the clients decode (no second, drifting copy).

/// Errors of vovp. Each message says what the caller can do about it; store-side errors keep
/// their meaning whether the store is embedded or reached over the socket.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
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
    /// The raw object id (0 when the store did not say which, as over the wire).
    #[error("object id {0} is not held by this client (already released?)")]
    NotHeld(u64),
    #[error("GPU unavailable: {0}")]
    GpuUnavailable(String),
    #[error("GPU error: {0}")]
    Gpu(String),
    /// Shared memory: creating, sizing or mapping a segment.
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
    /// A spilled object could not be read back from its spill file (damaged, truncated or
    /// removed): the text names the object and what was wrong. The object is gone; its bytes
    /// were never handed out.
    #[error("spilled object lost: {0}")]
    SpillDamaged(String),
    /// A transfer between engines (FETCH, GATHER) failed: the holder refused the ticket, died
    /// or stopped sending, the bytes did not match what it announced, or the transfer port
    /// could not be reached. Nothing of a failed fetch is visible.
    #[error("transfer: {0}")]
    Transfer(String),
    /// A put or seal asked for an explicit version ([`crate::PutOptions::version`]) that is
    /// not above the name's present one: a newer version is there already.
    #[error(
        "object {name:?} is at version {current} already; version {requested} is stale \
         (an explicit version must be above the present one)"
    )]
    StaleVersion {
        name: String,
        current: u64,
        requested: u64,
    },
}
