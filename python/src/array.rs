//! numpy's array protocols over an object's bytes: what makes `numpy.asarray(obj)` a zero-copy
//! view whose `.base` is the native object (so the store reference lives as long as the array).
//!
//! The package's own hot paths skip numpy's side of that protocol: [`new_array`] makes the
//! same array through numpy's C API (`PyArray_DescrFromType`, `PyArray_NewFromDescr`,
//! `PyArray_SetBaseObject`, reached through the `numpy` crate's `npyffi`), one call where
//! `numpy.asarray` of an object of another type spends ~0.7 µs discovering what it is (a
//! tenth of a 64 B `put_tensor`). Where that table cannot be loaded, callers fall back on
//! `numpy.asarray`.

use std::ffi::{c_char, c_int, c_long, c_void};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyCapsule, PyDict, PyTuple};
use pyo3::{ffi, intern};

use numpy::npyffi::{
    npy_intp, NpyTypes, NPY_ARRAY_C_CONTIGUOUS, NPY_ARRAY_WRITEABLE, NPY_TYPES, PY_ARRAY_API,
};
use vovp_types::DType;

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

/// How an object's bytes are shown to numpy: a 1-D uint8 array (the default), or a typed
/// array (a tensor's dtype and shape, set by the Python layer from the tensor header, so that
/// `numpy.asarray(obj)` is the result itself, not a uint8 array viewed and reshaped).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    /// numpy's type kind ('f', 'i', 'u', 'b', 'c') and item size in bytes.
    pub(crate) kind: u8,
    pub(crate) itemsize: u32,
    pub(crate) shape: Vec<isize>,
}

/// The most dimensions a layout may have (numpy 1.x's `NPY_MAXDIMS`).
const MAX_DIMS: usize = 32;

impl Layout {
    /// `kind`/`itemsize`/`shape` as a layout of exactly `size` bytes; ValueError otherwise
    /// (a layout larger than the object would let numpy read past it).
    pub(crate) fn checked(kind: u8, itemsize: u32, shape: Vec<isize>, size: u64) -> PyResult<Self> {
        let bytes = shape.iter().try_fold(u64::from(itemsize), |acc, &d| {
            u64::try_from(d).ok().and_then(|d| acc.checked_mul(d))
        });
        if !b"fiubc".contains(&kind) || itemsize == 0 || shape.len() > MAX_DIMS {
            return Err(PyValueError::new_err(format!(
                "not an array layout: kind {:?}, itemsize {itemsize}, {} dimensions",
                kind as char,
                shape.len()
            )));
        }
        if bytes != Some(size) {
            return Err(PyValueError::new_err(format!(
                "a layout of {shape:?} x {itemsize} bytes does not fit an object of {size} bytes"
            )));
        }
        Ok(Layout {
            kind,
            itemsize,
            shape,
        })
    }

    /// [`Layout::checked`] with the kind as Python gives it (numpy's `dtype.kind`, a
    /// one-letter string).
    pub(crate) fn of_kind(
        kind: &str,
        itemsize: u32,
        shape: Vec<isize>,
        size: u64,
    ) -> PyResult<Self> {
        let kind = match kind.as_bytes() {
            [k] => *k,
            _ => 0,
        };
        Self::checked(kind, itemsize, shape, size)
    }
}

