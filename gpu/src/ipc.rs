//! Client-side helpers: what a process that talks to the store uses to reach GPU objects. Like the
//! daemon side, the driver is loaded at run time and every failure is an error, never a panic.
//!
//! * [`open`] maps a [`DeviceBlock`] into this process through CUDA IPC. Each pool is opened once
//!   and shared by every view into it (refcounted); it is closed when the last view drops.
//! * [`copy_d2d`], [`copy_h2d`], [`copy_d2h`] copy on a store-owned stream and synchronise it
//!   before returning, so the bytes are in place when the call returns.
//!
//! * [`copy_d2d_on`], [`copy_h2d_on`], [`copy_d2h_on`] do the same on a named device's stream;
//!   [`device_of`] asks which device a pointer lives on; [`mem_alloc`] / [`mem_free`] make
//!   plain device buffers (tests and tools); [`sync_stream`] waits for a caller's stream.
//!
//! Everything runs in each device's primary context, the one PyTorch and CuPy use, so the
//! pointers can be wrapped by those frameworks directly. Every entry point puts back the context
//! that was current on the calling thread before (see `RestoreCurrent`): the caller's own
//! framework may be working on another device on that thread. A process forked from one that
//! initialised the driver gets `GpuUnavailable` (CUDA does not survive `fork`).
//!
//! Limits the caller must know:
//! * a process cannot open an IPC handle it exported itself: the daemon reaches its own blocks
//!   through the GPU actor's `BlockPtr` message (`vovp-actors`) instead;
//! * `DeviceBlock::device` is the daemon's ordinal: client and daemon must see the same devices in
//!   the same order (same `CUDA_VISIBLE_DEVICES`).

use std::collections::HashMap;
use std::ffi::{c_char, c_void};
use std::sync::{LazyLock, Mutex};

use cudarc::driver::sys;

use crate::driver::{self, cu, PrimaryCtx, RestoreCurrent};
use crate::{DeviceBlock, GpuError};

/// Identifies one exported pool. The handle is part of the key, not just (device, pool): after a
/// daemon restart pool 0 is new memory with a new handle, and a stale mapping must not be reused.
type Key = (u32, u32, [u8; 64]);

struct Mapping {
    base: sys::CUdeviceptr,
    /// Size of the mapped pool, to refuse blocks that would reach past it: a stray access there
    /// is a sticky error that poisons the whole CUDA context of the client (PyTorch included).
    /// `u64::MAX` if the driver could not tell.
    bytes: u64,
    views: usize,
}

/// Open pool mappings. Opening, counting and closing all happen under this one lock, so a pool
/// is never opened twice nor closed while a view is being handed out.
static MAPPINGS: LazyLock<Mutex<HashMap<Key, Mapping>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

fn mappings() -> std::sync::MutexGuard<'static, HashMap<Key, Mapping>> {
    // Poison only means a panic elsewhere while the lock was held; the map is updated in single
    // steps and stays consistent.
    MAPPINGS.lock().unwrap_or_else(|e| e.into_inner())
}

/// A block of a store pool mapped into this process. Dropping the last view of a pool unmaps it.
#[derive(Debug)]
pub struct DeviceView {
    key: Key,
    base: sys::CUdeviceptr,
    offset: u64,
    size: u64,
}

