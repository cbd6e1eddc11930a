//! The object views handed to Python: `Object` (a sealed object's, one store reference) and
//! `Buffer` (an unsealed object its creator writes). Both export their bytes to numpy.

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyCapsule, PyDict};
use vovp_client::{Client as RustClient, PipelinedView};
use vovp_types::{Error, Location, ObjectBuffer, ObjectView};

use crate::array::{array_interface, array_struct, new_array, Layout};
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

/// `lease_fields`: (id, None while pending; name; address; size; segment and offset, None
/// for a CUDA object; version, 0 while pending).
type LeaseFields<'a> = (
    Option<u64>,
    &'a str,
    usize,
    u64,
    Option<u32>,
    Option<u64>,
    u64,
);

/// The [`LeaseFields`] of an object at `location` (its segment and offset split out).
fn lease_fields_of(
    id: Option<u64>,
    name: &str,
    address: usize,
    size: u64,
    location: Location,
    version: u64,
) -> LeaseFields<'_> {
    let (segment, offset) = match location {
        Location::Host { segment, offset } => (Some(segment), Some(offset)),
        Location::Cuda(_) => (None, None),
    };
    (id, name, address, size, segment, offset, version)
}

/// What an [`Object`] holds: the view of a sealed object, or the store's copy of a put
/// whose reply is still to come (its id and version with it).
pub(crate) enum Held {
    View(ObjectView),
    Pending(PipelinedView),
}

/// A sealed object's view: holds one store reference until released or garbage collected.
/// A small `put_tensor`'s result starts out *pending* (`Client.put` with `wait=False`): its
/// bytes are there, its id and version are read from the store's reply when first asked for.
#[pyclass(module = "vovp._native", frozen, weakref)]
pub(crate) struct Object {
    view: Mutex<Option<Held>>,
    /// A CUDA object's IPC mapping in this process (`map_cuda`).
    device: std::sync::OnceLock<vovp_gpu::ipc::DeviceView>,
    /// A writable object's mapping (a private copy-on-write one for others' objects) and its
    /// address of the bytes; set once, before any array is made (`Client.make_writable`).
    writable: std::sync::OnceLock<(usize, Arc<dyn Any + Send + Sync>)>,
    /// How `__array_struct__` shows the bytes (a tensor's dtype and shape); 1-D uint8 if unset.
    layout: std::sync::OnceLock<Layout>,
    /// The object id and version; 0 while pending.
    id: AtomicU64,
    version: AtomicU64,
    name: String,
    size: u64,
    ptr: usize,
    metadata: Vec<u8>,
    location: Location,
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
        let writable = match guard.as_ref() {
            None => return Err(Error::NotHeld(self.id.load(Ordering::Acquire))),
            Some(Held::View(view)) => client.private_view(view)?,
            Some(Held::Pending(p)) => Some(p.private_view()?),
        };
        if let Some(bytes) = writable {
            let _ = self.writable.set((bytes.ptr as usize, bytes.owner));
        }
        Ok(())
    }

    /// Whether [`Object::make_writable`] needs no system call (see
    /// `vovp_client::Client::private_view_ready`).
    pub(crate) fn writable_mapping_ready(&self, client: &RustClient) -> bool {
        if self.writable.get().is_some() {
            return true;
        }
        match self.view.lock().as_deref() {
            Ok(Some(Held::View(v))) => client.private_view_ready(v),
            Ok(Some(Held::Pending(p))) => p.private_view_ready(),
            _ => true,
        }
    }

    /// Sets the layout numpy sees (checked against this object's size by the caller).
    pub(crate) fn set_layout_checked(&self, layout: Layout) {
        let _ = self.layout.set(layout);
    }

    /// The store's copy of a pipelined put, before its reply (see [`Held::Pending`]).
    pub(crate) fn from_pending(p: PipelinedView, name: &str, metadata: &[u8]) -> Self {
        Object {
            device: std::sync::OnceLock::new(),
            writable: std::sync::OnceLock::new(),
            layout: std::sync::OnceLock::new(),
            id: AtomicU64::new(0),
            version: AtomicU64::new(0),
            name: name.to_string(),
            size: p.size(),
            ptr: p.as_ptr() as usize,
            metadata: metadata.to_vec(),
            location: p.location(),
            process: this_process(),
            view: Mutex::new(Some(Held::Pending(p))),
        }
    }

    /// The object id, reading a pending put's reply first (without the GIL: another thread
    /// may be using the connection); the put's error if the store refused it.
    fn resolved_id(&self, py: Python<'_>) -> PyResult<u64> {
        let id = self.id.load(Ordering::Acquire);
        if id != 0 {
            return Ok(id);
        }
        let mut guard = self
            .view
            .lock()
            .map_err(|_| to_py(Error::Internal("object lock poisoned".into())))?;
        let view = match guard.as_ref() {
            Some(Held::Pending(p)) => {
                py.allow_threads(|| p.wait()).map_err(to_py)?;
                p.take_view()
            }
            // Resolved meanwhile by another thread, or released.
            _ => None,
        };
        if let Some(v) = view {
            self.version.store(v.version(), Ordering::Release);
            self.id.store(v.id().get(), Ordering::Release);
            *guard = Some(Held::View(v));
        }
        match self.id.load(Ordering::Acquire) {
            0 => Err(to_py(Error::NotHeld(0))),
            id => Ok(id),
        }
    }

    pub(crate) fn address_now(&self) -> usize {
        self.writable.get().map_or(self.ptr, |(p, _)| *p)
    }

    pub(crate) fn new(v: ObjectView) -> Self {
        Object {
            device: std::sync::OnceLock::new(),
            writable: std::sync::OnceLock::new(),
            layout: std::sync::OnceLock::new(),
            id: AtomicU64::new(v.id().get()),
            version: AtomicU64::new(v.version()),
            name: v.name().to_string(),
            size: v.size(),
            ptr: v.as_ptr() as usize,
            metadata: v.metadata().to_vec(),
            location: v.location(),
            process: this_process(),
            view: Mutex::new(Some(Held::View(v))),
        }
    }
}

