//! An `ask`'s outcome as the store's own result. The error type lives in `vovp-types`, which
//! knows nothing of kameo, so the conversion is a trait here rather than a `From` impl there.

use kameo::error::{Infallible, SendError};
use vovp_gpu::GpuError;
use vovp_types::Error;

/// A handler's error type that becomes a store [`Error`].
pub trait StoreFailure {
    fn into_error(self) -> Error;
}

impl StoreFailure for Error {
    fn into_error(self) -> Error {
        self
    }
}

impl StoreFailure for GpuError {
    fn into_error(self) -> Error {
        self.into()
    }
}

impl StoreFailure for Infallible {
    fn into_error(self) -> Error {
        match self {}
    }
}

/// `actor.ask(msg).await.answer()?`: the handler's error, or (mailbox closed, actor gone) the
/// store stopping.
pub trait Answer<T> {
    fn answer(self) -> Result<T, Error>;
}

impl<T, M, E: StoreFailure> Answer<T> for Result<T, SendError<M, E>> {
    fn answer(self) -> Result<T, Error> {
        self.map_err(|e| match e {
            SendError::HandlerError(e) => e.into_error(),
            _ => Error::ShuttingDown,
        })
    }
}
