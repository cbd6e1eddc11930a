//! Zero-copy handles on objects: [`ObjectView`] (a sealed object, read-only) and
//! [`ObjectBuffer`] (an unsealed object its creator writes). Both point straight into the
//! shared mapping and give their reference back when dropped.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use crate::{Device, Location, ObjectId, ObjectName, ObjectRef};

use crate::Error;

/// Where views send their releases and seals: the embedded engine or a client connection.
pub trait ObjectSink: Send + Sync + 'static {
    /// Drops one reference to `id`. Must not block (it runs in `Drop`).
    fn release(&self, id: ObjectId);
    /// Seals the object `obj` refers to (blocking): that incarnation only where the sink can
    /// tell (the embedded engine), by name where it cannot (the wire protocol). Returns the
    /// name's version it became.
    fn seal(&self, obj: &ObjectRef) -> Result<u64, Error>;
}

/// Bytes in this process and what keeps them there: an object's (host bytes, or a CUDA
/// object's device address), a whole segment's mapping, a writable private view's. The one
/// shape of "an address and its keep-alive" of the store, the clients and the shared reads.
pub struct Mapped {
    /// The first host byte; null for a device object.
    pub ptr: *mut u8,
    /// Bytes mapped from `ptr` (an object's size, a segment's length; 0 for a device object).
    pub len: u64,
    /// A CUDA object's device address in this process; 0 for host bytes.
    pub device_ptr: u64,
    /// Keeps the mapping (a segment, a client's mmap, a private view, a CUDA IPC mapping)
    /// alive.
    pub owner: Arc<dyn Any + Send + Sync>,
}

// SAFETY: a plain address into a mapping kept alive by `owner`.
unsafe impl Send for Mapped {}

impl Mapped {
    /// `len` host bytes at `ptr`, kept mapped by `owner`.
    pub fn host(ptr: *mut u8, len: u64, owner: Arc<dyn Any + Send + Sync>) -> Self {
        Mapped {
            ptr,
            len,
            device_ptr: 0,
            owner,
        }
    }

    /// A CUDA object at `device_ptr` in this process, kept mapped by `owner`.
    pub fn device(device_ptr: u64, owner: Arc<dyn Any + Send + Sync>) -> Self {
        Mapped {
            ptr: std::ptr::null_mut(),
            len: 0,
            device_ptr,
            owner,
        }
    }
}

impl fmt::Debug for Mapped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mapped")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("device_ptr", &self.device_ptr)
            .finish_non_exhaustive()
    }
}

/// A reference to a sealed object: derefs to its bytes (host objects) and releases on drop.
pub struct ObjectView {
    obj: ObjectRef,
    ptr: *const u8,
    /// Device address of a CUDA object in this process (its IPC mapping), else 0.
    device_ptr: u64,
    _owner: Arc<dyn Any + Send + Sync>,
    sink: Arc<dyn ObjectSink>,
}

// SAFETY: the bytes are immutable after seal and the mapping lives as long as `_owner`.
unsafe impl Send for ObjectView {}
unsafe impl Sync for ObjectView {}

impl ObjectView {
    /// Builds a view from an object reference the caller holds. `ptr` must point at the
    /// object's `size` bytes inside a mapping kept alive by `owner` (null for device objects).
    ///
    /// # Safety
    /// `ptr..ptr+obj.size` must stay valid while `owner` lives and must not be written.
    pub unsafe fn from_raw(
        obj: ObjectRef,
        ptr: *const u8,
        owner: Arc<dyn Any + Send + Sync>,
        sink: Arc<dyn ObjectSink>,
    ) -> Self {
        ObjectView {
            obj,
            ptr,
            device_ptr: 0,
            _owner: owner,
            sink,
        }
    }

    /// A view of a CUDA object: `device_ptr` is its address in this process's CUDA context,
    /// valid while `owner` (the IPC mapping) lives.
    pub fn from_device(
        obj: ObjectRef,
        device_ptr: u64,
        owner: Arc<dyn Any + Send + Sync>,
        sink: Arc<dyn ObjectSink>,
    ) -> Self {
        ObjectView {
            obj,
            ptr: std::ptr::null(),
            device_ptr,
            _owner: owner,
            sink,
        }
    }

    /// The device address of a CUDA object (`None` for host objects).
    pub fn cuda_ptr(&self) -> Option<u64> {
        (self.device_ptr != 0).then_some(self.device_ptr)
    }

