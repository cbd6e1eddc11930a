//! The Python core's one put: `vovp._native.PutOptions` (the Rust client's
//! [`vovp_types::PutOptions`] as one Python object, and how a kept result is shown) and what a
//! put's outcome becomes for Python. `Client.put_with` and `Client.put_batch` take it, and
//! they are the only puts the native client has, so that every put from Python takes the
//! Rust client's route (`vovp_types::put::route`).
//!
//! One frozen object rather than keyword arguments or a dict: the Python layer makes it once
//! per kind of put and passes it on every call, and reading it back here is a type check and
//! a borrow, where a dict would cost a lookup per option on every put.

use pyo3::prelude::*;
use vovp_client::{Client as RustClient, Put};
use vovp_types::Error;

use crate::array::Layout;
use crate::views::Object;

/// How a put is made (`Client.put_with`, `Client.put_batch`).
#[pyclass(module = "vovp._native", name = "PutOptions", frozen)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PyPutOptions {
    pub(crate) options: vovp_types::PutOptions,
    /// A kept result is shown writable (a torch tensor's): in place for this client's own
    /// large objects, else through a private copy-on-write mapping.
    pub(crate) writable: bool,
}

#[pymethods]
impl PyPutOptions {
    /// `device`: a CUDA device's ordinal, which a put refuses (it copies host bytes: a
    /// device object is created, then written); kept so that the refusal is the Rust route's.
    /// `version`: seal as exactly this version of the name (see [`Self::version`]).
    #[new]
    #[pyo3(signature = (*, ephemeral = false, replace = false, keep_reference = false, pipelined = false, writable = false, device = None, version = None))]
    fn new(
        ephemeral: bool,
        replace: bool,
        keep_reference: bool,
        pipelined: bool,
        writable: bool,
        device: Option<u32>,
        version: Option<u64>,
    ) -> Self {
        PyPutOptions {
            options: vovp_types::PutOptions {
                ephemeral,
                device: device.map(vovp_types::Device::Cuda),
                replace,
                keep_reference,
                pipelined,
                version,
            },
            writable,
        }
    }

    /// Seal as exactly this version of the name (above its present one, else
    /// `StaleVersion`); None: the next version.
    #[getter]
    fn version(&self) -> Option<u64> {
        self.options.version
    }

    /// Deleted at its last release.
    #[getter]
    fn ephemeral(&self) -> bool {
        self.options.ephemeral
    }

    /// The name may be taken: the put becomes its next version.
    #[getter]
    fn replace(&self) -> bool {
        self.options.replace
    }

    /// The put answers with the store's copy (an `Object`), else with its id or nothing.
    #[getter]
    fn keep_reference(&self) -> bool {
        self.options.keep_reference
    }

    /// The put may return before the store's answer (`Client.sync` reports a failure; a kept
    /// one only on a client with a release thread, see [`route_options`]).
    #[getter]
    fn pipelined(&self) -> bool {
        self.options.pipelined
    }

    /// A kept result is writable.
    #[getter]
    fn writable(&self) -> bool {
        self.writable
    }

    /// The CUDA device named, or None (host memory).
    #[getter]
    fn device(&self) -> Option<u32> {
        match self.options.device {
            Some(vovp_types::Device::Cuda(d)) => Some(d),
            Some(vovp_types::Device::Cpu) | None => None,
        }
    }

    fn __repr__(&self) -> String {
        let o = &self.options;
        let device = match self.device() {
            Some(d) => format!(", device={d}"),
            None => String::new(),
        };
        let version = o
            .version
            .map(|v| format!(", version={v}"))
            .unwrap_or_default();
        format!(
            "PutOptions(ephemeral={}, replace={}, keep_reference={}, pipelined={}, \
             writable={}{device}{version})",
            py_bool(o.ephemeral),
            py_bool(o.replace),
            py_bool(o.keep_reference),
            py_bool(o.pipelined),
            py_bool(self.writable),
        )
    }
}

fn py_bool(b: bool) -> &'static str {
    if b {
        "True"
    } else {
        "False"
    }
}

/// The options the Rust client is asked to put with: a kept put returns before the store's
/// answer only on a client with a release thread, which reads the reply of a result dropped
/// before it came (else its reference would wait for this client's next call, and
/// `release_delay=0` promises releases at once).
pub(crate) fn route_options(client: &RustClient, options: &PyPutOptions) -> vovp_types::PutOptions {
    let mut o = options.options;
    o.pipelined &= !o.keep_reference || client.defers_releases();
    o
}

/// What a put gives Python, before the GIL is taken back.
pub(crate) enum Answer {
    /// The store's copy (kept).
    Object(Box<Object>),
    /// The new object's id (not kept, waited for).
    Id(u64),
    /// Not kept, and asked not to wait: nothing (its outcome comes with `sync`).
    Nothing,
}

/// What the Rust client's `put` outcome (of `name`, with `metadata`) becomes: kept results
/// made writable when asked.
pub(crate) fn answer(
    client: &RustClient,
    put: Put,
    name: &str,
    metadata: &[u8],
    options: &PyPutOptions,
) -> Result<Answer, Error> {
    let obj = match put {
        Put::Kept(view) => Object::new(view),
        Put::Pending(view) => Object::from_pending(view, name, metadata),
        Put::Stored(id) if !options.options.pipelined => return Ok(Answer::Id(id.get())),
        Put::Stored(_) | Put::Sent => return Ok(Answer::Nothing),
    };
    if options.writable {
        obj.make_writable(client)?;
    }
    Ok(Answer::Object(Box::new(obj)))
}

impl Answer {
    /// The Python object: `layout` given, a kept result shows its bytes so.
    pub(crate) fn into_py(self, py: Python<'_>, layout: Option<Layout>) -> PyResult<PyObject> {
        match self {
            Answer::Object(obj) => {
                if let Some(layout) = layout {
                    obj.set_layout_checked(layout);
                }
                Ok(Py::new(py, *obj)?.into_any())
            }
            Answer::Id(id) => Ok(id.into_pyobject(py)?.into_any().unbind()),
            Answer::Nothing => Ok(py.None()),
        }
    }
}
