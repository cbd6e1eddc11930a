//! `vovp._native.Subscription`: a notification stream.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::client::timeout_of;
use crate::errors::to_py;

/// (kind, name, size, metadata) of one notification.
type Notification<'py> = (&'static str, String, u64, Bound<'py, PyBytes>);

/// A notification stream (SUBSCRIBE on a connection of its own).
///
/// Frozen, with the stream behind a mutex, so that `close` from another thread can end a
/// `next` that waits (with the GIL released) in a reader thread: vovp.plasma's relay does.
#[pyclass(module = "vovp._native", name = "Subscription", frozen)]
pub(crate) struct PySubscription {
    pub(crate) stream: Mutex<Option<vovp_client::Subscription>>,
    pub(crate) closer: vovp_client::SubscriptionCloser,
    pub(crate) closed: AtomicBool,
}

#[pymethods]
impl PySubscription {
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
                    vovp_types::NotificationKind::Replaced => "replaced",
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