impl DeviceView {
    /// Device pointer of the block's first byte, valid in the device's primary context.
    pub fn ptr(&self) -> u64 {
        self.base + self.offset
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn device(&self) -> u32 {
        self.key.0
    }
}

impl Drop for DeviceView {
    fn drop(&mut self) {
        let mut map = mappings();
        let last = match map.get_mut(&self.key) {
            Some(m) => {
                m.views -= 1;
                m.views == 0
            }
            None => false,
        };
        if last {
            map.remove(&self.key);
            unmap(self.key.0, self.base);
        }
    }
}

/// Maps `block` into this process (opening its pool on first use) and returns a view of it.
pub fn open(block: &DeviceBlock) -> Result<DeviceView, GpuError> {
    // First, even for a pool already mapped: in a forked child (or without a driver) this is
    // GpuUnavailable, before the lock a parent thread may have held at the fork.
    driver::cuda_available()?;
    let key = (block.device, block.pool, block.ipc_handle);
    let mut map = mappings();
    let (base, bytes, fresh) = match map.get(&key) {
        Some(m) => (m.base, m.bytes, false),
        None => {
            let (base, bytes) = map_pool(block)?;
            (base, bytes, true)
        }
    };
    let fits = block
        .offset
        .checked_add(block.size)
        .is_some_and(|end| end <= bytes);
    if !fits {
        if fresh {
            unmap(block.device, base);
        }
        return Err(GpuError::Driver(format!(
            "block at offset {} of {} bytes lies outside cuda:{} pool {} ({bytes} bytes)",
            block.offset, block.size, block.device, block.pool
        )));
    }
    map.entry(key)
        .or_insert(Mapping {
            base,
            bytes,
            views: 0,
        })
        .views += 1;
    Ok(DeviceView {
        key,
        base,
        offset: block.offset,
        size: block.size,
    })
}

/// Opens the pool `block` lies in: its base address here and its size.
fn map_pool(block: &DeviceBlock) -> Result<(sys::CUdeviceptr, u64), GpuError> {
    let _restore = RestoreCurrent::save()?;
    driver::context(block.device)?;
    let handle = sys::CUipcMemHandle {
        reserved: block.ipc_handle.map(|b| b as c_char),
    };
    let mut base: sys::CUdeviceptr = 0;
    // LAZY_ENABLE_PEER_ACCESS: lets the mapping work even when the pool lives on a device other
    // than the current one (mismatched ordinals, multi-GPU nodes).
    let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
    // SAFETY: writes one device pointer; the handle is 64 opaque bytes the driver checks.
    cu("cuIpcOpenMemHandle", || unsafe {
        sys::cuIpcOpenMemHandle_v2(&mut base, handle, flags)
    })?;
    let mut start: sys::CUdeviceptr = 0;
    let mut bytes: usize = 0;
    // SAFETY: writes the allocation's start and size; base is a live mapping.
    let range = cu("cuMemGetAddressRange", || unsafe {
        sys::cuMemGetAddressRange_v2(&mut start, &mut bytes, base)
    });
    match range {
        Ok(()) => Ok((base, bytes as u64)),
        // The bounds check is a safety net, not a requirement: without the size, map anyway.
        Err(e) => {
            tracing::debug!("no size for cuda:{} pool {}: {e}", block.device, block.pool);
            Ok((base, u64::MAX))
        }
    }
}

/// Closes a pool mapping; failures are only logged (nothing a caller could do).
fn unmap(device: u32, base: sys::CUdeviceptr) {
    // Views are often dropped by a garbage collector, on whatever thread it runs: restore.
    let closed = RestoreCurrent::save().and_then(|_restore| {
        driver::context(device)?;
        // SAFETY: base came from cuIpcOpenMemHandle and no view uses it any more.
        cu("cuIpcCloseMemHandle", || unsafe {
            sys::cuIpcCloseMemHandle(base)
        })
    });
    if let Err(e) = closed {
        tracing::warn!("unmapping a GPU pool of cuda:{device}: {e}");
    }
}

/// Number of pools this process has mapped (diagnostics and tests).
pub fn open_pools() -> usize {
    mappings().len()
}

/// A stream of one device's primary context.
struct Stream(sys::CUstream);

// SAFETY: CUDA streams are driver handles usable from any thread; we never dereference them.
unsafe impl Send for Stream {}

/// Idle streams by device. A copy takes one (or makes one) and puts it back, so concurrent copies
/// from several threads each get their own stream and do not wait for each other.
static STREAMS: LazyLock<Mutex<HashMap<u32, Vec<Stream>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// Runs `work` on a pooled stream of `ctx`'s device, then waits for the stream.
fn on_stream(
    ctx: &PrimaryCtx,
    work: impl FnOnce(sys::CUstream) -> Result<(), GpuError>,
) -> Result<(), GpuError> {
    let idle = STREAMS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_mut(&ctx.ordinal)
        .and_then(Vec::pop);
    let stream = match idle {
        Some(s) => s,
        None => {
            let mut s: sys::CUstream = std::ptr::null_mut();
            // A blocking (default-flag) stream: it is ordered after work already queued on the
            // legacy default stream, which is where PyTorch's default stream puts it.
            let flags = sys::CUstream_flags::CU_STREAM_DEFAULT as u32;
            // SAFETY: writes one stream handle; the context is current.
            cu("cuStreamCreate", || unsafe {
                sys::cuStreamCreate(&mut s, flags)
            })?;
            Stream(s)
        }
    };
    let result = work(stream.0).and_then(|()| {
        // SAFETY: the stream is live.
        cu("cuStreamSynchronize", || unsafe {
            sys::cuStreamSynchronize(stream.0)
        })
    });
    match &result {
        // Only a stream whose work completed goes back; after an error it may be unusable.
        Ok(()) => STREAMS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(ctx.ordinal)
            .or_default()
            .push(stream),
        Err(_) => {
            // SAFETY: the stream is live and no longer used.
            let _ = cu("cuStreamDestroy", || unsafe {
                sys::cuStreamDestroy_v2(stream.0)
            });
        }
    }
    result
}

/// Device ordinal of the memory `ptr` points into. `restore` proves the driver is usable and
/// says whether a context is current.
fn ordinal_of(ptr: u64, restore: &RestoreCurrent) -> Result<u32, GpuError> {
    // The query itself needs some current context (the driver may answer INVALID_CONTEXT on a
    // thread without one); any device's will do, since addresses are unified.
    if restore.previous().is_null() {
        driver::context(0)?;
    }
    let mut ordinal: i32 = -1;
    // SAFETY: writes one int; any value of ptr is allowed (unknown pointers give an error).
    cu("cuPointerGetAttribute(DEVICE_ORDINAL)", || unsafe {
        sys::cuPointerGetAttribute(
            (&mut ordinal as *mut i32).cast::<c_void>(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr,
        )
    })
    .map_err(|e| GpuError::Driver(format!("{ptr:#x} is not CUDA device memory: {e}")))?;
    u32::try_from(ordinal).map_err(|_| GpuError::Driver(format!("{ptr:#x} has no device ordinal")))
}

/// The primary context of the device `ptr` lives on, made current.
fn context_of(ptr: u64, restore: &RestoreCurrent) -> Result<&'static PrimaryCtx, GpuError> {
    driver::context(ordinal_of(ptr, restore)?)
}

/// Ordinal of the device whose memory `ptr` points into (`Driver` error if it is not device
/// memory). This is what the driver says in *this* process, which may number devices differently
/// from the daemon (`CUDA_VISIBLE_DEVICES`).
pub fn device_of(ptr: u64) -> Result<u32, GpuError> {
    let restore = RestoreCurrent::save()?;
    ordinal_of(ptr, &restore)
}

fn d2d(ctx: &PrimaryCtx, dst: u64, src: u64, bytes: usize) -> Result<(), GpuError> {
    on_stream(ctx, |s| {
        // SAFETY: the caller vouches that both ranges are live device memory of `bytes` bytes;
        // the driver rejects unknown pointers.
        cu("cuMemcpyDtoDAsync", || unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, s)
        })
    })
}

