//! The GPU actor: owns every piece of CUDA state the store has (the device pools of
//! `vovp_gpu_pool::Pools`, created per device at its first request), so that no other actor
//! makes a driver call. Without a driver every request answers `GpuError::GpuUnavailable`.

use kameo::message::{Context, Message};
use kameo::Actor;
use vovp_gpu::{DeviceBlock, GpuError};
pub use vovp_gpu_pool::{parse_gpu_memory, GpuConfig};
use vovp_gpu_pool::{DeviceUsage, Pools};

/// The GPU actor's state: the device pools, created per device at its first request.
///
/// Every handler makes blocking driver calls (microseconds, except the first request per device,
/// which creates the context and the pool: up to a second). Spawn it with
/// `GpuActor::spawn_in_thread` in a multi-threaded runtime to keep those off the async workers;
/// plain `spawn` works too. No driver call happens before the first message, so constructing and
/// spawning it is free on machines without a GPU.
#[derive(Actor)]
pub struct GpuActor {
    pools: Pools,
}

impl std::fmt::Debug for GpuActor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The actor's state is large and changes under the caller; its name is what a log needs.
        f.debug_struct("GpuActor").finish_non_exhaustive()
    }
}

impl GpuActor {
    pub fn new(config: GpuConfig) -> Self {
        GpuActor {
            pools: Pools::new(config),
        }
    }
}

/// Allocate `size` bytes on `device`. `OutOfMemory` means "evict and retry"; `GpuUnavailable`
/// means no driver, no such device, or a capacity of 0 for it.
#[derive(Debug)]
pub struct AllocateDevice {
    pub device: u32,
    pub size: u64,
}

impl Message<AllocateDevice> for GpuActor {
    type Reply = Result<DeviceBlock, GpuError>;
    async fn handle(
        &mut self,
        msg: AllocateDevice,
        _ctx: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        self.pools.allocate(msg.device, msg.size)
    }
}

/// Return a block to its pool. Freeing a block that is not live only logs a warning.
#[derive(Debug)]
pub struct FreeDevice(pub DeviceBlock);

impl Message<FreeDevice> for GpuActor {
    type Reply = ();
    async fn handle(&mut self, msg: FreeDevice, _ctx: &mut Context<Self, Self::Reply>) {
        self.pools.free(&msg.0)
    }
}

/// The device pointer of a live block in the daemon's own address space (in the device's primary
/// context), for in-process use: a process cannot open its own IPC handles, so the daemon, and
/// tests playing daemon, reach blocks this way and copy with `vovp_gpu::ipc::copy_h2d` and friends.
#[derive(Debug)]
pub struct BlockPtr(pub DeviceBlock);

impl Message<BlockPtr> for GpuActor {
    type Reply = Result<u64, GpuError>;
    async fn handle(
        &mut self,
        msg: BlockPtr,
        _ctx: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        self.pools.pointer(&msg.0)
    }
}

/// Capacity and use of each device that has pools, by device (for stats).
#[derive(Debug)]
pub struct GpuUsage;

impl Message<GpuUsage> for GpuActor {
    type Reply = Vec<DeviceUsage>;
    async fn handle(
        &mut self,
        _msg: GpuUsage,
        _ctx: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        self.pools.usage()
    }
}