/// `__array_struct__` of `size` bytes at `ptr`, as a 1-D uint8 array or with `layout`:
/// numpy's C-level `PyArrayInterface` in a capsule. numpy asks for it before
/// `__array_interface__`, and it costs neither a dict of four Python objects nor numpy's
/// parsing of one: about half of a Python get's time went to that.
pub(crate) fn array_struct<'py>(
    py: Python<'py>,
    ptr: usize,
    size: u64,
    layout: Option<&Layout>,
    readonly: bool,
) -> PyResult<Bound<'py, PyCapsule>> {
    // numpy's flags (ndarraytypes.h).
    const C_CONTIGUOUS: i32 = 0x1;
    const ALIGNED: i32 = 0x100;
    const NOTSWAPPED: i32 = 0x200;
    const WRITEABLE: i32 = 0x400;
    if ptr == 0 && size != 0 {
        return Err(PyValueError::new_err("no host address to export"));
    }
    let one = isize::try_from(size).map_err(|_| PyValueError::new_err("object too large"))?;
    let (kind, itemsize, dims) = match layout {
        Some(l) => (l.kind, l.itemsize as c_int, &l.shape[..]),
        None => (b'u', 1, std::slice::from_ref(&one)),
    };
    let mut shape = [0isize; MAX_DIMS];
    shape[..dims.len()].copy_from_slice(dims);
    let flags = C_CONTIGUOUS | ALIGNED | NOTSWAPPED | if readonly { 0 } else { WRITEABLE };
    let value = ArrayStruct {
        interface: PyArrayInterface {
            two: 2,
            nd: dims.len() as c_int,
            typekind: kind as c_char,
            itemsize,
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
    unsafe { (*inside).interface.shape = std::ptr::addr_of_mut!((*inside).shape).cast() };
    Ok(capsule)
}

/// Whether numpy's C API can be used here: numpy imports (the `numpy` crate's
/// `PY_ARRAY_API` panics where it does not, and then callers fall back on `numpy.asarray`,
/// which raises the import error as a Python exception).
static NUMPY_LOADED: GILOnceCell<bool> = GILOnceCell::new();

fn numpy_loaded(py: Python<'_>) -> bool {
    *NUMPY_LOADED.get_or_init(py, || py.import("numpy").is_ok())
}

/// numpy's type number of a layout's kind and item size: the dtype that `numpy.asarray`
/// reads from the same `__array_struct__` (64-bit integers are C `long` where that has 64
/// bits, as numpy's `int64` is there).
fn type_number(kind: u8, itemsize: u32) -> Option<c_int> {
    use NPY_TYPES::*;
    let long64 = std::mem::size_of::<c_long>() == 8;
    let t = match (kind, itemsize) {
        (b'b', 1) => NPY_BOOL,
        (b'i', 1) => NPY_BYTE,
        (b'u', 1) => NPY_UBYTE,
        (b'i', 2) => NPY_SHORT,
        (b'u', 2) => NPY_USHORT,
        (b'i', 4) => NPY_INT,
        (b'u', 4) => NPY_UINT,
        (b'i', 8) if long64 => NPY_LONG,
        (b'i', 8) => NPY_LONGLONG,
        (b'u', 8) if long64 => NPY_ULONG,
        (b'u', 8) => NPY_ULONGLONG,
        (b'f', 4) => NPY_FLOAT,
        (b'f', 8) => NPY_DOUBLE,
        (b'c', 8) => NPY_CFLOAT,
        (b'c', 16) => NPY_CDOUBLE,
        (b'f', 2) => NPY_HALF,
        _ => return None,
    };
    Some(t as c_int)
}

/// The array `numpy.asarray(base)` makes of `base`'s `__array_struct__` ([`array_struct`] of
/// the same arguments), `.base` `base`, made through numpy's C API; `numpy.asarray(base)`
/// itself where that API is not loaded or has no dtype of the layout's.
pub(crate) fn new_array<'py>(
    base: &Bound<'py, PyAny>,
    ptr: usize,
    size: u64,
    layout: Option<&Layout>,
    readonly: bool,
) -> PyResult<Bound<'py, PyAny>> {
    // numpy works out contiguity and alignment itself from the flags.
    let py = base.py();
    if ptr == 0 && size != 0 {
        return Err(PyValueError::new_err("no host address to export"));
    }
    let one = isize::try_from(size).map_err(|_| PyValueError::new_err("object too large"))?;
    let (kind, itemsize, dims) = match layout {
        Some(l) => (l.kind, l.itemsize, &l.shape[..]),
        None => (b'u', 1, std::slice::from_ref(&one)),
    };
    let Some(type_number) = type_number(kind, itemsize).filter(|_| numpy_loaded(py)) else {
        return py
            .import(intern!(py, "numpy"))?
            .call_method1(intern!(py, "asarray"), (base,));
    };
    let data = (if ptr == 0 { 64 } else { ptr }) as *mut c_void;
    let flags = NPY_ARRAY_C_CONTIGUOUS | if readonly { 0 } else { NPY_ARRAY_WRITEABLE };
    let mut dims: Vec<npy_intp> = dims.to_vec();
    // SAFETY: numpy's documented calls through the `numpy` crate's table, with the GIL held
    // and numpy imported: `PyArray_NewFromDescr` steals the descriptor's reference and views
    // `data` (the caller's object's `size` bytes, kept alive by `base`) as `dims` of the
    // descriptor's type, C order; `PyArray_SetBaseObject` steals the reference to `base`
    // taken just before it, on failure too.
    unsafe {
        let descr = PY_ARRAY_API.PyArray_DescrFromType(py, type_number);
        if descr.is_null() {
            return Err(PyErr::fetch(py));
        }
        let arr = PY_ARRAY_API.PyArray_NewFromDescr(
            py,
            PY_ARRAY_API.get_type_object(py, NpyTypes::PyArray_Type),
            descr,
            dims.len() as c_int,
            dims.as_mut_ptr(),
            std::ptr::null_mut(),
            data,
            flags,
            std::ptr::null_mut(),
        );
        let arr = Bound::from_owned_ptr_or_err(py, arr)?;
        ffi::Py_IncRef(base.as_ptr());
        if PY_ARRAY_API.PyArray_SetBaseObject(py, arr.as_ptr().cast(), base.as_ptr()) < 0 {
            return Err(PyErr::fetch(py));
        }
        Ok(arr)
    }
}

