//! Daemon-side device memory: per device, one large `cuMemAlloc` allocation (a "pool") made at
//! first use and sub-allocated with `offset-allocator`.
//!
//! Why pooled rather than one `cuMemAlloc` per object: `cuMemAlloc`/`cuMemFree` synchronise the
//! device and cost up to milliseconds, and every allocation would need its own IPC handle, which
//! every client would have to open (`cuIpcOpenMemHandle` costs ~100 µs and maps memory). With a
//! pool, the handle is exported once and a client maps each pool once, then reaches any block by
//! offset.

use std::collections::HashMap;

use cudarc::driver::sys;
use offset_allocator::{Allocation, Allocator};

use vovp_gpu::primary::{self as driver, cu, PrimaryCtx};
use vovp_types::DeviceBlock;

use crate::{GpuConfig, GpuError};

/// Sub-allocation granularity. 256 bytes is the alignment `cuMemAlloc` guarantees and what CUDA
/// kernels and cuBLAS expect for any tensor, so every block starts suitably aligned.
pub const BLOCK_ALIGN: u64 = 256;

/// Most units one pool (one offset allocator, whose sizes are `u32` units) manages: 512 GiB.
/// A larger configured capacity is split into several pools.
const MAX_POOL_UNITS: u64 = 1 << 31;

/// Live blocks one pool can track. The allocator preallocates its node table (~30 bytes a node,
/// so ~8 MiB here); running out reads as "out of memory", which makes the caller evict, which is
/// the right response to too many objects too.
const MAX_ALLOCS_PER_POOL: u32 = 1 << 18;

/// Granularity of default pool sizes: the driver maps device memory in 2 MiB pages.
const DEFAULT_ROUNDING: u64 = 2 << 20;

/// Share of a device's free memory the store takes when `--gpu-memory` does not name the device.
pub const DEFAULT_FREE_FRACTION_PERCENT: u64 = 50;

/// Offset bookkeeping of one pool, independent of CUDA so it can be tested without a GPU.
pub(crate) struct SubAllocator {
    units: u32,
    alloc: Allocator,
    /// Live blocks by byte offset: `DeviceBlock` carries only the offset, while the allocator
    /// needs its `Allocation` back; the map also makes a double or foreign free harmless (the
    /// allocator asserts on double free).
    live: HashMap<u64, Allocation>,
}

impl SubAllocator {
    pub(crate) fn new(bytes: u64) -> Self {
        let units = (bytes / BLOCK_ALIGN).min(MAX_POOL_UNITS) as u32;
        SubAllocator {
            units,
            alloc: Allocator::with_max_allocs(units, MAX_ALLOCS_PER_POOL),
            live: HashMap::new(),
        }
    }

    /// Byte offset of a new block of `size` bytes (rounded up to [`BLOCK_ALIGN`]; an empty block
    /// still takes one unit so that every live block has a distinct offset), or `None`.
    pub(crate) fn allocate(&mut self, size: u64) -> Option<u64> {
        let units = u32::try_from(size.div_ceil(BLOCK_ALIGN).max(1)).ok()?;
        if units > self.units {
            return None;
        }
        let a = self.alloc.allocate(units)?;
        let offset = u64::from(a.offset) * BLOCK_ALIGN;
        self.live.insert(offset, a);
        Some(offset)
    }

    /// Frees the block at `offset`; false if there is none (already freed, or not ours).
    pub(crate) fn free(&mut self, offset: u64) -> bool {
        match self.live.remove(&offset) {
            Some(a) => {
                self.alloc.free(a);
                true
            }
            None => false,
        }
    }

    pub(crate) fn is_live(&self, offset: u64) -> bool {
        self.live.contains_key(&offset)
    }

    /// Roughly the largest block that fits now (the allocator reports its size class, a lower
    /// bound within 12.5%).
    pub(crate) fn largest_free(&self) -> u64 {
        u64::from(self.alloc.storage_report().largest_free_region) * BLOCK_ALIGN
    }

    pub(crate) fn free_bytes(&self) -> u64 {
        u64::from(self.alloc.storage_report().total_free_space) * BLOCK_ALIGN
    }

    pub(crate) fn capacity(&self) -> u64 {
        u64::from(self.units) * BLOCK_ALIGN
    }
}

/// One `cuMemAlloc` allocation, exported through CUDA IPC, sub-allocated.
struct Pool {
    ctx: &'static PrimaryCtx,
    base: sys::CUdeviceptr,
    handle: [u8; 64],
    sub: SubAllocator,
}