fn h2d(ctx: &PrimaryCtx, dst: u64, src: &[u8]) -> Result<(), GpuError> {
    on_stream(ctx, |s| {
        // SAFETY: src is a live slice; the stream is synchronised before it can go away.
        cu("cuMemcpyHtoDAsync", || unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), s)
        })
    })
}

fn d2h(ctx: &PrimaryCtx, dst: &mut [u8], src: u64) -> Result<(), GpuError> {
    let len = dst.len();
    let ptr = dst.as_mut_ptr();
    on_stream(ctx, |s| {
        // SAFETY: dst is a live, exclusively borrowed slice; the stream is synchronised before
        // the borrow ends.
        cu("cuMemcpyDtoHAsync", || unsafe {
            sys::cuMemcpyDtoHAsync_v2(ptr.cast(), src, len, s)
        })
    })
}

/// Copies `bytes` from device memory `src` to device memory `dst` (any devices) and waits for the
/// copy. Runs in the primary context of `dst`'s device.
pub fn copy_d2d(dst: u64, src: u64, bytes: usize) -> Result<(), GpuError> {
    if bytes == 0 {
        return Ok(());
    }
    let restore = RestoreCurrent::save()?;
    d2d(context_of(dst, &restore)?, dst, src, bytes)
}

/// Copies host bytes to device memory `dst` and waits for the copy.
pub fn copy_h2d(dst: u64, src: &[u8]) -> Result<(), GpuError> {
    if src.is_empty() {
        return Ok(());
    }
    let restore = RestoreCurrent::save()?;
    h2d(context_of(dst, &restore)?, dst, src)
}