    pub fn id(&self) -> ObjectId {
        self.obj.id
    }
    pub fn name(&self) -> &ObjectName {
        &self.obj.name
    }
    pub fn size(&self) -> u64 {
        self.obj.size
    }
    /// The name's version this object is: 1 for a name's first object, one more for each
    /// replace (0 for an object not sealed yet).
    pub fn version(&self) -> u64 {
        self.obj.version
    }
    pub fn metadata(&self) -> &[u8] {
        &self.obj.metadata
    }
    pub fn location(&self) -> Location {
        self.obj.location
    }
    pub fn device(&self) -> Device {
        self.obj.location.device()
    }
    /// Address of the data in this process (host objects; null for device objects).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// The bytes of a host object; empty for device objects (see [`ObjectView::location`]).
    pub fn bytes(&self) -> &[u8] {
        if self.ptr.is_null() || self.obj.size == 0 {
            return &[];
        }
        // SAFETY: see `from_raw`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.obj.size as usize) }
    }
}

impl std::ops::Deref for ObjectView {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.bytes()
    }
}

impl Drop for ObjectView {
    fn drop(&mut self) {
        self.sink.release(self.obj.id);
    }
}

impl fmt::Debug for ObjectView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ObjectView")
            .field("name", &self.obj.name)
            .field("id", &self.obj.id)
            .field("size", &self.obj.size)
            .field("location", &self.obj.location)
            .finish()
    }
}

/// A newly created, unsealed object: write it, then [`ObjectBuffer::seal`]. Dropping it unsealed
/// aborts the object.
pub struct ObjectBuffer {
    view: ObjectView,
}

impl ObjectBuffer {
    /// A buffer over the object's place in this process.
    ///
    /// # Safety
    /// As [`ObjectView::from_mapped`], and the caller is the object's creator (sole writer).
    pub unsafe fn from_mapped(obj: ObjectRef, m: Mapped, sink: Arc<dyn ObjectSink>) -> Self {
        ObjectBuffer {
            view: ObjectView::from_mapped(obj, m, sink),
        }
    }

    /// The device address of a CUDA object (`None` for host objects).
    pub fn cuda_ptr(&self) -> Option<u64> {
        self.view.cuda_ptr()
    }

    pub fn name(&self) -> &ObjectName {
        self.view.name()
    }
    pub fn id(&self) -> ObjectId {
        self.view.id()
    }
    pub fn size(&self) -> u64 {
        self.view.size()
    }
    pub fn location(&self) -> Location {
        self.view.location()
    }
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.view.ptr as *mut u8
    }

    /// The writable bytes (host objects; empty for device objects).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.view.ptr.is_null() || self.view.obj.size == 0 {
            return &mut [];
        }
        // SAFETY: the creator is the only writer of an unsealed object.
        unsafe {
            std::slice::from_raw_parts_mut(self.view.ptr as *mut u8, self.view.obj.size as usize)
        }
    }

    /// Seals the object (immutable and visible to everyone from now on) and keeps the reference
    /// as a read-only view (of the version it became: [`ObjectView::version`]).
    pub fn seal(mut self) -> Result<ObjectView, Error> {
        self.view.obj.version = self.view.sink.seal(&self.view.obj)?;
        Ok(self.view)
    }

    /// For callers that sealed by name through an async API: the reference, as a view.
    pub fn into_view(self) -> ObjectView {
        self.view
    }

    /// For callers that sealed it by name (a SEAL of their own): the reference, as a view of
    /// `version`, the version SEAL said it became.
    pub fn sealed(mut self, version: u64) -> ObjectView {
        self.view.obj.version = version;
        self.view
    }
}

impl fmt::Debug for ObjectBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ObjectBuffer").field(&self.view).finish()
    }
}

impl ObjectView {
    /// A view of the object's place in this process (host bytes or a device address).
    ///
    /// # Safety
    /// For a host object, `m.ptr..m.ptr + obj.size` is the object's range in a mapping kept
    /// alive by `m.owner`, as for [`ObjectView::from_raw`].
    pub unsafe fn from_mapped(obj: ObjectRef, m: Mapped, sink: Arc<dyn ObjectSink>) -> Self {
        if m.device_ptr != 0 {
            return Self::from_device(obj, m.device_ptr, m.owner, sink);
        }
        // SAFETY: the caller's promise.
        unsafe { Self::from_raw(obj, m.ptr, m.owner, sink) }
    }
}