/// The bytes of the C-contiguous array `src` to put (see [`contiguous_bytes`]), and the layout
/// its result is shown with when `layout` ((kind, itemsize, shape): exactly those bytes) is
/// given.
pub(crate) fn source_with_layout<'a>(
    src: &'a Bound<'_, PyAny>,
    layout: Option<(String, u32, Vec<isize>)>,
) -> PyResult<(&'a [u8], Option<Layout>)> {
    let (addr, size) = contiguous_bytes(src)?;
    let layout = match layout {
        Some((kind, itemsize, shape)) => {
            Some(Layout::of_kind(&kind, itemsize, shape, size as u64)?)
        }
        None => None,
    };
    Ok((exported_bytes(src, addr, size), layout))
}

/// The `len` bytes at `addr` that array `src` exports (read from its `__array_struct__`), as
/// a slice borrowed with `src`.
fn exported_bytes<'a>(_src: &'a Bound<'_, PyAny>, addr: usize, len: usize) -> &'a [u8] {
    if len == 0 {
        return &[];
    }
    // SAFETY: `src`, borrowed for `'a`, exports `len` contiguous bytes at `addr` (its
    // `__array_struct__`, read by the caller); the caller does not resize or free it while
    // it puts them.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
}

/// The bytes of a C-contiguous array `src` (numpy's, or anything with `__array_struct__`):
/// (address, length), read from its `__array_struct__` capsule (~60 ns; `ndarray.ctypes.data`
/// costs ~1 µs, and the buffer protocol is not in the stable ABI before Python 3.11). The
/// caller keeps `src` alive while it uses the address. ValueError for anything else.
pub(crate) fn contiguous_bytes(src: &Bound<'_, PyAny>) -> PyResult<(usize, usize)> {
    read_array(src, None).map(|a| (a.addr, a.len))
}

/// What [`read_array`] reads of a C-contiguous array's `__array_struct__`.
struct ArrayFacts {
    addr: usize,
    len: usize,
    kind: u8,
    itemsize: usize,
    flags: c_int,
}

