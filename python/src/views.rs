//! The object views handed to Python: `Object` (a sealed object's, one store reference) and
//! `Buffer` (an unsealed object its creator writes). Both export their bytes to numpy.

use std::any::Any;
use std::sync::{Arc, Mutex};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyCapsule, PyDict};
use vovp_client::Client as RustClient;
use vovp_types::{Error, Location, ObjectBuffer, ObjectView};

use crate::array::{array_interface, array_struct};
use crate::errors::to_py;
use crate::process::{forget_in_child, this_process};

/// A CUDA object has no host bytes to export.
fn host_only(location: Location, name: &str) -> PyResult<()> {
    if matches!(location.device(), vovp_types::Device::Cpu) {
        return Ok(());
    }
    Err(to_py(Error::GpuUnavailable(format!(
        "{name:?} is a CUDA object: it has no host memory to map"
    ))))
}

/// Where an object is: ("host", None) or ("cuda", device).
fn location_of(l: Location) -> (&'static str, Option<u32>) {
    match l.device() {
        vovp_types::Device::Cpu => ("host", None),
        vovp_types::Device::Cuda(d) => ("cuda", Some(d)),
    }
}

fn place_of(l: Location) -> Option<(u32, u64)> {
    match l {
        Location::Host { segment, offset } => Some((segment, offset)),
        Location::Cuda(_) => None,
    }
}

/// A sealed object's view: holds one store reference until released or garbage collected.
#[pyclass(module = "vovp._native", frozen, weakref)]
pub(crate) struct Object {
    view: Mutex<Option<ObjectView>>,
    /// A CUDA object's IPC mapping in this process (`map_cuda`).
    device: std::sync::OnceLock<vovp_gpu::ipc::DeviceView>,
    /// A writable object's mapping (a private copy-on-write one for others' objects) and its
    /// address of the bytes; set once, before any array is made (`Client.make_writable`).
    writable: std::sync::OnceLock<(usize, Arc<dyn Any + Send + Sync>)>,
    id: u64,
    name: String,
    size: u64,
    ptr: usize,
    metadata: Vec<u8>,
    location: Location,
    version: u64,
    process: u64,
}

impl Drop for Object {
    fn drop(&mut self) {
        forget_in_child(&self.view, self.process);
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        forget_in_child(&self.buf, self.process);
    }
}

impl Object {
    /// The object with a writable address: its own arena's, or a private copy-on-write one.
    pub(crate) fn writable(client: &RustClient, v: ObjectView) -> Result<Self, Error> {
        let o = Object::new(v);
        o.make_writable(client)?;
        Ok(o)
    }

    pub(crate) fn make_writable(&self, client: &RustClient) -> Result<(), Error> {
        if self.writable.get().is_some() {
            return Ok(());
        }
        let guard = self
            .view
            .lock()
            .map_err(|_| Error::Internal("object lock poisoned".into()))?;
        let Some(view) = guard.as_ref() else {
            return Err(Error::NotHeld(self.id));
        };
        if let Some((ptr, keep)) = client.private_view(view)? {
            let _ = self.writable.set((ptr as usize, keep));
        }
        Ok(())
    }

    pub(crate) fn address_now(&self) -> usize {
        self.writable.get().map_or(self.ptr, |(p, _)| *p)
    }

    pub(crate) fn new(v: ObjectView) -> Self {
        Object {
            device: std::sync::OnceLock::new(),
            writable: std::sync::OnceLock::new(),
            id: v.id().get(),
            name: v.name().to_string(),
            size: v.size(),
            ptr: v.as_ptr() as usize,
            metadata: v.metadata().to_vec(),
            location: v.location(),
            version: v.version(),
            process: this_process(),
            view: Mutex::new(Some(v)),
        }
    }
}

