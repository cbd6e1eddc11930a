//! CUDA for vovp, with the driver loaded at run time so that the store builds and runs on
//! machines with no GPU: device pools (pooled allocations per GPU, sub-allocated; their CUDA
//! IPC handles), IPC mapping and copies. Without a driver every call answers
//! [`GpuError::GpuUnavailable`] with the reason; nothing panics. No actors here: the store's
//! GPU actor (`vovp-actors`) owns the [`Pools`].
//!
//! * daemon side: [`Pools`], [`parse_gpu_memory`] for `--gpu-memory`;
//! * client side: [`ipc`] (map blocks, copy between host and device);
//! * both: [`probe`] and [`cuda_available`].
//!
//! Device memory model: per device, one `cuMemAlloc` allocation (a *pool*; several only past
//! 512 GiB) made at the first request for that device, exported once with `cuIpcGetMemHandle`,
//! and cut into 256-byte-aligned blocks. A [`DeviceBlock`] is (pool handle, offset, size); a client
//! maps each pool once and reaches every block by offset.

#![warn(unreachable_pub, missing_debug_implementations)]

mod driver;
pub mod ipc;
mod pool;

pub use driver::{
    check_device, cuda_available, device_count, probe, simulate_library_names, DeviceInfo, GpuInfo,
};
pub use pool::{DeviceUsage, Pools, BLOCK_ALIGN, DEFAULT_FREE_FRACTION_PERCENT};
pub use vovp_types::DeviceBlock;
use vovp_types::{CreateOptions, DType, Device, Error, Store, TensorMeta};

/// Errors of the GPU actor.
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

/// Per-device capacity the store may use.
#[derive(Debug, Clone, Default)]
pub struct GpuConfig {
    /// (device ordinal, bytes) pairs, e.g. from `--gpu-memory 0:8G,1:8G`. A device not listed
    /// gets [`DEFAULT_FREE_FRACTION_PERCENT`]% of its free memory at its first request.
    pub capacities: Vec<(u32, u64)>,
}

/// Parses `--gpu-memory`: comma-separated `DEVICE:SIZE` entries such as `0:8G,1:512M`. Sizes are
/// bytes with an optional binary suffix `K`, `M`, `G`, `T` (any case, `B`/`iB` allowed), the same
/// syntax as the host `-m` size. A size of 0 keeps the store off that device.
pub fn parse_gpu_memory(spec: &str) -> Result<Vec<(u32, u64)>, GpuError> {
    let bad = |m: String| GpuError::InvalidConfig(m);
    let mut out: Vec<(u32, u64)> = Vec::new();
    for entry in spec.split(',') {
        let entry = entry.trim();
        let (dev, size) = entry
            .split_once(':')
            .ok_or_else(|| bad(format!("{entry:?} is not DEVICE:SIZE (e.g. 0:8G)")))?;
        let dev: u32 = dev
            .trim()
            .parse()
            .map_err(|_| bad(format!("{dev:?} in {entry:?} is not a device number")))?;
        let size = parse_size(size).ok_or_else(|| {
            bad(format!(
                "{size:?} in {entry:?} is not a size (e.g. 8G, 512M, 1000000)"
            ))
        })?;
        if out.iter().any(|(d, _)| *d == dev) {
            return Err(bad(format!("device {dev} is given twice")));
        }
        out.push((dev, size));
    }
    Ok(out)
}

/// `1000000`, `64K`, `512M`, `1G`, `2T`, `64KiB`; `None` if malformed or over `u64`.
fn parse_size(text: &str) -> Option<u64> {
    let t = text.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (digits, shift) = match t.chars().last()? {
        'k' | 'K' => (&t[..t.len() - 1], 10),
        'm' | 'M' => (&t[..t.len() - 1], 20),
        'g' | 'G' => (&t[..t.len() - 1], 30),
        't' | 'T' => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    let digits = digits.trim();
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse::<u64>().ok()?.checked_mul(1u64 << shift)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_memory_specs() {
        assert_eq!(parse_gpu_memory("0:8G").unwrap(), vec![(0, 8 << 30)]);
        assert_eq!(
            parse_gpu_memory("0:8G,1:512M").unwrap(),
            vec![(0, 8 << 30), (1, 512 << 20)]
        );
        assert_eq!(
            parse_gpu_memory(" 2 : 1T , 3:64KiB,4:1000000,5:0,6:2GB,7:3k").unwrap(),
            vec![
                (2, 1 << 40),
                (3, 64 << 10),
                (4, 1_000_000),
                (5, 0),
                (6, 2 << 30),
                (7, 3 << 10)
            ]
        );
    }

    #[test]
    fn bad_gpu_memory_specs() {
        for spec in [
            "",
            "8G",
            "0",
            "0:",
            ":8G",
            "x:8G",
            "-1:8G",
            "0:8X",
            "0:G",
            "0:-8G",
            "0:1.5G",
            "0:8G,",
            "0:8G,0:4G",
            "0:99999999999T",
            "0:8G;1:8G",
            "4294967296:1G",
        ] {
            match parse_gpu_memory(spec) {
                Err(GpuError::InvalidConfig(m)) => assert!(!m.is_empty(), "{spec:?}"),
                other => panic!("{spec:?} gave {other:?}"),
            }
        }
    }
}
