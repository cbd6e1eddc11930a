//! Fork detection: a view or client that reached a forked child is its parent's.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// Forks so far, counted in each child (a `pthread_atfork` handler, installed at import):
/// "was this made in this process" is then one atomic load. It was a `getpid` system call per
/// check (glibc no longer caches the pid), ~30% of a get+release's time.
static FORKS: AtomicU64 = AtomicU64::new(0);

extern "C" fn count_fork_in_child() {
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// This process's identity for fork checks: equal to an earlier reading iff no fork happened
/// in between on the way to this process.
pub(crate) fn this_process() -> u64 {
    FORKS.load(Ordering::Relaxed)
}

/// A view that reached a forked child (a copy of the parent's memory) must not send a RELEASE
/// on the parent's socket: the reference is the parent's.
pub(crate) fn forget_in_child<T>(slot: &Mutex<Option<T>>, process: u64) {
    if this_process() != process {
        if let Some(v) = slot.lock().ok().and_then(|mut v| v.take()) {
            std::mem::forget(v);
        }
    }
}

/// Installs the fork counter (once per process; called at import).
pub(crate) fn count_forks() -> PyResult<()> {
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
    Ok(())
}
