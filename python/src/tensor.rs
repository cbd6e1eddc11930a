//! The tensor header (PROTOCOL.md "Tensor metadata") for `vovp.tensor`: the engine's
//! `vovp_types::TensorMeta` encodes and decodes it, so Python and Rust read and write one format.
//! What the engine leaves to its callers is added here: the framework extension byte after the
//! shape (written by the Python client; readers ignore codes they do not know).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};
use vovp_types::{DType, Error, TensorMeta};

use crate::array::Layout;

/// Framework codes of the extension byte that a reader follows (1 numpy, 2 torch).
const KNOWN_FRAMEWORKS: [u8; 2] = [1, 2];

/// The header of a tensor: `TensorMeta::encode`, then the framework byte unless it is 0
/// (unspecified writes nothing, so such headers stay readable by readers older than the
/// field). ValueError for what the format cannot say (unknown dtype, device type or byte
/// order, too many dimensions).
#[pyfunction]
#[pyo3(signature = (code, shape, byte_order = 0, device_type = 1, device_id = 0, framework = 0))]
pub(crate) fn encode_tensor_header<'py>(
    py: Python<'py>,
    code: u8,
    shape: Vec<i64>,
    byte_order: u8,
    device_type: u8,
    device_id: u32,
    framework: u8,
) -> PyResult<Bound<'py, PyBytes>> {
    let invalid = |e: Error| PyValueError::new_err(e.to_string());
    let meta = TensorMeta {
        dtype: DType::from_code(code).map_err(invalid)?,
        shape,
        device: match device_type {
            1 => vovp_types::Device::Cpu,
            2 => vovp_types::Device::Cuda(device_id),
            other => return Err(PyValueError::new_err(format!("device type {other}"))),
        },
        little_endian: match byte_order {
            0 => true,
            1 => false,
            other => return Err(PyValueError::new_err(format!("byte order {other}"))),
        },
    };
    // What the engine writes it must read back (this refuses too many dimensions).
    TensorMeta::decode(&meta.encode())
        .map_err(|e| PyValueError::new_err(format!("cannot encode this tensor header: {e}")))?;
    Ok(PyBytes::new(py, &with_framework(&meta, framework)))
}

/// The header of a little-endian host tensor of `dtype` and `shape` (at most `MAX_NDIM`
/// dimensions, each non-negative: a numpy array's), as [`encode_tensor_header`] writes it.
pub(crate) fn host_header(dtype: DType, shape: &[isize], framework: u8) -> Vec<u8> {
    let meta = TensorMeta {
        dtype,
        shape: shape.iter().map(|&d| d as i64).collect(),
        device: vovp_types::Device::Cpu,
        little_endian: true,
    };
    with_framework(&meta, framework)
}

/// `meta` encoded, then the framework byte unless it is 0 (unspecified).
fn with_framework(meta: &TensorMeta, framework: u8) -> Vec<u8> {
    let mut header = meta.encode();
    if framework != 0 {
        header.push(framework);
    }
    header
}

/// (dtype code, shape, byte order, device type, device id, framework) of a tensor header;
/// `vovp.ProtocolError` when it is not one this build understands. An unknown framework code
/// (a newer writer) is a hint this reader cannot follow: 0.
#[pyfunction]
pub(crate) fn decode_tensor_header<'py>(
    py: Python<'py>,
    meta: &[u8],
) -> PyResult<(u8, Bound<'py, PyTuple>, u8, u8, u32, u8)> {
    let m = TensorMeta::decode(meta).map_err(|e| {
        let errors = match py.import("vovp.errors") {
            Ok(errors) => errors,
            Err(err) => return err,
        };
        // (The message without Display's "tensor: " prefix.)
        let message = match e {
            Error::Tensor(m) => m,
            other => other.to_string(),
        };
        match errors
            .getattr("ProtocolError")
            .and_then(|c| c.call1((message,)))
        {
            Ok(exc) => PyErr::from_value(exc),
            Err(err) => err,
        }
    })?;
    let (device_type, device_id) = match m.device {
        vovp_types::Device::Cpu => (1, 0),
        vovp_types::Device::Cuda(d) => (2, d),
    };
    let framework = framework_of(meta, &m);
    Ok((
        m.dtype as u8,
        PyTuple::new(py, &m.shape)?,
        if m.little_endian { 0 } else { 1 },
        device_type,
        device_id,
        framework,
    ))
}

/// The numpy layout of a host tensor of `size` bytes whose header is `meta`, with its dtype
/// code and framework byte: `None` when numpy cannot be shown it as it is (not a header, not
/// a host tensor, big-endian, bfloat16 (numpy has no such dtype: the Python layer picks
/// ml_dtypes' or raw bits), or a shape that is not `size` bytes).
pub(crate) fn host_layout(meta: &[u8], size: u64) -> Option<(Layout, u8, u8)> {
    let m = TensorMeta::decode(meta).ok()?;
    if m.device != vovp_types::Device::Cpu || !m.little_endian {
        return None;
    }
    let kind = crate::array::numpy_kind(m.dtype)?;
    let shape = m
        .shape
        .iter()
        .map(|&d| isize::try_from(d).ok())
        .collect::<Option<_>>()?;
    let layout = Layout::checked(kind, m.dtype.itemsize() as u32, shape, size).ok()?;
    Some((layout, m.dtype as u8, framework_of(meta, &m)))
}

/// The framework byte after the shape of header `meta` (decoded as `m`): 0 when there is none
/// or it is a code this reader does not follow (a newer writer's hint).
fn framework_of(meta: &[u8], m: &TensorMeta) -> u8 {
    match meta.get(FIXED_LEN + 8 * m.shape.len()) {
        Some(&f) if KNOWN_FRAMEWORKS.contains(&f) => f,
        _ => 0,
    }
}

/// Bytes of the header before the shape: those of a 0-d tensor's.
const FIXED_LEN: usize = 16;

/// Registers the header functions and the constants of the format (the magic, version and
/// fixed length as the engine writes them, and the engine's dtypes).
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(encode_tensor_header, m)?)?;
    m.add_function(wrap_pyfunction!(decode_tensor_header, m)?)?;
    let scalar = TensorMeta {
        dtype: DType::from_code(1).map_err(|e| PyValueError::new_err(e.to_string()))?,
        shape: Vec::new(),
        device: vovp_types::Device::Cpu,
        little_endian: true,
    }
    .encode();
    debug_assert_eq!(scalar.len(), FIXED_LEN);
    m.add("TENSOR_MAGIC", PyBytes::new(m.py(), &scalar[..4]))?;
    m.add("TENSOR_VERSION", scalar[4])?;
    m.add("TENSOR_HEADER_SIZE", scalar.len())?;
    // (code, numpy-style name, item size) of every dtype the header can name.
    let dtypes: Vec<(u8, &str, usize)> = DType::ALL
        .iter()
        .map(|&d| (d as u8, d.name(), d.itemsize()))
        .collect();
    m.add("DTYPES", PyTuple::new(m.py(), dtypes)?)?;
    m.add("MAX_NDIM", vovp_types::tensor::MAX_NDIM)?;
    // The largest object any lend takes: a quarter of the largest lend (that of a big store).
    let largest_lend = vovp_types::lends::lend_size(u64::MAX).unwrap_or(0);
    m.add("LEND_LIMIT", vovp_types::lends::max_object(largest_lend))?;
    Ok(())
}
