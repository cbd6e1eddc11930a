//! `vovp._native`: the Python package's native core, a thin PyO3 layer over the Rust client
//! (`vovp_client::Client`): connect/HELLO, requests and replies, fd passing, segment
//! mappings, request ids, deferred releases and reconnect are the Rust client's, not a third
//! implementation of PROTOCOL.md.
//!
//! Objects come back as [`views::Object`] (a sealed object's view) or [`views::Buffer`] (an
//! unsealed object its creator writes). Both export their bytes to numpy (`__array_struct__`,
//! and the `__array_interface__` dict for other readers of that protocol; see [`array`]), so
//! `numpy.asarray(obj)` is a zero-copy view of the shared mapping whose `.base` is `obj`: the
//! store reference lives exactly as long as some array over it does, and is released (by the
//! Rust view's `Drop`) when the last one goes. The buffer protocol would do the same but is not
//! in the stable ABI before Python 3.11, and this module is built once for every CPython >= 3.9
//! (abi3).
//!
//! Every call that waits on the socket or copies bytes releases the GIL.
//!
//! Modules: [`client`] (the connection and its requests), [`put`] (the one put's options and
//! outcome), [`views`] (objects handed out), [`content_hash`] (state dicts' tensor hashes),
//! [`array`] (numpy's protocols), [`subscription`] (notification streams), [`tensor`] (the
//! tensor header, through the engine's `TensorMeta`), [`cuda`] (driver calls), [`errors`]
//! (Rust errors as `vovp.errors` exceptions), [`process`] (fork detection).

use pyo3::prelude::*;

mod array;
mod client;
mod content_hash;
mod cuda;
mod errors;
mod process;
mod put;
mod subscription;
mod tensor;
mod views;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    process::count_forks()?;
    cuda::register(m)?;
    tensor::register(m)?;
    content_hash::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // Objects up to this size go through one PUT frame (the Rust client's choice, which the
    // Python layer makes too).
    m.add("INLINE_LIMIT", vovp_types::CLIENT_INLINE_PUT)?;
    m.add_function(wrap_pyfunction!(array::copy_bytes, m)?)?;
    m.add_class::<client::Client>()?;
    m.add_class::<put::PyPutOptions>()?;
    m.add_class::<views::Object>()?;
    m.add_class::<views::Buffer>()?;
    m.add_class::<subscription::PySubscription>()?;
    Ok(())
}