#[pymethods]
impl Object {
    /// The object id (a pending put's: once its reply is read; its error if it failed).
    #[getter]
    fn id(&self, py: Python<'_>) -> PyResult<u64> {
        self.resolved_id(py)
    }
    /// Whether the store's answer to this put is still to be read (id and version unknown).
    #[getter]
    fn pending(&self) -> bool {
        self.id.load(Ordering::Acquire) == 0
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
    fn version(&self, py: Python<'_>) -> PyResult<u64> {
        self.resolved_id(py)?;
        Ok(self.version.load(Ordering::Acquire))
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
    /// (id, name, address, size, segment, offset, version): what the Python layer's lease
    /// records, in one call, as it stores them (id None and version 0 while pending: the lease
    /// asks `id` when it needs it).
    #[getter]
    fn lease_fields(&self) -> LeaseFields<'_> {
        // (The version is stored before the id: a known id comes with its version.)
        let id = self.id.load(Ordering::Acquire);
        let version = self.version.load(Ordering::Acquire);
        let address = self.address_now();
        let id = (id != 0).then_some(id);
        lease_fields_of(id, &self.name, address, self.size, self.location, version)
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
            self.layout.get(),
            self.writable.get().is_none(),
        )
    }
    /// `numpy.asarray(self)`, made at the cost of a call (see [`crate::array::new_array`]):
    /// the package's puts and gets make their arrays with it.
    fn array<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let this = slf.get();
        host_only(this.location, &this.name)?;
        new_array(
            slf.as_any(),
            this.address_now(),
            this.size,
            this.layout.get(),
            this.writable.get().is_none(),
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
    /// (dtype code, framework) of a host object with a tensor header numpy can show as it
    /// is (little-endian, not bfloat16, as many bytes as the object has), its layout set
    /// (`set_layout`) so that `numpy.asarray(obj)` is the tensor; None for anything else
    /// (no header, CUDA, bfloat16, big-endian: the Python layer reads those itself). The
    /// get path's one call for what it did in Python (parse, view, reshape).
    #[getter]
    fn tensor_plan(&self) -> Option<(u8, u8)> {
        if !self.is_host() {
            return None;
        }
        let (layout, code, framework) = crate::tensor::host_layout(&self.metadata, self.size)?;
        let _ = self.layout.set(layout);
        Some((code, framework))
    }
    /// Shows the bytes to numpy as an array of numpy type kind `kind` ('f', 'i', 'u', 'b',
    /// 'c'), `itemsize` and `shape` (exactly the object's size), before any array is made:
    /// `numpy.asarray(obj)` is then the tensor itself. Once; ValueError for a layout that does
    /// not fit.
    fn set_layout(&self, kind: &str, itemsize: u32, shape: Vec<isize>) -> PyResult<()> {
        let layout = Layout::of_kind(kind, itemsize, shape, self.size)?;
        let _ = self.layout.set(layout);
        Ok(())
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
            self.name,
            self.id.load(Ordering::Acquire),
            self.size
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
    /// As `Object.lease_fields` (version 0: not sealed).
    #[getter]
    fn lease_fields(&self) -> LeaseFields<'_> {
        lease_fields_of(
            Some(self.id),
            &self.name,
            self.ptr,
            self.size,
            self.location,
            0,
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
        array_struct(py, self.ptr, self.size, None, false)
    }
    /// As `Object.array`: `numpy.asarray(self)` at the cost of a call.
    fn array<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let this = slf.get();
        host_only(this.location, &this.name)?;
        new_array(slf.as_any(), this.ptr, this.size, None, false)
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
