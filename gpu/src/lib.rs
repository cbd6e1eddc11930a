//! CUDA for vovp's clients and store, with the driver loaded at run time so that everything
//! builds and runs on machines with no GPU: the driver's loading and probing, CUDA IPC mapping
//! and copies, [`CudaStore`]. Without a driver every call answers
//! [`GpuError::GpuUnavailable`] with the reason; nothing panics.
//!
//! * clients: [`ipc`] (map blocks, copy between host and device), [`CudaStore`];
//! * both sides: [`probe`], [`cuda_available`], [`GpuError`];
//! * the store's device pools live apart, in `vovp-gpu-pool` (`gpu/pool/`), which builds on
//!   [`primary`]: a client (vovp-client, the Python wheel) builds no pools.
//!
//! Device memory model: per device, one `cuMemAlloc` allocation (a *pool*; several only past
//! 512 GiB) made by the store at the first request for that device, exported once with
//! `cuIpcGetMemHandle`, and cut into 256-byte-aligned blocks. A [`DeviceBlock`] is (pool
//! handle, offset, size); a client maps each pool once and reaches every block by offset.

#![warn(unreachable_pub, missing_debug_implementations)]

mod driver;
pub mod ipc;

pub use driver::{
    check_device, cuda_available, device_count, probe, simulate_library_names, DeviceInfo, GpuInfo,
};
pub use vovp_types::DeviceBlock;
use vovp_types::{CreateOptions, DType, Device, Error, Store, TensorMeta};

/// The driver under the store's device pools (`vovp-gpu-pool`), which make their own
/// allocation calls: a device's retained primary context, its memory, and the wrapper every
/// driver call goes through (a failure or a cudarc panic becomes a [`GpuError`]).
pub mod primary {
    pub use crate::driver::{context, cu, mem_info, PrimaryCtx};
}

/// Errors of the CUDA calls, on either side.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum GpuError {
    /// No usable CUDA driver or device; the reason says which.
    #[error("GPU unavailable: {0}")]
    GpuUnavailable(String),
    /// The request does not fit in the device's pool now; evicting blocks may make room.
    /// `available` is roughly the largest block that would fit (a lower bound within 12.5%).
    #[error(
        "out of GPU memory on cuda:{device}: requested {requested} bytes, {available} available"
    )]
    OutOfMemory {
        device: u32,
        requested: u64,
        available: u64,
    },
    /// A driver call failed.
    #[error("CUDA driver error: {0}")]
    Driver(String),
    /// A malformed `--gpu-memory` spec.
    #[error("invalid --gpu-memory: {0}")]
    InvalidConfig(String),
}

/// A GPU failure as the store reports it: no driver or device is `GpuUnavailable`, a full pool
/// `OutOfMemory` (so eviction and callers treat host and device alike), the rest `Gpu`.
impl From<GpuError> for Error {
    fn from(e: GpuError) -> Self {
        match e {
            GpuError::GpuUnavailable(r) => Error::GpuUnavailable(r),
            GpuError::OutOfMemory {
                requested,
                available,
                ..
            } => Error::OutOfMemory {
                requested,
                available,
            },
            other => Error::Gpu(other.to_string()),
        }
    }
}

/// CUDA tensors on any [`Store`] (the embedded engine or a socket client): kept apart from the
/// trait so that the vocabulary crate needs no driver.
pub trait CudaStore: Store {
    /// Stores a CUDA tensor: a device object on `cuda:device` filled by a device-to-device copy
    /// from `src` (a device address in this process), synchronised before the seal.
    fn put_cuda_tensor(
        &self,
        name: &str,
        dtype: DType,
        shape: &[i64],
        device: u32,
        src: u64,
    ) -> Result<(), Error> {
        let meta = TensorMeta {
            dtype,
            shape: shape.to_vec(),
            device: Device::Cuda(device),
            little_endian: cfg!(target_endian = "little"),
        };
        let size = meta.nbytes();
        let options = CreateOptions {
            device: Some(meta.device),
            ..Default::default()
        };
        let buf = self.create(name, size, &meta.encode(), options)?;
        let dst = buf.cuda_ptr().ok_or_else(|| {
            Error::Internal("a CUDA object came back without a device address".into())
        })?;
        ipc::copy_d2d(dst, src, size as usize)?;
        buf.seal().map(drop)
    }
}

impl<S: Store + ?Sized> CudaStore for S {}
