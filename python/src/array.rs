//! numpy's array protocols over an object's bytes: what makes `numpy.asarray(obj)` a zero-copy
//! view whose `.base` is the native object (so the store reference lives as long as the array).

use std::ffi::{c_char, c_int, c_void};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict, PyTuple};

/// `__array_interface__` of `size` bytes at `ptr` (a 1-D uint8 array).
pub(crate) fn array_interface<'py>(
    py: Python<'py>,
    ptr: usize,
    size: u64,
    readonly: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("version", 3)?;
    d.set_item("typestr", "|u1")?;
    d.set_item("shape", PyTuple::new(py, [size])?)?;
    // numpy refuses a NULL data pointer even for 0 bytes; any aligned non-null address does.
    let ptr = if ptr == 0 { 64 } else { ptr };
    d.set_item("data", (ptr, readonly))?;
    Ok(d)
}

/// `__array_struct__` of `size` bytes at `ptr` (a 1-D uint8 array): numpy's C-level
/// `PyArrayInterface` in a capsule. numpy asks for it before `__array_interface__`, and it
/// costs neither a dict of four Python objects nor numpy's parsing of one: about half of a
/// Python get's time went to that.
pub(crate) fn array_struct(
    py: Python<'_>,
    ptr: usize,
    size: u64,
    readonly: bool,
) -> PyResult<Bound<'_, PyCapsule>> {
    // numpy's flags (ndarraytypes.h).
    const C_CONTIGUOUS: i32 = 0x1;
    const ALIGNED: i32 = 0x100;
    const NOTSWAPPED: i32 = 0x200;
    const WRITEABLE: i32 = 0x400;
    if ptr == 0 && size != 0 {
        return Err(PyValueError::new_err("no host address to export"));
    }
    let shape = isize::try_from(size).map_err(|_| PyValueError::new_err("object too large"))?;
    let flags = C_CONTIGUOUS | ALIGNED | NOTSWAPPED | if readonly { 0 } else { WRITEABLE };
    let value = ArrayStruct {
        interface: PyArrayInterface {
            two: 2,
            nd: 1,
            typekind: b'u' as c_char,
            itemsize: 1,
            flags,
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            // For NULL numpy would allocate a buffer of its own; for 0 bytes any aligned
            // non-null address stands in.
            data: (if ptr == 0 { 64 } else { ptr }) as *mut c_void,
            descr: std::ptr::null_mut(),
        },
        shape,
    };
    let capsule = PyCapsule::new_with_destructor(py, value, None, |_, _| {})?;
    // The value lives boxed at a fixed address inside the capsule: point `shape` at its own
    // field (numpy reads it while it builds the array, with the capsule alive).
    let inside = capsule.pointer().cast::<ArrayStruct>();
    // SAFETY: `inside` is the capsule's boxed ArrayStruct (PyO3 stores the value first, at the
    // pointer it registers), alive as long as `capsule`; nothing else refers to it yet.
    unsafe { (*inside).interface.shape = std::ptr::addr_of_mut!((*inside).shape) };
    Ok(capsule)
}

/// numpy's `PyArrayInterface` (the `__array_struct__` protocol), field for field.
#[repr(C)]
struct PyArrayInterface {
    two: c_int,
    nd: c_int,
    typekind: c_char,
    itemsize: c_int,
    flags: c_int,
    shape: *mut isize,
    strides: *mut isize,
    data: *mut c_void,
    descr: *mut c_void,
}

/// A `PyArrayInterface` with the storage of its one dimension.
#[repr(C)]
struct ArrayStruct {
    interface: PyArrayInterface,
    shape: isize,
}

// SAFETY: the pointers are plain addresses numpy reads under the GIL; nothing is shared
// mutably across threads through them.
unsafe impl Send for ArrayStruct {}