/// The facts of C-contiguous array `src` from its `__array_struct__`, its dimensions pushed
/// onto `shape` when given. ValueError for anything else.
fn read_array(src: &Bound<'_, PyAny>, mut shape: Option<&mut Vec<isize>>) -> PyResult<ArrayFacts> {
    const C_CONTIGUOUS: c_int = 0x1;
    let capsule = src.getattr(pyo3::intern!(src.py(), "__array_struct__"))?;
    let capsule = capsule
        .downcast::<PyCapsule>()
        .map_err(|_| PyValueError::new_err("__array_struct__ is not a capsule"))?;
    // SAFETY: numpy's `__array_struct__` capsule holds a `PyArrayInterface` (the protocol),
    // alive as long as `capsule`; read only here.
    let i = unsafe { &*capsule.pointer().cast::<PyArrayInterface>() };
    if i.two != 2 || i.flags & C_CONTIGUOUS == 0 || i.nd < 0 || i.itemsize < 0 {
        return Err(PyValueError::new_err("not a C-contiguous array"));
    }
    let mut len = i.itemsize as usize;
    for d in 0..i.nd as usize {
        // SAFETY: `shape` has `nd` entries (the protocol).
        let dim = unsafe { *i.shape.add(d) };
        len = usize::try_from(dim)
            .ok()
            .and_then(|dim| len.checked_mul(dim))
            .ok_or_else(|| PyValueError::new_err("array too large"))?;
        if let Some(shape) = shape.as_deref_mut() {
            shape.push(dim);
        }
    }
    if i.data.is_null() && len != 0 {
        return Err(PyValueError::new_err("an array without data"));
    }
    Ok(ArrayFacts {
        addr: i.data as usize,
        len,
        kind: i.typekind as u8,
        itemsize: i.itemsize as usize,
        flags: i.flags,
    })
}

/// numpy's type kind of the dtype (with its item size, numpy's dtype): `None` for bfloat16,
/// which numpy has no dtype of its own for (the Python layer shows it with ml_dtypes' or as
/// raw bits).
pub(crate) fn numpy_kind(dtype: DType) -> Option<u8> {
    Some(match dtype {
        DType::Bool => b'b',
        DType::I8 | DType::I16 | DType::I32 | DType::I64 => b'i',
        DType::U8 | DType::U16 | DType::U32 | DType::U64 => b'u',
        DType::F16 | DType::F32 | DType::F64 => b'f',
        DType::C64 | DType::C128 => b'c',
        DType::BF16 => return None,
    })
}

/// An array `put_tensor` stores as it is: its bytes, the dtype its tensor header names, and
/// its shape (also the result's layout).
pub(crate) struct TensorSource<'a> {
    pub(crate) data: &'a [u8],
    pub(crate) dtype: DType,
    pub(crate) layout: Layout,
}

/// [`TensorSource`] of `src` when `put_tensor` can store it as it is: C-contiguous, in
/// little-endian byte order (this machine's), of a dtype the tensor header names. `None` for
/// any other array, or anything that is not one: the Python layer converts those first (or
/// refuses them) as before. One read of `__array_struct__` serves the whole put: reading the
/// dtype, shape and flags from Python and looking up the header cost more than half a
/// microsecond of a 64 B put's seven.
pub(crate) fn tensor_source<'a>(src: &'a Bound<'_, PyAny>) -> PyResult<Option<TensorSource<'a>>> {
    const NOTSWAPPED: c_int = 0x200;
    let mut shape = Vec::new();
    let Ok(a) = read_array(src, Some(&mut shape)) else {
        return Ok(None);
    };
    if !cfg!(target_endian = "little") || a.flags & NOTSWAPPED == 0 {
        return Ok(None);
    }
    let Some(&dtype) = DType::ALL
        .iter()
        .find(|d| numpy_kind(**d) == Some(a.kind) && d.itemsize() == a.itemsize)
    else {
        return Ok(None);
    };
    if shape.len() > vovp_types::tensor::MAX_NDIM || shape.len() > MAX_DIMS {
        return Ok(None);
    }
    let data = exported_bytes(src, a.addr, a.len);
    let layout = Layout::checked(a.kind, a.itemsize as u32, shape, a.len as u64)?;
    Ok(Some(TensorSource {
        data,
        dtype,
        layout,
    }))
}

