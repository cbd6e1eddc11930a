//! The atomics the protocol uses: std's, or loom's when model checking (`--cfg loom`), so the
//! same protocol code is what loom explores.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicU64};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicU64};

/// What a bounded spin does between tries: under loom it must yield, or loom never schedules
/// the writer the reader is waiting for.
#[inline]
pub(crate) fn spin() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::hint::spin_loop();
}
