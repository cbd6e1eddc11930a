//! Content hashes for `vovp.cluster`'s state dicts (`vovp_shm::content_hash`): a copy into the
//! store that hashes in the same pass, and a hash alone, both with the GIL released.

use pyo3::prelude::*;

use crate::array::{copy_pair, plain_bytes, writable_bytes};

/// `dst[...] = src` byte for byte (two C-contiguous arrays of equal byte length, `dst`
/// writable, not overlapping) and the content hash of the bytes, computed in the copy's
/// pass; the copy split across the copy pool as `copy_bytes`'s. ValueError when they overlap.
#[pyfunction]
pub(crate) fn copy_hashed(
    py: Python<'_>,
    dst: &Bound<'_, PyAny>,
    src: &Bound<'_, PyAny>,
) -> PyResult<u64> {
    let Some((to, src)) = copy_pair(dst, src)? else {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "copy_hashed: the arrays overlap",
        ));
    };
    // SAFETY: `copy_pair`'s: `to` is `dst`'s `src.len()` writable bytes, not overlapping
    // `src`; `dst` stays borrowed (alive, unresized) for this call.
    let dst = unsafe { to.slice() };
    Ok(py.allow_threads(|| vovp_shm::content_hash::copy_hashed(dst, src)))
}

/// Copies each `srcs[i]` (C-contiguous arrays) into `dst[offsets[i]..]` (a writable
/// C-contiguous array) byte for byte and returns each one's content hash: one job over the
/// copy pool for all of them, without the GIL. ValueError when one does not fit in `dst`,
/// two overlap there, or a source overlaps `dst`.
#[pyfunction]
pub(crate) fn copy_hashed_many(
    py: Python<'_>,
    dst: &Bound<'_, PyAny>,
    offsets: Vec<usize>,
    srcs: Vec<Bound<'_, PyAny>>,
) -> PyResult<Vec<u64>> {
    use pyo3::exceptions::PyValueError;
    if offsets.len() != srcs.len() {
        return Err(PyValueError::new_err(
            "copy_hashed_many: one offset per source",
        ));
    }
    let to = writable_bytes(dst)?;
    let (lo, hi) = (to.addr, to.addr + to.len);
    let mut items = Vec::with_capacity(srcs.len());
    let mut spans = Vec::with_capacity(srcs.len());
    for (offset, src) in offsets.iter().zip(&srcs) {
        let bytes = plain_bytes(src)?;
        let (at, len) = (bytes.as_ptr() as usize, bytes.len());
        if offset.checked_add(len).is_none_or(|end| end > to.len) {
            return Err(PyValueError::new_err(format!(
                "copy_hashed_many: {len} bytes at {offset} past the destination's {}",
                to.len
            )));
        }
        if len > 0 && at < hi && lo < at + len {
            return Err(PyValueError::new_err(
                "copy_hashed_many: a source overlaps the destination",
            ));
        }
        spans.push((*offset, len));
        items.push((*offset, bytes));
    }
    spans.sort_unstable();
    if spans.windows(2).any(|p| p[0].0 + p[0].1 > p[1].0) {
        return Err(PyValueError::new_err(
            "copy_hashed_many: two sources overlap in the destination",
        ));
    }
    // SAFETY: `dst`'s writable bytes, which no source overlaps (checked above); `dst` stays
    // borrowed (alive, unresized) for this call.
    let target = unsafe { to.slice() };
    Ok(py.allow_threads(|| vovp_shm::content_hash::copy_hashed_many(target, &items)))
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
    m.add_function(wrap_pyfunction!(copy_hashed_many, m)?)?;
    m.add("CONTENT_HASH_BLOCK", vovp_shm::content_hash::HASH_BLOCK)?;
    Ok(())
}