impl Pool {
    fn create(ctx: &'static PrimaryCtx, bytes: u64) -> Result<Pool, GpuError> {
        ctx.make_current()?;
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: writes one device pointer; the primary context of the device is current.
        cu("cuMemAlloc", || unsafe {
            sys::cuMemAlloc_v2(&mut base, bytes as usize)
        })
        .map_err(|e| {
            GpuError::Driver(format!(
                "cannot reserve the store's {bytes}-byte pool on cuda:{}: {e}; \
                     give a smaller size with --gpu-memory",
                ctx.ordinal()
            ))
        })?;
        // From here on Drop frees `base`, whatever fails next.
        let mut pool = Pool {
            ctx,
            base,
            handle: [0; 64],
            sub: SubAllocator::new(bytes),
        };
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: base is a live cuMemAlloc allocation (the only kind IPC can export).
        cu("cuIpcGetMemHandle", || unsafe {
            sys::cuIpcGetMemHandle(&mut h, base)
        })?;
        pool.handle = h.reserved.map(|b| b as u8);
        Ok(pool)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Clients may still have the pool mapped; after this their mappings must not be used.
        // That only happens when the daemon stops, when clients lose the store anyway.
        let freed = self.ctx.make_current().and_then(|()| {
            // SAFETY: base came from cuMemAlloc in this context and is freed once.
            cu("cuMemFree", || unsafe { sys::cuMemFree_v2(self.base) })
        });
        if let Err(e) = freed {
            tracing::warn!("freeing the GPU pool of cuda:{}: {e}", self.ctx.ordinal());
        }
    }
}

/// Pools of one device.
struct DevicePools {
    pools: Vec<Pool>,
}

/// All device memory of the store (the state behind the GPU actor).
pub struct Pools {
    config: GpuConfig,
    devices: HashMap<u32, DevicePools>,
}

impl std::fmt::Debug for Pools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pools")
            .field("config", &self.config)
            .field("usage", &self.usage())
            .finish()
    }
}

impl Pools {
    pub fn new(config: GpuConfig) -> Self {
        Pools {
            config,
            devices: HashMap::new(),
        }
    }

    /// Bytes to reserve on `device`: the configured capacity, else a share of what is free right
    /// now (so a store started next to a training job does not take memory the job holds).
    /// Returns the device's context too, made current.
    fn capacity(&self, device: u32) -> Result<(&'static PrimaryCtx, u64), GpuError> {
        let configured = self
            .config
            .capacities
            .iter()
            .find(|(d, _)| *d == device)
            .map(|(_, c)| *c);
        // Checked before touching the device, so that `--gpu-memory N:0` keeps the store from
        // even creating a context there.
        if let Some(c) = configured.filter(|&c| c < BLOCK_ALIGN) {
            return Err(GpuError::GpuUnavailable(format!(
                "cuda:{device} is given {c} bytes by --gpu-memory"
            )));
        }
        let ctx = driver::context(device)?;
        let bytes = match configured {
            Some(c) => c,
            None => {
                let (free, _) = driver::mem_info(ctx)?;
                let share = free / 100 * DEFAULT_FREE_FRACTION_PERCENT / DEFAULT_ROUNDING
                    * DEFAULT_ROUNDING;
                if share < BLOCK_ALIGN {
                    return Err(GpuError::GpuUnavailable(format!(
                        "cuda:{device} has {free} bytes free, too little for the store's pool"
                    )));
                }
                share
            }
        };
        Ok((ctx, bytes))
    }

    /// The device's pools, created on first use.
    fn device(&mut self, device: u32) -> Result<&mut DevicePools, GpuError> {
        if !self.devices.contains_key(&device) {
            let (ctx, mut left) = self.capacity(device)?;
            let mut pools = Vec::new();
            // Not cached on failure: the next request retries, e.g. after another process freed
            // memory. Pools made before a failure are dropped (freed) with `pools`.
            while left >= BLOCK_ALIGN {
                let bytes = left.min(MAX_POOL_UNITS * BLOCK_ALIGN) / BLOCK_ALIGN * BLOCK_ALIGN;
                pools.push(Pool::create(ctx, bytes)?);
                left -= bytes;
            }
            tracing::info!(
                "cuda:{device}: reserved {} bytes in {} pool(s) for the store",
                pools.iter().map(|p| p.sub.capacity()).sum::<u64>(),
                pools.len()
            );
            self.devices.insert(device, DevicePools { pools });
        }
        self.devices.get_mut(&device).ok_or_else(|| {
            GpuError::Driver(format!("cuda:{device}: pool bookkeeping lost (a bug)"))
        })
    }

