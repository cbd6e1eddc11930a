//! Thin, never-panicking layer over cudarc's raw driver bindings, shared by the client side
//! (`ipc`) and the store's device pools (`vovp-gpu-pool`, through `crate::primary`).
//!
//! Why raw `sys` calls rather than cudarc's safe API: we need CUDA IPC (not wrapped there), full
//! control over which context is current, and no `unwrap`/`expect` between us and the driver.
//!
//! Two failure modes are turned into errors here:
//! * the driver library is missing: cudarc's first call would `panic!` while loading it, so
//!   [`cuda_available`] tries to load it (the names cudarc tries) before the first call ever
//!   happens, and checks that every entry point the store uses is there;
//! * a symbol is missing (a driver older than the bindings): cudarc panics on first use of that
//!   symbol; every call goes through [`cu`], which catches the unwind (belt and braces: this
//!   only helps with `panic = "unwind"`, the default).

use std::collections::HashMap;
use std::ffi::{c_char, c_int, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{LazyLock, Mutex, OnceLock};

use cudarc::driver::sys::{self, CUresult};

use crate::GpuError;

/// Runs one driver call. A non-success code becomes [`GpuError::Driver`] naming the call; a panic
/// inside cudarc (library or symbol not loadable) becomes [`GpuError::GpuUnavailable`].
pub fn cu(what: &str, f: impl FnOnce() -> CUresult) -> Result<(), GpuError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(CUresult::CUDA_SUCCESS) => Ok(()),
        Ok(code) => Err(GpuError::Driver(format!("{what}: {}", describe(code)))),
        Err(panic) => Err(GpuError::GpuUnavailable(format!(
            "{what}: the CUDA driver library could not be used: {}",
            panic_text(&panic)
        ))),
    }
}

/// Re-labels a driver failure as "the GPU is unavailable": used during initialisation, where any
/// failure means the store runs without GPU support rather than a failed request.
pub(crate) fn unavailable(e: GpuError) -> GpuError {
    match e {
        GpuError::Driver(m) => GpuError::GpuUnavailable(m),
        other => other,
    }
}

/// `CUDA_ERROR_NO_DEVICE (no CUDA-capable device is detected)`.
fn describe(code: CUresult) -> String {
    let text = |f: unsafe fn(CUresult, *mut *const c_char) -> CUresult| {
        catch_unwind(|| {
            let mut p: *const c_char = std::ptr::null();
            // SAFETY: the driver writes a pointer to a static NUL-terminated string on success.
            let rc = unsafe { f(code, &mut p) };
            if rc == CUresult::CUDA_SUCCESS && !p.is_null() {
                // SAFETY: see above; the string lives as long as the driver library.
                Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
            } else {
                None
            }
        })
        .ok()
        .flatten()
    };
    let name = text(sys::cuGetErrorName).unwrap_or_else(|| format!("{code:?}"));
    match text(sys::cuGetErrorString) {
        Some(s) => format!("{name} ({s})"),
        None => name,
    }
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

/// Process-wide driver initialisation, done once: the answer (including the reason for failure)
/// is cached, since neither a missing library nor a failed `cuInit` fixes itself. On success it
/// holds the device count and the id of the process that initialised the driver.
static INIT: OnceLock<Result<(u32, u32), GpuError>> = OnceLock::new();

/// Set by [`simulate_library_names`] (tests): the reason this process acts as if it had no
/// driver, checked before [`INIT`]. The flag keeps the normal path free of the lock.
static SIMULATED: AtomicBool = AtomicBool::new(false);
static SIMULATED_REASON: Mutex<Option<String>> = Mutex::new(None);

/// Entry points the store uses (daemon and client side). Checked once at initialisation so that
/// a driver too old for one of them is a clear `GpuUnavailable` up front, not a failure (a
/// caught cudarc panic) in the middle of some later request.
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDevicePrimaryCtxRetain",
    "cuCtxSetCurrent",
    "cuCtxGetCurrent",
    "cuMemGetInfo_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemGetAddressRange_v2",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuPointerGetAttribute",
    "cuStreamCreate",
    "cuStreamSynchronize",
    "cuStreamDestroy_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
];

/// Cheap check that the CUDA driver loads, initialises and sees at least one device.
///
/// The first call loads `libcuda.so` and runs `cuInit` (tens to hundreds of milliseconds on a GPU
/// machine, microseconds without one); later calls return the cached answer.
pub fn cuda_available() -> Result<(), GpuError> {
    device_count().map(|_| ())
}

