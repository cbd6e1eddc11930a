//! Rust errors as `vovp.errors` exceptions (the classes the pure-Python client raised).

use pyo3::prelude::*;
use vovp_types::Error;

/// Protocol status code of an error (PROTOCOL.md "Status codes"), for `vovp.errors`: the
/// code the daemon would answer it with.
pub(crate) fn status_of(e: &Error) -> u8 {
    vovp_proto::Failure::from_error(e).status.code()
}

/// The `vovp.errors` exception for `e`: the same classes the pure-Python client raised.
pub(crate) fn to_py(e: Error) -> PyErr {
    Python::with_gil(|py| {
        let made = (|| -> PyResult<PyErr> {
            let errors = py.import("vovp.errors")?;
            // Errors decoded from a reply carry the daemon's own message: pass it on as is
            // (Display would wrap it in a second description).
            let message = match &e {
                Error::NotFound(m)
                | Error::AlreadyExists(m)
                | Error::NotSealed(m)
                | Error::AlreadySealed(m)
                | Error::NotCreator(m)
                | Error::InvalidName(m)
                | Error::GpuUnavailable(m)
                | Error::Gpu(m)
                | Error::Protocol(m)
                | Error::TooLarge(m)
                | Error::Transfer(m)
                | Error::SpillDamaged(m)
                | Error::Internal(m) => m.clone(),
                other => other.to_string(),
            };
            let exc = match &e {
                // Status 20 means "too many connections" on the wire; a lost connection is a
                // ConnectionError without a status.
                Error::Connection(_) => errors.getattr("ConnectionError")?.call1((message,))?,
                Error::Memory(_) | Error::Config(_) | Error::Tensor(_) => {
                    errors.getattr("VovpError")?.call1((message,))?
                }
                Error::OutOfMemory {
                    requested,
                    available,
                } => errors
                    .getattr("error_from_status")?
                    .call1((3u8, message, *requested, *available))?,
                Error::StaleVersion {
                    current, requested, ..
                } => errors.getattr("error_from_status")?.call1((
                    status_of(&e),
                    message,
                    *current,
                    *requested,
                ))?,
                other => errors
                    .getattr("error_from_status")?
                    .call1((status_of(other), message))?,
            };
            Ok(PyErr::from_value(exc))
        })();
        made.unwrap_or_else(|err| err)
    })
}
