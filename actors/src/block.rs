//! The memory behind one object, as the table keeps it: a host block (the allocator's), a device
//! block (the GPU actor's) or a part of a client's lend. The table only carries blocks; the
//! table actor gives each back to whoever it came from when its object goes, and each block
//! says which device's capacity (host memory, or one GPU: each has its own, and its own LRU)
//! it counts against and how much of it.

use vovp_types::{Device, DeviceBlock, Location};

use crate::allocator::HostBlock;

/// The memory behind one object, returned to its allocator when the object goes.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Block {
    Host(HostBlock),
    Cuda(DeviceBlock),
    /// Part of a block lent to a client (LEND), which wrote the object there itself: freeing
    /// it gives the lend back one object, and the lend's block goes when its last object does.
    Lent(LentBlock),
    /// No memory: the object is on disk only (spilled, [`crate::spill`]); freeing it removes
    /// its spill file. Never handed out: a get restores the object into a new block first.
    Spilled(SpilledBlock),
}

/// A spilled object's file, named by the object's id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SpilledBlock {
    pub id: u64,
}

/// Where an object published from a lend lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LentBlock {
    pub lend: u64,
    pub segment: u32,
    pub offset: u64,
    /// Data padded to 64 bytes plus metadata, rounded to 64: what it occupies of the lend.
    pub charged: u64,
}

impl Block {
    pub(crate) fn location(&self) -> Location {
        match self {
            Block::Host(h) => Location::Host {
                segment: h.segment,
                offset: h.offset,
            },
            Block::Cuda(d) => Location::Cuda(*d),
            Block::Lent(l) => Location::Host {
                segment: l.segment,
                offset: l.offset,
            },
            // No segment has this id: a spilled object's location is never handed out.
            Block::Spilled(_) => Location::Host {
                segment: u32::MAX,
                offset: 0,
            },
        }
    }

    pub(crate) fn device(&self) -> Device {
        match self {
            Block::Host(_) | Block::Lent(_) | Block::Spilled(_) => Device::Cpu,
            Block::Cuda(d) => Device::Cuda(d.device),
        }
    }

    /// Bytes the object counts against its device's capacity (what evicting it frees).
    pub(crate) fn reserved(&self) -> u64 {
        match self {
            Block::Host(h) => h.charged,
            Block::Cuda(d) => d.size,
            Block::Lent(l) => l.charged,
            Block::Spilled(_) => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lent_and_host_blocks_count_against_host_memory_device_blocks_against_their_gpu() {
        let host = Block::Host(HostBlock::for_tests(2, 100));
        let lent = Block::Lent(LentBlock {
            lend: 1,
            segment: 3,
            offset: 128,
            charged: 192,
        });
        let device = Block::Cuda(DeviceBlock {
            device: 1,
            pool: 0,
            ipc_handle: [0; 64],
            offset: 4096,
            size: 512,
        });
        assert_eq!((host.device(), host.reserved()), (Device::Cpu, 100));
        assert_eq!(
            lent.location(),
            Location::Host {
                segment: 3,
                offset: 128
            }
        );
        assert_eq!((lent.device(), lent.reserved()), (Device::Cpu, 192));
        assert_eq!((device.device(), device.reserved()), (Device::Cuda(1), 512));
    }
}