/// Number of visible devices, initialising the driver on first use; `GpuUnavailable(reason)`
/// without a usable driver, and in a process forked from one that initialised it (CUDA state
/// does not survive `fork`: the child's driver calls would fail or hang).
pub fn device_count() -> Result<u32, GpuError> {
    if SIMULATED.load(Ordering::Acquire) {
        let reason = SIMULATED_REASON
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(reason) = reason {
            return Err(GpuError::GpuUnavailable(reason));
        }
    }
    let (count, pid) = INIT.get_or_init(init).clone()?;
    if pid != std::process::id() {
        return Err(GpuError::GpuUnavailable(
            "CUDA cannot be used in a process forked from one that initialised it; start the \
             child with the 'spawn' method"
                .to_string(),
        ));
    }
    Ok(count)
}

/// `device` as an ordinal the driver sees, or `GpuUnavailable` naming the devices that exist.
/// Takes an `i64` so that callers with signed ordinals (Python) get the same answer for -1 as
/// for 99.
pub fn check_device(device: i64) -> Result<u32, GpuError> {
    let count = device_count()?;
    match u32::try_from(device) {
        Ok(d) if d < count => Ok(d),
        _ => Err(GpuError::GpuUnavailable(format!(
            "cuda:{device} does not exist: the driver sees {count} device(s) (cuda:0..cuda:{})",
            count - 1
        ))),
    }
}

/// Why none of `names` can be loaded, or `None` when one can (it is unloaded again; cudarc
/// loads its own handle). Only dlopen is tried: nothing of the library runs but its
/// initialisers.
fn library_missing(names: &[String]) -> Option<String> {
    let mut errors = Vec::new();
    for name in names {
        // SAFETY: loading a shared library runs its initialisers; the CUDA driver's (and the
        // fake's) have no preconditions. Nothing is called through the handle.
        match unsafe { libloading::Library::new(name) } {
            Ok(_) => return None,
            // libloading's Display is only "dlopen failed"; dlerror's text is the source.
            Err(e) => errors.push(match std::error::Error::source(&e) {
                Some(why) => why.to_string(),
                None => e.to_string(),
            }),
        }
    }
    // The first error says why (usually "cannot open shared object file"); the others repeat it.
    let first = errors
        .first()
        .cloned()
        .unwrap_or_else(|| "no name to try".into());
    let more = match errors.len() {
        0 | 1 => String::new(),
        n => format!("; and {} other name(s)", n - 1),
    };
    Some(format!(
        "the CUDA driver library (libcuda.so.1 / libcuda.so) was not found: no NVIDIA driver \
         is installed, or its directory is not on the library path (LD_LIBRARY_PATH) \
         [{first}{more}]"
    ))
}

/// The names cudarc tries (and loads the first of), so that this check and cudarc agree.
fn library_names() -> Vec<String> {
    catch_unwind(|| cudarc::get_lib_name_candidates("cuda"))
        .unwrap_or_else(|_| vec!["libcuda.so".to_string(), "libcuda.so.1".to_string()])
}

/// Test hook: from now on this process acts as if the driver library were looked up under
/// `names`. If none of them loads, every entry point answers `GpuUnavailable` with the
/// missing-library reason (as on a machine without a driver). If one loads, or with `None`,
/// the process's real driver state applies again: the library cudarc loaded stays loaded (it
/// cannot be swapped while the process runs), so this can only simulate a *missing* driver.
/// Mappings, contexts and streams are left as they are.
pub fn simulate_library_names(names: Option<&[String]>) {
    let reason = names.and_then(library_missing);
    let mut slot = SIMULATED_REASON.lock().unwrap_or_else(|e| e.into_inner());
    SIMULATED.store(reason.is_some(), Ordering::Release);
    *slot = reason;
}

