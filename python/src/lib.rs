//! `vovp._native`: the Python package's native core, a thin PyO3 layer over the Rust client
//! (`vovp_client::Client`): connect/HELLO, requests and replies, fd passing, segment
//! mappings, request ids, deferred releases and reconnect are the Rust client's, not a third
//! implementation of PROTOCOL.md.
//!
//! Objects come back as [`Object`] (a sealed object's view) or [`Buffer`] (an unsealed object
//! its creator writes). Both export their bytes to numpy (`__array_struct__`, and the
//! `__array_interface__` dict for other readers of that protocol), so
//! `numpy.asarray(obj)` is a zero-copy view of the shared mapping whose `.base` is `obj`: the
//! store reference lives exactly as long as some array over it does, and is released (by the
//! Rust view's `Drop`) when the last one goes. The buffer protocol would do the same but is not
//! in the stable ABI before Python 3.11, and this module is built once for every CPython >= 3.9
//! (abi3).
//!
//! Every call that waits on the socket or copies bytes releases the GIL.

use std::any::Any;
use std::ffi::{c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyCapsule, PyDict, PyTuple};
use vovp_client::{Client as RustClient, ClientOptions};
use vovp_types::{CreateOptions, Error, Location, ObjectBuffer, ObjectView, Store};

/// Protocol status code of an error (PROTOCOL.md "Status codes"), for `vovp.errors`: the
/// code the daemon would answer it with.
fn status_of(e: &Error) -> u8 {
    vovp_proto::Failure::from_error(e).status.code()
}

/// The `vovp.errors` exception for `e`: the same classes the pure-Python client raised.
fn to_py(e: Error) -> PyErr {
    Python::with_gil(|py| {
        let made = (|| -> PyResult<PyErr> {
            let errors = py.import("vovp.errors")?;
            // Errors decoded from a reply carry the daemon's own message: pass it on as is
            // (Display would wrap it in a second description).
            let message = match &e {
                Error::NotFound(m)
                | Error::AlreadyExists(m)
                | Error::NotSealed(m)
                | Error::AlreadySealed(m)
                | Error::NotCreator(m)
                | Error::InvalidName(m)
                | Error::GpuUnavailable(m)
                | Error::Gpu(m)
                | Error::Protocol(m)
                | Error::TooLarge(m)
                | Error::Internal(m) => m.clone(),
                other => other.to_string(),
            };
            let exc = match &e {
                // Status 20 means "too many connections" on the wire; a lost connection is a
                // ConnectionError without a status.
                Error::Connection(_) => errors.getattr("ConnectionError")?.call1((message,))?,
                Error::Memory(_) | Error::Config(_) | Error::Tensor(_) => {
                    errors.getattr("VovpError")?.call1((message,))?
                }
                Error::OutOfMemory {
                    requested,
                    available,
                } => errors
                    .getattr("error_from_status")?
                    .call1((3u8, message, *requested, *available))?,
                other => errors
                    .getattr("error_from_status")?
                    .call1((status_of(other), message))?,
            };
            Ok(PyErr::from_value(exc))
        })();
        made.unwrap_or_else(|err| err)
    })
}

fn options(ephemeral: bool) -> CreateOptions {
    CreateOptions {
        ephemeral,
        device: None,
    }
}

fn timeout_of(seconds: Option<f64>) -> PyResult<Option<Duration>> {
    match seconds {
        None => Ok(None),
        Some(s) if s.is_finite() && s >= 0.0 => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => Err(PyValueError::new_err(format!(
            "timeout must be a non-negative number of seconds, not {s}"
        ))),
    }
}