#[pymethods]
impl Object {
    #[getter]
    fn id(&self) -> u64 {
        self.id
    }
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }
    #[getter]
    fn size(&self) -> u64 {
        self.size
    }
    #[getter]
    fn metadata<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.metadata)
    }
    /// The name's version this object is (1 for a name's first object, +1 per replace).
    #[getter]
    fn version(&self) -> u64 {
        self.version
    }
    /// ("host", None) or ("cuda", device index).
    #[getter]
    fn location(&self) -> (&'static str, Option<u32>) {
        location_of(self.location)
    }
    /// (segment id, offset in it) of a host object, else None.
    #[getter]
    fn place(&self) -> Option<(u32, u64)> {
        place_of(self.location)
    }
    /// (id, name, address, size, place): what the Python layer's lease records, in one call.
    #[getter]
    fn lease_fields(&self) -> (u64, &str, usize, u64, Option<(u32, u64)>) {
        (
            self.id,
            &self.name,
            self.address_now(),
            self.size,
            place_of(self.location),
        )
    }
    /// Address of the bytes in this process (host objects; the writable mapping's once
    /// made writable).
    #[getter]
    fn address(&self) -> usize {
        self.address_now()
    }
    /// Device address of a CUDA object in this process once mapped (`map_cuda`), else None.
    #[getter]
    fn cuda_ptr(&self) -> Option<u64> {
        self.device.get().map(|d| d.ptr())
    }
    /// Maps a CUDA object into this process (CUDA IPC through the gpu crate; the pool is opened
    /// once and closed with its last view) and returns its device address.
    fn map_cuda(&self, py: Python<'_>) -> PyResult<u64> {
        if let Some(d) = self.device.get() {
            return Ok(d.ptr());
        }
        let Location::Cuda(block) = self.location else {
            return Err(PyValueError::new_err(format!(
                "{:?} is a host object",
                self.name
            )));
        };
        let view = py
            .allow_threads(|| vovp_gpu::ipc::open(&block))
            .map_err(|e| to_py(e.into()))?;
        Ok(self.device.get_or_init(|| view).ptr())
    }
    #[getter]
    fn __array_struct__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyCapsule>> {
        host_only(self.location, &self.name)?;
        array_struct(
            py,
            self.address_now(),
            self.size,
            self.writable.get().is_none(),
        )
    }
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        host_only(self.location, &self.name)?;
        array_interface(
            py,
            self.address_now(),
            self.size,
            self.writable.get().is_none(),
        )
    }
    /// Whether this is a host object (the Python layer's check before making an array).
    #[getter]
    fn is_host(&self) -> bool {
        matches!(self.location.device(), vovp_types::Device::Cpu)
    }
    /// (address, size, metadata) of a host object, None for a CUDA one: what `vovp.plasma`'s
    /// get reads, in one call rather than four (each was ~1.5% of that get).
    #[getter]
    fn host_fields<'py>(&self, py: Python<'py>) -> Option<(usize, u64, Bound<'py, PyBytes>)> {
        self.is_host().then(|| {
            (
                self.address_now(),
                self.size,
                PyBytes::new(py, &self.metadata),
            )
        })
    }
    #[getter]
    fn readonly(&self) -> bool {
        self.writable.get().is_none()
    }
    /// Gives the store reference back now; False if it already was. Arrays over the bytes must
    /// not be used afterwards (the store may reuse the memory).
    fn release(&self) -> bool {
        forget_in_child(&self.view, self.process);
        let taken = self.view.lock().ok().and_then(|mut v| v.take());
        taken.is_some()
    }
    #[getter]
    fn released(&self) -> bool {
        self.view.lock().map(|v| v.is_none()).unwrap_or(true)
    }
    fn __repr__(&self) -> String {
        format!(
            "<vovp._native.Object {:?} id={} size={}>",
            self.name, self.id, self.size
        )
    }
}

/// An object this client created: writable by it until sealed (by name, `Client.seal`); holds
/// the creator's reference, so dropping it unsealed aborts the object.
#[pyclass(module = "vovp._native", frozen, weakref)]
pub(crate) struct Buffer {
    buf: Mutex<Option<ObjectBuffer>>,
    id: u64,
    name: String,
    size: u64,
    ptr: usize,
    process: u64,
    location: Location,
    cuda_ptr: Option<u64>,
}

impl Buffer {
    pub(crate) fn new(mut b: ObjectBuffer) -> Self {
        Buffer {
            location: b.location(),
            cuda_ptr: b.cuda_ptr(),
            id: b.id().get(),
            name: b.name().to_string(),
            size: b.size(),
            ptr: b.as_mut_ptr() as usize,
            process: this_process(),
            buf: Mutex::new(Some(b)),
        }
    }
}

#[pymethods]
impl Buffer {
    #[getter]
    fn id(&self) -> u64 {
        self.id
    }
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }
    #[getter]
    fn size(&self) -> u64 {
        self.size
    }
    #[getter]
    fn address(&self) -> usize {
        self.ptr
    }
    /// As `Object.lease_fields`.
    #[getter]
    fn lease_fields(&self) -> (u64, &str, usize, u64, Option<(u32, u64)>) {
        (
            self.id,
            &self.name,
            self.ptr,
            self.size,
            place_of(self.location),
        )
    }
    #[getter]
    fn location(&self) -> (&'static str, Option<u32>) {
        location_of(self.location)
    }
    #[getter]
    fn place(&self) -> Option<(u32, u64)> {
        place_of(self.location)
    }
    #[getter]
    fn cuda_ptr(&self) -> Option<u64> {
        self.cuda_ptr
    }
    #[getter]
    fn __array_struct__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyCapsule>> {
        host_only(self.location, &self.name)?;
        array_struct(py, self.ptr, self.size, false)
    }
    /// Whether this is a host object (the Python layer's check before making an array).
    #[getter]
    fn is_host(&self) -> bool {
        matches!(self.location.device(), vovp_types::Device::Cpu)
    }
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        host_only(self.location, &self.name)?;
        array_interface(py, self.ptr, self.size, false)
    }
    /// Drops the creator's reference (which aborts an unsealed object); False if gone already.
    fn release(&self) -> bool {
        forget_in_child(&self.buf, self.process);
        let taken = self.buf.lock().ok().and_then(|mut b| b.take());
        taken.is_some()
    }
}
