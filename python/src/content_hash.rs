//! Content hashes for `vovp.cluster`'s state dicts (`vovp_shm::content_hash`): a copy into the
//! store that hashes in the same pass, and a hash alone, both with the GIL released.

use pyo3::prelude::*;

use crate::array::{copy_pair, plain_bytes};

/// `dst[...] = src` byte for byte (two C-contiguous arrays of equal byte length, `dst`
/// writable, not overlapping) and the content hash of the bytes, computed in the copy's
/// pass; the copy split across the copy pool as `copy_bytes`'s. ValueError when they overlap.
#[pyfunction]
pub(crate) fn copy_hashed(
    py: Python<'_>,
    dst: &Bound<'_, PyAny>,
    src: &Bound<'_, PyAny>,
) -> PyResult<u64> {
    let Some((dst, src)) = copy_pair(dst, src)? else {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "copy_hashed: the arrays overlap",
        ));
    };
    Ok(py.allow_threads(|| vovp_shm::content_hash::copy_hashed(dst, src)))
}

/// The content hash of C-contiguous array `src`'s bytes.
#[pyfunction]
pub(crate) fn content_hash(py: Python<'_>, src: &Bound<'_, PyAny>) -> PyResult<u64> {
    let bytes = plain_bytes(src)?;
    Ok(py.allow_threads(|| vovp_shm::content_hash::hash(bytes)))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(copy_hashed, m)?)?;
    m.add_function(wrap_pyfunction!(content_hash, m)?)?;
    m.add("CONTENT_HASH_BLOCK", vovp_shm::content_hash::HASH_BLOCK)?;
    Ok(())
}