/// Copies device memory `src` into `dst` and waits for the copy.
pub fn copy_d2h(dst: &mut [u8], src: u64) -> Result<(), GpuError> {
    if dst.is_empty() {
        return Ok(());
    }
    let restore = RestoreCurrent::save()?;
    d2h(context_of(src, &restore)?, dst, src)
}

/// [`copy_d2d`] on a stream of cuda:`device` (the caller knows the device: one driver query
/// fewer). Either pointer may be on any device (unified addressing).
pub fn copy_d2d_on(device: u32, dst: u64, src: u64, bytes: usize) -> Result<(), GpuError> {
    if bytes == 0 {
        return Ok(());
    }
    let _restore = RestoreCurrent::save()?;
    d2d(driver::context(device)?, dst, src, bytes)
}

/// [`copy_h2d`] on a stream of cuda:`device`.
pub fn copy_h2d_on(device: u32, dst: u64, src: &[u8]) -> Result<(), GpuError> {
    if src.is_empty() {
        return Ok(());
    }
    let _restore = RestoreCurrent::save()?;
    h2d(driver::context(device)?, dst, src)
}

/// [`copy_d2h`] on a stream of cuda:`device`.
pub fn copy_d2h_on(device: u32, dst: &mut [u8], src: u64) -> Result<(), GpuError> {
    if dst.is_empty() {
        return Ok(());
    }
    let _restore = RestoreCurrent::save()?;
    d2h(driver::context(device)?, dst, src)
}

/// `cuMemAlloc` of `bytes` in cuda:`device`'s primary context: a plain device buffer that is not
/// store memory (tests and tools: a source to put from). Free it with [`mem_free`].
pub fn mem_alloc(device: u32, bytes: usize) -> Result<u64, GpuError> {
    let _restore = RestoreCurrent::save()?;
    driver::context(device)?;
    let mut p: sys::CUdeviceptr = 0;
    // SAFETY: writes one device pointer; the driver refuses 0 bytes and sizes it cannot serve.
    cu("cuMemAlloc", || unsafe {
        sys::cuMemAlloc_v2(&mut p, bytes)
    })?;
    Ok(p)
}

/// Frees a [`mem_alloc`] buffer (the driver refuses pointers it did not hand out).
pub fn mem_free(device: u32, ptr: u64) -> Result<(), GpuError> {
    let _restore = RestoreCurrent::save()?;
    driver::context(device)?;
    // SAFETY: the caller vouches nobody uses the buffer any more; unknown pointers are refused.
    cu("cuMemFree", || unsafe { sys::cuMemFree_v2(ptr) })
}

/// Waits for a CUDA stream handle of the caller's (`__cuda_array_interface__` v3 names streams
/// the same way: 1 = legacy default stream, 2 = per-thread default stream, other = a `CUstream`;
/// these are the driver's own values `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD`). Runs in
/// whatever context the caller has current: the stream is theirs.
pub fn sync_stream(stream: u64) -> Result<(), GpuError> {
    driver::cuda_available()?;
    // SAFETY: the caller vouches the handle is a live stream (or one of the special values); a
    // dead one is an error code from the driver.
    cu("cuStreamSynchronize", || unsafe {
        sys::cuStreamSynchronize(stream as usize as sys::CUstream)
    })
}