fn init() -> Result<(u32, u32), GpuError> {
    // cudarc's own loader would panic on a missing library: find out first, with the reason.
    if let Some(reason) = library_missing(&library_names()) {
        return Err(GpuError::GpuUnavailable(reason));
    }
    check_symbols()?;
    // SAFETY: cuInit has no preconditions.
    cu("cuInit", || unsafe { sys::cuInit(0) }).map_err(unavailable)?;
    let mut n: c_int = 0;
    // SAFETY: writes one int.
    cu("cuDeviceGetCount", || unsafe {
        sys::cuDeviceGetCount(&mut n)
    })
    .map_err(unavailable)?;
    if n <= 0 {
        let visible = std::env::var("CUDA_VISIBLE_DEVICES")
            .map(|v| format!(" (CUDA_VISIBLE_DEVICES={v:?})"))
            .unwrap_or_default();
        return Err(GpuError::GpuUnavailable(format!(
            "the CUDA driver sees no device{visible}"
        )));
    }
    Ok((n as u32, std::process::id()))
}

/// `GpuUnavailable` naming the first entry point of [`REQUIRED_SYMBOLS`] the library lacks.
fn check_symbols() -> Result<(), GpuError> {
    let missing = catch_unwind(|| {
        // SAFETY: the library was found above, so culib() loads rather than panics (and a
        // panic is caught anyway); symbols are only looked up, never called here.
        let lib = unsafe { sys::culib() };
        REQUIRED_SYMBOLS
            .iter()
            // SAFETY: looking a symbol up has no side effects.
            .find(|s| unsafe { lib.get::<unsafe extern "C" fn()>(s.as_bytes()) }.is_err())
            .copied()
    })
    .map_err(|p| {
        GpuError::GpuUnavailable(format!(
            "the CUDA driver library could not be loaded: {}",
            panic_text(&p)
        ))
    })?;
    match missing {
        None => Ok(()),
        Some(s) => Err(GpuError::GpuUnavailable(format!(
            "the CUDA driver library has no {s}: the driver is too old"
        ))),
    }
}

/// Puts back, when dropped, the context that was current on the calling thread when it was made.
///
/// Why: the client-side helpers are called from threads of the caller's own program, e.g. a
/// Python thread running torch code on another device; leaving one of our primary contexts
/// current would change `torch.cuda.current_device()` under its feet. (`cuCtxPushCurrent` /
/// `cuCtxPopCurrent` would do the same; get / set is what the fake driver of `gpu/fake-cuda`
/// implements.)
pub(crate) struct RestoreCurrent(sys::CUcontext);

impl RestoreCurrent {
    /// Records the current context; `GpuUnavailable` without a usable driver.
    pub(crate) fn save() -> Result<Self, GpuError> {
        device_count()?;
        let mut current: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context handle.
        cu("cuCtxGetCurrent", || unsafe {
            sys::cuCtxGetCurrent(&mut current)
        })?;
        Ok(RestoreCurrent(current))
    }

    /// The context that was current (null: none).
    pub(crate) fn previous(&self) -> sys::CUcontext {
        self.0
    }
}

impl Drop for RestoreCurrent {
    fn drop(&mut self) {
        let prev = self.0;
        // Best effort: failing to restore must not hide the real result (if any).
        // SAFETY: prev was current on this thread (or null, which unsets), so it is live.
        if let Err(e) = cu("cuCtxSetCurrent", || unsafe { sys::cuCtxSetCurrent(prev) }) {
            tracing::debug!("restoring the caller's CUDA context: {e}");
        }
    }
}

/// The driver's CUDA version, e.g. 12080 for 12.8.
pub(crate) fn driver_version() -> Result<i32, GpuError> {
    cuda_available()?;
    let mut v: c_int = 0;
    // SAFETY: writes one int.
    cu("cuDriverGetVersion", || unsafe {
        sys::cuDriverGetVersion(&mut v)
    })?;
    Ok(v)
}

/// A device's primary context, retained for the life of the process.
///
/// Why the primary context: it is the one the CUDA runtime (PyTorch, CuPy) uses, so pointers we
/// hand out (IPC mappings in particular) are valid in the caller's framework without any context
/// juggling. Why never released: releasing the last reference destroys the context and everything
/// in it, and re-creating one costs ~100 ms and hundreds of MiB of device memory; the runtime makes
/// the same choice.
pub struct PrimaryCtx {
    pub(crate) ordinal: u32,
    pub(crate) dev: sys::CUdevice,
    ctx: sys::CUcontext,
}

// SAFETY: a CUDA context is a driver handle usable from any thread (that is what
// cuCtxSetCurrent is for); the raw pointer is never dereferenced by us.
unsafe impl Send for PrimaryCtx {}
// SAFETY: as above; the struct is immutable after creation.
unsafe impl Sync for PrimaryCtx {}

