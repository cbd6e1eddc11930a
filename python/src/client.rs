//! `vovp._native.Client`: a connection to the daemon (the Rust client's), the requests the
//! Python layer makes, and the argument conversions they share.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use vovp_client::{Client as RustClient, ClientOptions};
use vovp_types::{CreateOptions, Error, ObjectView, Store};

use crate::array::Layout;
use crate::errors::to_py;
use crate::process::this_process;
use crate::put::{self, PyPutOptions};
use crate::subscription::PySubscription;
use crate::views::{Buffer, Object};

/// A batch item as `put_batch` takes it: (name, src, metadata, layout, writable).
type BatchItem<'py> = (
    String,
    Bound<'py, PyAny>,
    Vec<u8>,
    Option<(String, u32, Vec<isize>)>,
    bool,
);

pub(crate) fn timeout_of(seconds: Option<f64>) -> PyResult<Option<Duration>> {
    match seconds {
        None => Ok(None),
        Some(s) if s.is_finite() && s >= 0.0 => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => Err(PyValueError::new_err(format!(
            "timeout must be a non-negative number of seconds, not {s}"
        ))),
    }
}

/// A connection to a `vovp-engine` daemon.
#[pyclass(module = "vovp._native", frozen)]
pub(crate) struct Client {
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

    /// The one put every put from Python makes: `data` with `metadata` as object `name`, the
    /// way the Rust client's route picks for `options` (the GIL let go meanwhile); a kept
    /// result shown with `layout` when given.
    fn put_bytes(
        &self,
        py: Python<'_>,
        name: &str,
        data: &[u8],
        metadata: &[u8],
        options: &PyPutOptions,
        layout: Option<Layout>,
    ) -> PyResult<PyObject> {
        let inner = self.usable()?;
        let asked = put::route_options(inner, options);
        let answer = py
            .allow_threads(|| {
                let outcome = inner.put_with(name, data, metadata, asked)?;
                put::answer(inner, outcome, name, metadata, options)
            })
            .map_err(to_py)?;
        answer.into_py(py, layout)
    }