/// `__array_interface__` of `size` bytes at `ptr` (a 1-D uint8 array).
fn array_interface<'py>(
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
fn array_struct(
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

/// Forks so far, counted in each child (a `pthread_atfork` handler, installed at import):
/// "was this made in this process" is then one atomic load. It was a `getpid` system call per
/// check (glibc no longer caches the pid), ~30% of a get+release's time.
static FORKS: AtomicU64 = AtomicU64::new(0);

extern "C" fn count_fork_in_child() {
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// This process's identity for fork checks: equal to an earlier reading iff no fork happened
/// in between on the way to this process.
fn this_process() -> u64 {
    FORKS.load(Ordering::Relaxed)
}

/// A connection to a `vovp-engine` daemon.
#[pyclass(module = "vovp._native", frozen)]
struct Client {
    inner: RustClient,
    /// The process that connected (`this_process()`): a forked child must not talk on its
    /// parent's socket.
    process: u64,
}

impl Client {
    /// The Rust client, refused in a forked child (it would speak on the parent's socket, in
    /// the middle of the parent's requests).
    fn usable(&self) -> PyResult<&RustClient> {
        if this_process() != self.process {
            return Err(to_py(Error::Connection(
                "this vovp client was created in another process (fork); create a new one".into(),
            )));
        }
        Ok(&self.inner)
    }
}

#[pymethods]
impl Client {
    /// Connects (retrying for up to `connect_timeout` seconds while the socket is missing or
    /// refuses) and does the HELLO handshake.
    #[new]
    /// `release_delay` (seconds, 0 = none): dropped objects' RELEASEs ride in front of the
    /// next request, or are sent after this delay if the client stays idle.
    #[pyo3(signature = (path, connect_timeout = 0.0, reconnect = false, release_delay = 0.0, shared_reads = true, lend_puts = true, pipelined_puts = true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        connect_timeout: f64,
        reconnect: bool,
        release_delay: f64,
        shared_reads: bool,
        lend_puts: bool,
        pipelined_puts: bool,
    ) -> PyResult<Self> {
        let wait = timeout_of(Some(connect_timeout))?.unwrap_or_default();
        // CUDA objects are mapped when the Python layer asks (`Object.map_cuda`), after its
        // own checks (framework, driver): a get never fails for want of a driver.
        let options = ClientOptions {
            reconnect,
            defer_cuda_mapping: true,
            release_delay: timeout_of(Some(release_delay))?.filter(|d| !d.is_zero()),
            no_shared_reads: !shared_reads,
            no_lend_puts: !lend_puts,
            no_pipelined_puts: !pipelined_puts,
        };
        let inner = py
            .allow_threads(|| {
                let deadline = Instant::now() + wait;
                loop {
                    match RustClient::connect_with(&path, options) {
                        Ok(c) => return Ok(c),
                        // Not there yet (a daemon starting): retry until the deadline.
                        Err(Error::Connection(why))
                            if Instant::now() < deadline
                                && (why.contains("No such file") || why.contains("refused")) =>
                        {
                            std::thread::sleep(Duration::from_millis(20));
                        }
                        Err(e) => return Err(e),
                    }
                }
            })
            .map_err(to_py)?;
        Ok(Client {
            inner,
            process: this_process(),
        })
    }

    /// Host bytes the daemon manages.
    #[getter]
    fn capacity(&self) -> u64 {
        self.inner.capacity()
    }

    /// The largest PUT payload the daemon accepts.
    #[getter]
    fn max_inline(&self) -> u32 {
        self.inner.max_inline()
    }

    /// Sends the queued releases now.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let inner = self.usable()?;
        py.allow_threads(|| inner.flush());
        Ok(())
    }

    /// Closes the connection: the daemon releases every reference this client held; views
    /// stay mapped (their memory may be reused by the store) and send nothing when dropped.
    fn close(&self) {
        if this_process() == self.process {
            self.inner.close();
        }
    }

    /// Gets `names` (waiting up to `timeout` seconds for missing or unsealed ones; None: do not
    /// wait); a missing name is None.
    /// `writable`: views others' objects through a private copy-on-write mapping (writes stay
    /// in this process).
    #[pyo3(signature = (names, timeout = None, writable = false))]
    fn get(
        &self,
        py: Python<'_>,
        names: Vec<String>,
        timeout: Option<f64>,
        writable: bool,
    ) -> PyResult<Vec<Option<Object>>> {
        let inner = self.usable()?;
        let timeout = timeout_of(timeout)?;
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        // What the shared directory serves costs no wait: done with the GIL held (releasing
        // and retaking it would cost more than the get). The rest waits without it.
        let (mut views, missing) = inner.get_shared(&refs);
        if !missing.is_empty() {
            let rest: Vec<&str> = missing.iter().map(|&i| refs[i]).collect();
            let got = py
                .allow_threads(|| inner.get(&rest, timeout))
                .map_err(to_py)?;
            for (i, v) in missing.into_iter().zip(got) {
                views[i] = v;
            }
        }
        let objects = |views: Vec<Option<ObjectView>>| {
            views
                .into_iter()
                .map(|v| match v {
                    None => Ok(None),
                    Some(v) if writable => Object::writable(inner, v).map(Some),
                    Some(v) => Ok(Some(Object::new(v))),
                })
                .collect::<Result<Vec<_>, Error>>()
        };
        if writable {
            // A private mapping may be made: a syscall, without the GIL.
            py.allow_threads(|| objects(views)).map_err(to_py)
        } else {
            objects(views).map_err(to_py)
        }
    }

    /// One name: `get([name], timeout, writable)[0]` without the lists (every single get).
    #[pyo3(signature = (name, timeout = None, writable = false))]
    fn get1(
        &self,
        py: Python<'_>,
        name: &str,
        timeout: Option<f64>,
        writable: bool,
    ) -> PyResult<Option<Object>> {
        let inner = self.usable()?;
        let timeout = timeout_of(timeout)?;
        // As `get`: the shared directory with the GIL held, the socket without it.
        let view = match inner.get_shared(&[name]).0.pop().flatten() {
            Some(v) => Some(v),
            None => py
                .allow_threads(|| inner.get(&[name], timeout))
                .map_err(to_py)?
                .pop()
                .flatten(),
        };
        match view {
            None => Ok(None),
            Some(v) if writable => py
                .allow_threads(|| Object::writable(inner, v))
                .map(Some)
                .map_err(to_py),
            Some(v) => Ok(Some(Object::new(v))),
        }
    }

    /// PUT of `size` bytes at address `addr` (a contiguous buffer the caller keeps alive for the
    /// call). `keep`: return the stored object's view, else (`wait`) its object id, else
    /// None: a small put is then sent without waiting for the store's answer (`sync`).
    #[pyo3(signature = (name, addr, size, metadata = b"".as_slice(), ephemeral = false, keep = false, writable = false, wait = true))]
    #[allow(clippy::too_many_arguments)]
    fn put(
        &self,
        py: Python<'_>,
        name: &str,
        addr: usize,
        size: usize,
        metadata: &[u8],
        ephemeral: bool,
        keep: bool,
        writable: bool,
        wait: bool,
    ) -> PyResult<PyObject> {
        let inner = self.usable()?;
        if addr == 0 && size != 0 {
            return Err(PyValueError::new_err("a null buffer address"));
        }
        // SAFETY: the caller (vovp.client, never user code) passes the address and length of a
        // contiguous buffer it holds a reference to until this call returns.
        let data: &[u8] = if size == 0 {
            &[]
        } else {
            unsafe { std::slice::from_raw_parts(addr as *const u8, size) }
        };
        let name = name.to_owned();
        let metadata = metadata.to_vec();
        py.allow_threads(|| {
            if keep {
                let v = inner.put_and_view(&name, data, &metadata, options(ephemeral))?;
                if writable {
                    Object::writable(inner, v).map(|o| Put::Kept(Box::new(o)))
                } else {
                    Ok(Put::Kept(Box::new(Object::new(v))))
                }
            } else if wait {
                inner
                    .put_id(&name, data, &metadata, options(ephemeral))
                    .map(Put::Id)
            } else {
                inner
                    .put(&name, data, &metadata, options(ephemeral))
                    .map(|()| Put::Sent)
            }
        })
        .map_err(to_py)
        .and_then(|p| match p {
            Put::Kept(o) => Ok(Py::new(py, *o)?.into_any()),
            Put::Id(id) => Ok(id.into_pyobject(py)?.into_any().unbind()),
            Put::Sent => Ok(py.None()),
        })
    }

    /// CREATE: an unsealed object of `size` bytes that only this client may write; on
    /// cuda:`device` when given.
    #[pyo3(signature = (name, size, metadata = b"".as_slice(), ephemeral = false, device = None))]
    fn create(
        &self,
        py: Python<'_>,
        name: &str,
        size: u64,
        metadata: &[u8],
        ephemeral: bool,
        device: Option<u32>,
    ) -> PyResult<Buffer> {
        let inner = self.usable()?;
        let opts = CreateOptions {
            ephemeral,
            device: device.map(vovp_types::Device::Cuda),
        };
        let buf = py
            .allow_threads(|| inner.create(name, size, metadata, opts))
            .map_err(to_py)?;
        Ok(Buffer::new(buf))
    }

    /// Pipelined inline PUTs keeping a reference each: `items` are (name, addr, size,
    /// metadata) of contiguous buffers the caller keeps alive for the call. One round trip;
    /// returns an Object or the exception of each item.
    #[pyo3(signature = (items, ephemeral = false, writable = false))]
    fn put_many(
        &self,
        py: Python<'_>,
        items: Vec<(String, usize, usize, Vec<u8>)>,
        ephemeral: bool,
        writable: bool,
    ) -> PyResult<Vec<PyObject>> {
        let inner = self.usable()?;
        if items
            .iter()
            .any(|(_, addr, size, _)| *addr == 0 && *size != 0)
        {
            return Err(PyValueError::new_err("a null buffer address"));
        }
        let results = py
            .allow_threads(|| {
                let batch: Vec<(&str, &[u8], &[u8], CreateOptions)> = items
                    .iter()
                    .map(|(name, addr, size, meta)| {
                        // SAFETY: as for `put`: buffers the caller holds for this call.
                        let data: &[u8] = if *size == 0 {
                            &[]
                        } else {
                            unsafe { std::slice::from_raw_parts(*addr as *const u8, *size) }
                        };
                        (name.as_str(), data, meta.as_slice(), options(ephemeral))
                    })
                    .collect();
                inner.put_many(&batch).map(|views| {
                    views
                        .into_iter()
                        .map(|r| {
                            r.and_then(|v| {
                                if writable {
                                    Object::writable(inner, v)
                                } else {
                                    Ok(Object::new(v))
                                }
                            })
                        })
                        .collect::<Vec<_>>()
                })
            })
            .map_err(to_py)?;
        results
            .into_iter()
            .map(|r| match r {
                Ok(o) => Ok(Py::new(py, o)?.into_any()),
                Err(e) => Ok(to_py(e).into_value(py).into_any()),
            })
            .collect()
    }

    /// Waits for the store's answer to every put sent without waiting; raises the first
    /// failure.
    fn sync(&self, py: Python<'_>) -> PyResult<()> {
        let inner = self.usable()?;
        py.allow_threads(|| inner.sync()).map_err(to_py)
    }

    /// SEAL without waiting for the reply (read in front of the next request's).
    fn seal_later(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        let inner = self.usable()?;
        py.allow_threads(|| inner.seal_later(name)).map_err(to_py)
    }

    /// SEALs sent by `seal_later` whose replies are not read yet.
    #[getter]
    fn unread_replies(&self) -> usize {
        self.inner.unread_replies()
    }

    /// Id of the last frame sent on the connection (frames are numbered 1, 2, ...).
    #[getter]
    fn last_request_id(&self) -> u64 {
        self.inner.last_request_id()
    }

    /// SEAL by name (the creator's connection).
    fn seal(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        let inner = self.usable()?;
        py.allow_threads(|| inner.seal(name)).map_err(to_py)
    }

    fn abort(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        let inner = self.usable()?;
        py.allow_threads(|| inner.abort(name)).map_err(to_py)
    }

    fn contains(&self, py: Python<'_>, name: &str) -> PyResult<bool> {
        let inner = self.usable()?;
        py.allow_threads(|| inner.contains(name)).map_err(to_py)
    }

    fn delete(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        let inner = self.usable()?;
        py.allow_threads(|| inner.delete(name)).map_err(to_py)
    }

    /// Bytes freed.
    fn evict(&self, py: Python<'_>, nbytes: u64) -> PyResult<u64> {
        let inner = self.usable()?;
        py.allow_threads(|| inner.evict(nbytes)).map_err(to_py)
    }

    /// Every object, as dicts with the keys of the pure-Python client's LIST (the tensor
    /// header's dtype/shape are added by `vovp.client`).
    fn list<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let inner = self.usable()?;
        let all = py.allow_threads(|| inner.list()).map_err(to_py)?;
        all.into_iter()
            .map(|o| {
                let d = PyDict::new(py);
                let (kind, device_type, device_id) = match o.device {
                    vovp_types::Device::Cpu => ("cpu", 0u8, 0u32),
                    vovp_types::Device::Cuda(i) => ("cuda", 1u8, i),
                };
                d.set_item("name", o.name.as_str())?;
                d.set_item("id", o.id.get())?;
                d.set_item("size", o.size)?;
                d.set_item("device", kind)?;
                d.set_item("device_type", device_type)?;
                d.set_item("device_id", device_id)?;
                d.set_item("sealed", o.sealed)?;
                d.set_item("ephemeral", o.ephemeral)?;
                d.set_item("refcount", o.refcount)?;
                d.set_item(
                    "last_access",
                    vovp_client::unix_millis(o.last_access) as f64 / 1000.0,
                )?;
                d.set_item("metadata", PyBytes::new(py, &o.metadata))?;
                Ok(d)
            })
            .collect()
    }

    /// Makes `obj`'s view writable (before any array over it is made): in place for this
    /// client's own arenas, else through a private copy-on-write mapping.
    fn make_writable(&self, py: Python<'_>, obj: &Object) -> PyResult<()> {
        let inner = self.usable()?;
        py.allow_threads(|| obj.make_writable(inner)).map_err(to_py)
    }

    /// A notification stream on a new connection to the same daemon.
    fn subscribe(&self, py: Python<'_>) -> PyResult<Subscription> {
        let inner = self.usable()?;
        let sub = py.allow_threads(|| inner.subscribe()).map_err(to_py)?;
        let closer = sub.closer().map_err(to_py)?;
        Ok(Subscription {
            stream: Mutex::new(Some(sub)),
            closer,
            closed: AtomicBool::new(false),
        })
    }

    /// STATS as a dict (PROTOCOL.md's field names).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let inner = self.usable()?;
        // One STATS round trip; the wire's field names and order, written once in vovp-proto.
        let mut both = py
            .allow_threads(|| inner.stats_and_connections())
            .map_err(to_py)?;
        let d = PyDict::new(py);
        for (k, field) in vovp_proto::STATS_FIELDS {
            d.set_item(k, *field(&mut both))?;
        }
        Ok(d)
    }
}