impl std::fmt::Debug for PrimaryCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PrimaryCtx(cuda:{})", self.ordinal)
    }
}

impl PrimaryCtx {
    /// The device's ordinal.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// Makes this context current on the calling thread. Needed before every batch of driver
    /// calls: actors and clients run on thread pools, so "current" is never a given.
    pub fn make_current(&self) -> Result<(), GpuError> {
        // SAFETY: ctx is a live primary context (retained forever).
        cu("cuCtxSetCurrent", || unsafe {
            sys::cuCtxSetCurrent(self.ctx)
        })
    }
}

/// Retained primary contexts by ordinal; entries are leaked on purpose (see [`PrimaryCtx`]).
static CONTEXTS: LazyLock<Mutex<HashMap<u32, &'static PrimaryCtx>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// The primary context of device `ordinal`, made current on the calling thread.
pub fn context(ordinal: u32) -> Result<&'static PrimaryCtx, GpuError> {
    check_device(i64::from(ordinal))?;
    let ctx = {
        // A poisoned lock only means another thread panicked while holding it; the map itself is
        // always consistent (one insert), so carry on.
        let mut map = CONTEXTS.lock().unwrap_or_else(|e| e.into_inner());
        match map.get(&ordinal) {
            Some(c) => *c,
            None => {
                let mut dev: sys::CUdevice = 0;
                // SAFETY: writes one device handle; ordinal was checked against the count.
                cu("cuDeviceGet", || unsafe {
                    sys::cuDeviceGet(&mut dev, ordinal as c_int)
                })
                .map_err(unavailable)?;
                let mut raw: sys::CUcontext = std::ptr::null_mut();
                // SAFETY: dev came from cuDeviceGet.
                cu("cuDevicePrimaryCtxRetain", || unsafe {
                    sys::cuDevicePrimaryCtxRetain(&mut raw, dev)
                })
                .map_err(unavailable)?;
                let c: &'static PrimaryCtx = Box::leak(Box::new(PrimaryCtx {
                    ordinal,
                    dev,
                    ctx: raw,
                }));
                map.insert(ordinal, c);
                c
            }
        }
    };
    ctx.make_current()?;
    Ok(ctx)
}

/// The device's name, e.g. "NVIDIA H200".
pub(crate) fn device_name(ctx: &PrimaryCtx) -> Result<String, GpuError> {
    let mut buf = [0u8; 256];
    // SAFETY: the driver writes at most buf.len() bytes.
    cu("cuDeviceGetName", || unsafe {
        sys::cuDeviceGetName(buf.as_mut_ptr().cast(), buf.len() as c_int, ctx.dev)
    })?;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
}

/// (free, total) bytes of the device whose context is current.
pub fn mem_info(ctx: &PrimaryCtx) -> Result<(u64, u64), GpuError> {
    ctx.make_current()?;
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: writes two size_t.
    cu("cuMemGetInfo", || unsafe {
        sys::cuMemGetInfo_v2(&mut free, &mut total)
    })?;
    Ok((free as u64, total as u64))
}

/// What the driver sees, for the daemon's startup log and for tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// CUDA version the driver supports, e.g. 12080 for 12.8.
    pub driver_version: i32,
    pub devices: Vec<DeviceInfo>,
}

/// One visible device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Ordinal as this process sees it (after `CUDA_VISIBLE_DEVICES`).
    pub ordinal: u32,
    pub name: String,
    pub total_memory: u64,
    /// Free device memory at the time of the probe.
    pub free_memory: u64,
}

/// Describes the driver and every visible device. Without a usable driver this is
/// `Err(GpuUnavailable(reason))`, never a panic.
///
/// Note: reading free memory needs each device's primary context, so this creates them (they are
/// kept for the life of the process and reused by the pool and the client helpers).
pub fn probe() -> Result<GpuInfo, GpuError> {
    let count = device_count()?;
    let driver_version = driver_version()?;
    let mut devices = Vec::with_capacity(count as usize);
    for ordinal in 0..count {
        let ctx = context(ordinal)?;
        let (free_memory, total_memory) = mem_info(ctx)?;
        devices.push(DeviceInfo {
            ordinal,
            name: device_name(ctx)?,
            total_memory,
            free_memory,
        });
    }
    Ok(GpuInfo {
        driver_version,
        devices,
    })
}