    /// The batch behind `put_batch`: per item (name, bytes, metadata, result layout,
    /// writable) its result or its exception (see `vovp_client::Client::put_batch`).
    #[allow(clippy::type_complexity)]
    fn put_items(
        &self,
        py: Python<'_>,
        items: Vec<(&str, &[u8], &[u8], Option<Layout>, bool)>,
        options: &PyPutOptions,
    ) -> PyResult<Vec<PyObject>> {
        let inner = self.usable()?;
        let asked = put::route_options(inner, options);
        let answers = py.allow_threads(|| {
            let puts: Vec<_> = (items.iter())
                .map(|&(name, data, metadata, _, _)| (name, data, metadata))
                .collect();
            let outcomes = inner.put_batch(&puts, asked)?;
            let answers = (outcomes.into_iter().zip(&items))
                .map(|(outcome, &(name, _, metadata, _, writable))| {
                    let options = PyPutOptions {
                        writable: options.writable || writable,
                        ..*options
                    };
                    put::answer(inner, outcome?, name, metadata, &options)
                })
                .collect::<Vec<_>>();
            Ok::<_, Error>(answers)
        });
        (answers.map_err(to_py)?.into_iter().zip(items))
            .map(|(answer, (_, _, _, layout, _))| match answer {
                Ok(a) => a.into_py(py, layout),
                Err(e) => Ok(to_py(e).into_value(py).into_any()),
            })
            .collect()
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
        // and retaking it would cost more than the get). The rest waits without it, asked of
        // the store alone (the directory is looked in once).
        let part = inner.get_shared(&refs);
        let views = match part.rest() {
            rest if rest.is_empty() => part.fill(Vec::new()),
            rest => {
                let got = py
                    .allow_threads(|| inner.get_from_store(&rest, timeout))
                    .map_err(to_py)?;
                part.fill(got)
            }
        };
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
    /// `newer_than`: only a version above it is found (and waited for).
    #[pyo3(signature = (name, timeout = None, writable = false, newer_than = 0))]
    fn get1(
        &self,
        py: Python<'_>,
        name: &str,
        timeout: Option<f64>,
        writable: bool,
        newer_than: u64,
    ) -> PyResult<Option<Object>> {
        let inner = self.usable()?;
        let timeout = timeout_of(timeout)?;
        // As `get`: the shared directory with the GIL held, the socket without it (an older
        // version the directory gave is let go at once; the directory is looked in once).
        let names = [name];
        let held = inner.get_shared(&names).fill(Vec::new()).pop().flatten();
        let view = match vovp_shm::held::newer(held, newer_than) {
            Some(v) => Some(v),
            None if newer_than > 0 => {
                match py.allow_threads(|| inner.get_newer_from_store(name, newer_than, timeout)) {
                    Ok(v) => Some(v),
                    Err(Error::NotFound(_)) => None,
                    Err(e) => return Err(to_py(e)),
                }
            }
            None => py
                .allow_threads(|| inner.get_from_store(&names, timeout))
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

    /// The one put: the bytes of `src` (a C-contiguous array: numpy's, or anything with
    /// `__array_struct__`) with `metadata` as object `name`, as `options` asks. Returns the
    /// store's copy (an `Object`) when kept, shown with `layout` ((kind, itemsize, shape) of
    /// exactly its bytes) when given; else the new object's id, or None when `pipelined`.
    /// With `framework` (the tensor header's last byte), `src` is a tensor `put_tensor`
    /// stores as it is (C-contiguous, little-endian, a dtype the header names): its header
    /// and layout are made here from one read of its `__array_struct__` (`metadata` and
    /// `layout` unused), and any other array is None, nothing sent.
    #[pyo3(signature = (name, src, options, metadata = b"".as_slice(), layout = None, framework = None))]
    #[allow(clippy::too_many_arguments)]
    fn put_with(
        &self,
        py: Python<'_>,
        name: &str,
        src: &Bound<'_, PyAny>,
        options: PyPutOptions,
        metadata: &[u8],
        layout: Option<(String, u32, Vec<isize>)>,
        framework: Option<u8>,
    ) -> PyResult<PyObject> {
        if let Some(framework) = framework {
            let Some(source) = crate::array::tensor_source(src)? else {
                return Ok(py.None());
            };
            let header = crate::tensor::host_header(source.dtype, &source.layout.shape, framework);
            let layout = Some(source.layout);
            return self.put_bytes(py, name, source.data, &header, &options, layout);
        }
        let (data, layout) = crate::array::source_with_layout(src, layout)?;
        self.put_bytes(py, name, data, metadata, &options, layout)
    }

    /// `put_with` of every (name, src, metadata, layout, writable) of `items` with `options`
    /// (`writable`: this item's result is, whatever `options` says), the kept ones batched
    /// (`vovp_client::Client::put_batch`): per item its result, or its exception.
    #[pyo3(signature = (items, options))]
    fn put_batch(
        &self,
        py: Python<'_>,
        items: Vec<BatchItem<'_>>,
        options: PyPutOptions,
    ) -> PyResult<Vec<PyObject>> {
        let mut prepared = Vec::with_capacity(items.len());
        for (name, src, metadata, layout, writable) in &items {
            let (data, layout) = crate::array::source_with_layout(src, layout.clone())?;
            prepared.push((name.as_str(), data, metadata.as_slice(), layout, *writable));
        }
        self.put_items(py, prepared, &options)
    }

    /// CREATE: an unsealed object of `size` bytes that only this client may write; on
    /// cuda:`device` when given; `version`: it seals as exactly that version of the name.
    #[pyo3(signature = (name, size, metadata = b"".as_slice(), ephemeral = false, device = None, replace = false, version = None))]
    #[allow(clippy::too_many_arguments)]
    fn create(
        &self,
        py: Python<'_>,
        name: &str,
        size: u64,
        metadata: &[u8],
        ephemeral: bool,
        device: Option<u32>,
        replace: bool,
        version: Option<u64>,
    ) -> PyResult<Buffer> {
        let inner = self.usable()?;
        let opts = CreateOptions {
            ephemeral,
            device: device.map(vovp_types::Device::Cuda),
            replace,
            version,
            ..Default::default()
        };
        let buf = py
            .allow_threads(|| inner.create(name, size, metadata, opts))
            .map_err(to_py)?;
        Ok(Buffer::new(buf))
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

    /// SEAL by name (the creator's connection): the version it became.
    fn seal(&self, py: Python<'_>, name: &str) -> PyResult<u64> {
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
                d.set_item("version", o.version)?;
                d.set_item("spilled", o.spilled)?;
                Ok(d)
            })
            .collect()
    }

    /// Makes `obj`'s view writable (before any array over it is made): in place for this
    /// client's own arenas, else through a private copy-on-write mapping.
    fn make_writable(&self, py: Python<'_>, obj: &Object) -> PyResult<()> {
        let inner = self.usable()?;
        // With the GIL held when the segment's writable mapping exists already (every torch
        // get after the first of a segment): no system call, and giving the GIL up and
        // taking it back would cost more than the rest.
        if obj.writable_mapping_ready(inner) {
            return obj.make_writable(inner).map_err(to_py);
        }
        py.allow_threads(|| obj.make_writable(inner)).map_err(to_py)
    }

    /// A notification stream on a new connection to the same daemon.
    fn subscribe(&self, py: Python<'_>) -> PyResult<PySubscription> {
        let inner = self.usable()?;
        let sub = py.allow_threads(|| inner.subscribe()).map_err(to_py)?;
        let closer = sub.closer().map_err(to_py)?;
        Ok(PySubscription {
            stream: Mutex::new(Some(sub)),
            closer,
            closed: AtomicBool::new(false),
        })
    }

    /// FETCH: copies `name` at `version` from the engine whose transfer port is `source`
    /// (`"ip:port"`) into this client's store, sealed there as exactly that version, and
    /// returns it as `get1` would (an `Object` holding one reference). A version this store
    /// has already (or a newer one) is returned without a transfer; concurrent fetches of
    /// one name and version on one engine share one transfer. `streams`: parallel TCP streams
    /// at most (0: the engine's choice by size); `timeout`: seconds for the whole transfer
    /// (None: the engine's 60 s); `base_version` + `base_ranges` (a list of `(offset, len)`):
    /// ranges copied from this store's `base_version` of the name instead of fetched.
    /// Raises `TransferFailed`, `StaleVersion`, `ObjectNotFound` (no such base here),
    /// `OutOfMemory`; a `VovpError` when this engine has no transfer key.
    #[pyo3(signature = (source, name, version, streams = 0, timeout = None, base_version = None, base_ranges = None, writable = false))]
    #[allow(clippy::too_many_arguments)]
    fn fetch_from(
        &self,
        py: Python<'_>,
        source: &str,
        name: &str,
        version: u64,
        streams: u16,
        timeout: Option<f64>,
        base_version: Option<u64>,
        base_ranges: Option<Vec<(u64, u64)>>,
        writable: bool,
    ) -> PyResult<Object> {
        let inner = self.usable()?;
        let base = match (base_version, base_ranges) {
            (Some(version), ranges) => Some(vovp_client::FetchBase {
                version,
                ranges: ranges.unwrap_or_default(),
            }),
            (None, Some(_)) => {
                return Err(PyValueError::new_err("base_ranges need a base_version"));
            }
            (None, None) => None,
        };
        let options = vovp_client::FetchOptions {
            streams,
            timeout: timeout_of(timeout)?,
            base,
        };
        py.allow_threads(|| {
            let v = inner.fetch_from(source, name, version, &options)?;
            match writable {
                true => Object::writable(inner, v),
                false => Ok(Object::new(v)),
            }
        })
        .map_err(to_py)
    }

    /// GATHER: rows `ids` (a sequence of ints, or a C-contiguous uint64/int64 array) of
    /// `name` at `version`, held by the engine at `source`: row `i` is bytes `i * row_bytes
    /// ..` of it. Returns a new ephemeral object named `into` of `len(ids) * row_bytes` bytes,
    /// the rows in the order of `ids` (repeats allowed), gone with its last reference. Errors
    /// as `fetch_from`'s (a row past the end is `TransferFailed`).
    #[pyo3(signature = (source, name, version, row_bytes, ids, into, timeout = None))]
    #[allow(clippy::too_many_arguments)]
    fn gather_from(
        &self,
        py: Python<'_>,
        source: &str,
        name: &str,
        version: u64,
        row_bytes: u64,
        ids: &Bound<'_, PyAny>,
        into: &str,
        timeout: Option<f64>,
    ) -> PyResult<Object> {
        let inner = self.usable()?;
        let ids = row_ids(ids)?;
        let timeout = timeout_of(timeout)?;
        py.allow_threads(|| {
            inner.gather_from(source, name, version, row_bytes, &ids, into, timeout)
        })
        .map(Object::new)
        .map_err(to_py)
    }

    /// The engine's transfer port (`"ip:port"`), or None when it serves none.
    fn transfer_address(&self, py: Python<'_>) -> PyResult<Option<String>> {
        let inner = self.usable()?;
        py.allow_threads(|| inner.transfer_address()).map_err(to_py)
    }

    /// TRANSFER_INFO: `(address or None, {counter: value})` (streams served, refusals by
    /// reason, fetches, bytes).
    fn transfer_info<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Option<String>, Bound<'py, PyDict>)> {
        let inner = self.usable()?;
        let info = py.allow_threads(|| inner.transfer_info()).map_err(to_py)?;
        let counters = PyDict::new(py);
        for (name, value) in info.counters {
            counters.set_item(name, value)?;
        }
        Ok((info.address, counters))
    }

    /// The daemon's metrics in the Prometheus text format (METRICS).
    fn metrics(&self, py: Python<'_>) -> PyResult<String> {
        let inner = self.usable()?;
        py.allow_threads(|| inner.metrics()).map_err(to_py)
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

/// Row ids as GATHER sends them: a C-contiguous array of 64-bit integers read in place, or
/// any sequence of ints.
fn row_ids(ids: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if let Some(src) = crate::array::tensor_source(ids)? {
        if matches!(src.dtype, vovp_types::DType::U64 | vovp_types::DType::I64) {
            return Ok(src
                .data
                .chunks_exact(8)
                .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
                .collect());
        }
    }
    ids.extract::<Vec<u64>>()
}