/// (kind, name, size, metadata) of one notification.
type Notification<'py> = (&'static str, String, u64, Bound<'py, PyBytes>);

/// A notification stream (SUBSCRIBE on a connection of its own).
///
/// Frozen, with the stream behind a mutex, so that `close` from another thread can end a
/// `next` that waits (with the GIL released) in a reader thread: vovp.plasma's relay does.
#[pyclass(module = "vovp._native", frozen)]
struct Subscription {
    stream: Mutex<Option<vovp_client::Subscription>>,
    closer: vovp_client::SubscriptionCloser,
    closed: AtomicBool,
}

#[pymethods]
impl Subscription {
    /// The next notification as (kind, name, size, metadata), kind "sealed", "deleted" or
    /// "evicted"; None when `timeout` seconds pass first (None: wait forever) or after
    /// `close`. A stream the daemon ended raises vovp.ConnectionError.
    #[pyo3(signature = (timeout = None))]
    fn next<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
    ) -> PyResult<Option<Notification<'py>>> {
        let timeout = timeout_of(timeout)?;
        let got = py.allow_threads(|| {
            let mut stream = self.stream.lock().unwrap_or_else(|e| e.into_inner());
            match stream.as_mut() {
                Some(sub) => sub.next(timeout),
                None => Ok(None),
            }
        });
        match got {
            Ok(Some(n)) => {
                let kind = match n.kind {
                    vovp_types::NotificationKind::Sealed => "sealed",
                    vovp_types::NotificationKind::Deleted => "deleted",
                    vovp_types::NotificationKind::Evicted => "evicted",
                };
                Ok(Some((
                    kind,
                    n.name.to_string(),
                    n.size,
                    PyBytes::new(py, &n.metadata),
                )))
            }
            Ok(None) => Ok(None),
            Err(_) if self.closed.load(Ordering::Acquire) => Ok(None),
            Err(e) => Err(to_py(e)),
        }
    }

    /// Ends the stream; a `next` waiting in another thread returns None.
    fn close(&self, py: Python<'_>) {
        self.closed.store(true, Ordering::Release);
        self.closer.close();
        py.allow_threads(|| {
            let mut stream = self.stream.lock().unwrap_or_else(|e| e.into_inner());
            *stream = None;
        });
    }
}

