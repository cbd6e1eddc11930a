//! CUDA: `vovp.cuda`'s driver checks and copies, through the gpu crate.
//!
//! The driver is loaded at the first of these calls, never at import. Every call releases the
//! GIL around the driver (a copy of a large tensor takes milliseconds), and puts back the
//! thread's current CUDA context afterwards (the gpu crate does: torch's current device must not
//! change under the caller).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// Number of store pools this process has mapped through CUDA IPC (diagnostics and tests).
#[pyfunction]
fn open_pools() -> usize {
    vovp_gpu::ipc::open_pools()
}

/// The `vovp.errors` exception for a gpu-crate error raised on this side: `GpuUnavailable`
/// (status 10) for a missing driver or device, `GpuError` with status 0 (detected by this
/// client, not a daemon reply) for a failed driver call.
fn gpu_to_py(e: vovp_gpu::GpuError) -> PyErr {
    use vovp_gpu::GpuError as G;
    Python::with_gil(|py| {
        let made = (|| -> PyResult<PyErr> {
            let errors = py.import("vovp.errors")?;
            let exc = match e {
                G::GpuUnavailable(m) => errors.getattr("GpuUnavailable")?.call1((m, 10u8))?,
                G::Driver(m) => errors.getattr("GpuError")?.call1((m, 0u8))?,
                other => errors
                    .getattr("GpuError")?
                    .call1((other.to_string(), 0u8))?,
            };
            Ok(PyErr::from_value(exc))
        })();
        made.unwrap_or_else(|err| err)
    })
}

/// Runs `f` (driver calls) without the GIL, converting its error.
fn gpu<T: Send>(
    py: Python<'_>,
    f: impl FnOnce() -> Result<T, vovp_gpu::GpuError> + Send,
) -> PyResult<T> {
    py.allow_threads(f).map_err(gpu_to_py)
}

/// Number of devices the driver sees; GpuUnavailable(reason) without a usable driver (reason
/// computed once and cached), or in a process forked from one that used CUDA.
#[pyfunction]
fn cuda_device_count(py: Python<'_>) -> PyResult<u32> {
    gpu(py, vovp_gpu::device_count)
}

/// Ordinal of the device `ptr` points into (GpuError if it is not device memory).
#[pyfunction]
fn cuda_device_of(py: Python<'_>, ptr: u64) -> PyResult<u32> {
    gpu(py, || vovp_gpu::ipc::device_of(ptr))
}

/// Device-to-device copy of `nbytes` on a stream of cuda:`device`, synchronised.
#[pyfunction]
fn cuda_copy_d2d(py: Python<'_>, device: i64, dst: u64, src: u64, nbytes: usize) -> PyResult<()> {
    gpu(py, || {
        let d = vovp_gpu::check_device(device)?;
        vovp_gpu::ipc::copy_d2d_on(d, dst, src, nbytes)
    })
}

/// Refuses a null host address. The host buffers of the copies below are (address, size) pairs:
/// the buffer protocol is not in the stable ABI before Python 3.11. The caller (vovp.cuda)
/// keeps the Python buffer alive and unresized for the duration of the call.
fn check_host(addr: usize, nbytes: usize) -> PyResult<()> {
    if addr == 0 && nbytes > 0 {
        return Err(PyValueError::new_err("a host buffer at address 0"));
    }
    Ok(())
}

/// Host-to-device copy of the `nbytes` at host address `src` (see `check_host`), synchronised.
#[pyfunction]
fn cuda_copy_h2d(py: Python<'_>, device: i64, dst: u64, src: usize, nbytes: usize) -> PyResult<()> {
    check_host(src, nbytes)?;
    let (addr, n) = (src, nbytes);
    gpu(py, || {
        let d = vovp_gpu::check_device(device)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: vovp.cuda passes the address and size of a live C-contiguous buffer it holds
        // a reference to until this returns (the copy is synchronised before).
        let host = unsafe { std::slice::from_raw_parts(addr as *const u8, n) };
        vovp_gpu::ipc::copy_h2d_on(d, dst, host)
    })
}

/// Device-to-host copy into the `nbytes` at writable host address `dst`, synchronised.
#[pyfunction]
fn cuda_copy_d2h(py: Python<'_>, device: i64, dst: usize, src: u64, nbytes: usize) -> PyResult<()> {
    check_host(dst, nbytes)?;
    let (addr, n) = (dst, nbytes);
    gpu(py, || {
        let d = vovp_gpu::check_device(device)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: as in cuda_copy_h2d, and vovp.cuda checked the buffer is writable; nothing
        // else in this process writes it meanwhile (numpy's contract for a buffer handed out).
        let host = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, n) };
        vovp_gpu::ipc::copy_d2h_on(d, host, src)
    })
}

/// `cuMemAlloc` in cuda:`device`'s primary context (tests and tools).
#[pyfunction]
fn cuda_mem_alloc(py: Python<'_>, device: i64, nbytes: usize) -> PyResult<u64> {
    gpu(py, || {
        let d = vovp_gpu::check_device(device)?;
        vovp_gpu::ipc::mem_alloc(d, nbytes)
    })
}

/// `cuMemFree` of a `cuda_mem_alloc` buffer.
#[pyfunction]
fn cuda_mem_free(py: Python<'_>, device: i64, ptr: u64) -> PyResult<()> {
    gpu(py, || {
        let d = vovp_gpu::check_device(device)?;
        vovp_gpu::ipc::mem_free(d, ptr)
    })
}

/// Waits for a CUDA stream handle (1 = legacy default, 2 = per-thread default, other = CUstream).
#[pyfunction]
fn cuda_sync_stream(py: Python<'_>, stream: u64) -> PyResult<()> {
    gpu(py, || vovp_gpu::ipc::sync_stream(stream))
}

/// Test hook (`vovp.cuda._reset_for_tests`): act as if the driver library were looked up under
/// `names`; if none loads, every CUDA call answers GpuUnavailable with the missing-library
/// reason. `None` (or a name that loads) goes back to the process's real driver state.
#[pyfunction]
#[pyo3(signature = (names = None))]
fn _cuda_simulate_library_names(py: Python<'_>, names: Option<Vec<String>>) {
    py.allow_threads(|| vovp_gpu::simulate_library_names(names.as_deref()))
}

/// Registers the CUDA functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(open_pools, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_device_count, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_device_of, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_copy_d2d, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_copy_h2d, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_copy_d2h, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_mem_alloc, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_mem_free, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_sync_stream, m)?)?;
    m.add_function(wrap_pyfunction!(_cuda_simulate_library_names, m)?)?;
    Ok(())
}