/// `dst[...] = src` for two C-contiguous arrays of the same byte length (the caller checked
/// that their dtypes are equal): the bytes copied by `vovp_shm`'s parallel copy, split across
/// the rayon pool above 1 MB like every other large put's copy, with the GIL released.
/// Returns False, copying nothing, when the two overlap (numpy's `copyto` handles that).
#[pyfunction]
pub(crate) fn copy_bytes(
    py: Python<'_>,
    dst: &Bound<'_, PyAny>,
    src: &Bound<'_, PyAny>,
) -> PyResult<bool> {
    let Some((to, src)) = copy_pair(dst, src)? else {
        return Ok(false);
    };
    // SAFETY: `copy_pair`'s: `to` is `dst`'s `src.len()` writable bytes, not overlapping
    // `src`; `dst` stays borrowed (alive, unresized) for this call.
    let dst = unsafe { to.slice() };
    py.allow_threads(|| vovp_shm::copy::parallel_copy(dst, src));
    Ok(true)
}

/// The writable bytes a C-contiguous array exports: an address and a length, made a slice
/// only where it is written, while the array is borrowed.
#[derive(Clone, Copy)]
pub(crate) struct WritableBytes {
    pub(crate) addr: usize,
    pub(crate) len: usize,
}

impl WritableBytes {
    /// # Safety
    /// The array these bytes belong to must stay alive and unresized while the slice is
    /// used, and nothing else may access those bytes meanwhile.
    pub(crate) unsafe fn slice<'a>(self) -> &'a mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: the caller's; `addr` exports `len` writable bytes (`writable_bytes`).
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) }
    }
}

/// The destination and source of a byte-for-byte copy `dst[...] = src` of two C-contiguous
/// arrays: `dst` writable, equal lengths, no Python objects; None when the two overlap. The
/// source slice is borrowed with `src`.
pub(crate) fn copy_pair<'a>(
    dst: &Bound<'_, PyAny>,
    src: &'a Bound<'_, PyAny>,
) -> PyResult<Option<(WritableBytes, &'a [u8])>> {
    let to = writable_bytes(dst)?;
    let from = plain_bytes(src)?;
    if to.len != from.len() {
        return Err(PyValueError::new_err(format!(
            "copy of {} bytes into {}",
            from.len(),
            to.len
        )));
    }
    let from_addr = from.as_ptr() as usize;
    if to.len > 0 && to.addr < from_addr + to.len && from_addr < to.addr + to.len {
        return Ok(None);
    }
    Ok(Some((to, from)))
}

/// The bytes of writable C-contiguous array `dst` (no Python objects).
pub(crate) fn writable_bytes(dst: &Bound<'_, PyAny>) -> PyResult<WritableBytes> {
    const WRITEABLE: c_int = 0x400;
    let to = read_array(dst, None)?;
    if to.flags & WRITEABLE == 0 {
        return Err(PyValueError::new_err("not a writable array"));
    }
    if to.kind == b'O' {
        return Err(objects_refused());
    }
    Ok(WritableBytes {
        addr: to.addr,
        len: to.len,
    })
}

/// The bytes of C-contiguous array `src`, borrowed with it; ValueError for an array of
/// Python objects (bytes of object pointers, copied or hashed without their reference counts,
/// mean nothing).
pub(crate) fn plain_bytes<'a>(src: &'a Bound<'_, PyAny>) -> PyResult<&'a [u8]> {
    let a = read_array(src, None)?;
    if a.kind == b'O' {
        return Err(objects_refused());
    }
    Ok(exported_bytes(src, a.addr, a.len))
}

fn objects_refused() -> PyErr {
    PyValueError::new_err("an array of Python objects is not copied or hashed as bytes")
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

/// A `PyArrayInterface` with the storage of its dimensions.
#[repr(C)]
struct ArrayStruct {
    interface: PyArrayInterface,
    shape: [isize; MAX_DIMS],
}

// SAFETY: the pointers are plain addresses numpy reads under the GIL; nothing is shared
// mutably across threads through them.
unsafe impl Send for ArrayStruct {}