/// What a put gives back.
enum Put {
    Kept(Box<Object>),
    Id(u64),
    /// Stored, or sent without waiting: no id.
    Sent,
}

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
struct Object {
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
    process: u64,
}

/// A view that reached a forked child (a copy of the parent's memory) must not send a RELEASE
/// on the parent's socket: the reference is the parent's.
fn forget_in_child<T>(slot: &Mutex<Option<T>>, process: u64) {
    if this_process() != process {
        if let Some(v) = slot.lock().ok().and_then(|mut v| v.take()) {
            std::mem::forget(v);
        }
    }
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
    fn writable(client: &RustClient, v: ObjectView) -> Result<Self, Error> {
        let o = Object::new(v);
        o.make_writable(client)?;
        Ok(o)
    }

    fn make_writable(&self, client: &RustClient) -> Result<(), Error> {
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

    fn address_now(&self) -> usize {
        self.writable.get().map_or(self.ptr, |(p, _)| *p)
    }

    fn new(v: ObjectView) -> Self {
        Object {
            device: std::sync::OnceLock::new(),
            writable: std::sync::OnceLock::new(),
            id: v.id().get(),
            name: v.name().to_string(),
            size: v.size(),
            ptr: v.as_ptr() as usize,
            metadata: v.metadata().to_vec(),
            location: v.location(),
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
struct Buffer {
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
    fn new(mut b: ObjectBuffer) -> Self {
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

/// Number of store pools this process has mapped through CUDA IPC (diagnostics and tests).
#[pyfunction]
fn open_pools() -> usize {
    vovp_gpu::ipc::open_pools()
}

// --- CUDA: `vovp.cuda`'s driver checks and copies, through the gpu crate ----------------------
//
// The driver is loaded at the first of these calls, never at import. Every call releases the
// GIL around the driver (a copy of a large tensor takes milliseconds), and puts back the
// thread's current CUDA context afterwards (the gpu crate does: torch's current device must not
// change under the caller).

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

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    static COUNT_FORKS: std::sync::Once = std::sync::Once::new();
    // SAFETY: the handler only bumps an atomic, which is async-signal-safe as a fork child
    // handler must be.
    let mut registered = true;
    COUNT_FORKS.call_once(|| unsafe {
        registered = libc::pthread_atfork(None, None, Some(count_fork_in_child)) == 0;
    });
    if !registered {
        // (Only ENOMEM.) Without the handler a forked child could not tell its parent's
        // objects from its own: refuse to load rather than talk on the parent's socket.
        return Err(PyValueError::new_err(
            "vovp._native: pthread_atfork failed (out of memory)",
        ));
    }
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
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<Client>()?;
    m.add_class::<Object>()?;
    m.add_class::<Buffer>()?;
    m.add_class::<Subscription>()?;
    Ok(())
}