    pub fn allocate(&mut self, device: u32, size: u64) -> Result<DeviceBlock, GpuError> {
        let dev = self.device(device)?;
        for (i, pool) in dev.pools.iter_mut().enumerate() {
            if let Some(offset) = pool.sub.allocate(size) {
                return Ok(DeviceBlock {
                    device,
                    pool: i as u32,
                    ipc_handle: pool.handle,
                    offset,
                    size,
                });
            }
        }
        Err(GpuError::OutOfMemory {
            device,
            requested: size,
            available: dev
                .pools
                .iter()
                .map(|p| p.sub.largest_free())
                .max()
                .unwrap_or(0),
        })
    }

    /// The pool a block names, if the block is one of ours.
    fn pool_of(&mut self, block: &DeviceBlock) -> Option<&mut Pool> {
        let pool = self
            .devices
            .get_mut(&block.device)?
            .pools
            .get_mut(block.pool as usize)?;
        // The handle check catches blocks from another GpuActor (e.g. a test's second store).
        (pool.handle == block.ipc_handle).then_some(pool)
    }

    pub fn free(&mut self, block: &DeviceBlock) {
        let freed = self
            .pool_of(block)
            .is_some_and(|p| p.sub.free(block.offset));
        if !freed {
            tracing::warn!(
                "FreeDevice of a block that is not live (double free?): cuda:{} pool {} offset {}",
                block.device,
                block.pool,
                block.offset
            );
        }
    }

    pub fn pointer(&mut self, block: &DeviceBlock) -> Result<u64, GpuError> {
        match self.pool_of(block) {
            Some(p) if p.sub.is_live(block.offset) => Ok(p.base + block.offset),
            _ => Err(GpuError::Driver(format!(
                "cuda:{} pool {} offset {} is not a live block of this store",
                block.device, block.pool, block.offset
            ))),
        }
    }

    pub fn usage(&self) -> Vec<DeviceUsage> {
        let mut v: Vec<DeviceUsage> = self
            .devices
            .iter()
            .map(|(&device, d)| {
                let capacity = d.pools.iter().map(|p| p.sub.capacity()).sum::<u64>();
                let free = d.pools.iter().map(|p| p.sub.free_bytes()).sum::<u64>();
                DeviceUsage {
                    device,
                    pools: d.pools.len() as u32,
                    capacity,
                    used: capacity.saturating_sub(free),
                }
            })
            .collect();
        v.sort_by_key(|u| u.device);
        v
    }
}

/// Memory of one device's pools (only devices used so far have pools).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceUsage {
    pub device: u32,
    pub pools: u32,
    pub capacity: u64,
    /// Bytes in live blocks, each rounded up to [`BLOCK_ALIGN`] and the allocator's size class.
    pub used: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_aligned_and_distinct() {
        let mut s = SubAllocator::new(1 << 20);
        let a = s.allocate(1).expect("fits");
        let b = s.allocate(0).expect("empty blocks take a unit");
        let c = s.allocate(1000).expect("fits");
        for o in [a, b, c] {
            assert_eq!(o % BLOCK_ALIGN, 0);
        }
        assert!(a != b && b != c && a != c);
        assert_eq!(s.capacity(), 1 << 20);
    }

    #[test]
    fn full_pool_refuses_and_free_makes_room() {
        let mut s = SubAllocator::new(1 << 20);
        let whole = s.allocate(1 << 20).expect("the whole pool fits when empty");
        assert_eq!(s.allocate(256), None);
        assert_eq!(s.largest_free(), 0);
        assert!(s.free(whole));
        assert!(!s.free(whole), "a double free is refused, not a panic");
        assert!(!s.free(12345), "a foreign offset is refused");
        assert!(s.largest_free() >= (1 << 20) * 7 / 8);
        assert!(s.allocate(1 << 20).is_some());
    }

    #[test]
    fn oversize_requests_fail_cleanly() {
        let mut s = SubAllocator::new(1 << 20);
        assert_eq!(s.allocate((1 << 20) + 1), None);
        assert_eq!(s.allocate(u64::MAX), None);
    }

    #[test]
    fn huge_capacities_are_capped_per_pool() {
        // Bookkeeping only: no memory behind it.
        let s = SubAllocator::new(u64::MAX);
        assert_eq!(s.capacity(), MAX_POOL_UNITS * BLOCK_ALIGN);
    }
}
