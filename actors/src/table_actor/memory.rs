//! The table actor's memory handling: memory for a new object from the allocator actor (host)
//! or the GPU actor (CUDA), and when a device is full, the loop that frees parked objects, takes
//! back empty lends and evicts until the object fits or provably cannot; blocks given back to
//! whoever gave them (a lent object's to its lend); the metadata the store writes into host
//! blocks; and the timer that looks at parked objects again.

use std::sync::Arc;
use std::time::Duration;

use kameo::actor::ActorRef;
use vovp_gpu::GpuError;
use vovp_types::{Device, Error, Location, ObjectRef, ALIGNMENT};

use super::spilling::Room;
use super::{CollectParked, ObjectTableActor};
use crate::allocator::{AllocFailure, Allocate, Free, HostUsage, SegmentById, Usage, Writer};
use crate::block::Block;
use crate::gpu::{AllocateDevice, FreeDevice, GpuUsage};
use crate::lend_ledger::LendKind;
use crate::segment::Segment;
use crate::table::Freed;

/// How often parked objects (kept because a client's hold table names them) are looked at
/// again: a release through a hold table sends no message, so a deferred delete's memory
/// comes back within this long of the last release (at once when memory runs short).
const PARKED_RESCAN: Duration = Duration::from_millis(5);

/// A create that spills to make its room spills a 1/32 of the store more: a stream of puts
/// into a full store then keeps the disk busy, each put's room written while the one before
/// it copies. Spilled ahead are the least recently used objects, the next victims anyway.
const SPILL_AHEAD: u64 = 32;

#[cfg(test)]
pub(super) mod tests;

impl ObjectTableActor {
    /// Memory for a new object of `size` data bytes on `device` (see [`Self::allocate_room`];
    /// `may_wait`: for spills to land), with its `metadata` placed: in the block for a host
    /// object, charged to host memory for a CUDA one.
    pub(super) async fn allocate_object(
        &mut self,
        size: u64,
        metadata: &[u8],
        device: Device,
        writer: Writer,
        may_wait: bool,
    ) -> Result<Room, Error> {
        // A CUDA object's metadata lives on the daemon's heap: it is charged to host memory (a
        // block of segment 0 that is never touched), so `-m` bounds it and `--gpu-memory`
        // stays whole for tensor data.
        let cuda_metadata = match device {
            Device::Cuda(_) if !metadata.is_empty() => {
                match self
                    .allocate(metadata.len() as u64, 0, Device::Cpu, Writer::Store)
                    .await?
                {
                    Block::Host(h) => Some(h),
                    _ => None,
                }
            }
            _ => None,
        };
        let block = match device {
            Device::Cpu => {
                self.allocate_room(size, metadata.len(), device, writer, may_wait)
                    .await
            }
            Device::Cuda(_) => self
                .allocate(size, 0, device, writer)
                .await
                .map(Room::Ready),
        };
        let block = match block {
            Ok(Room::Ready(b)) => b,
            Ok(Room::Wait) => return Ok(Room::Wait),
            Err(e) => {
                if let Some(h) = cuda_metadata {
                    let _ = self.allocator.tell(Free(vec![h])).await;
                }
                return Err(e);
            }
        };
        if let (Block::Cuda(d), Some(h)) = (block, cuda_metadata) {
            self.cuda_metadata.insert((d.device, d.pool, d.offset), h);
        }
        self.place_metadata(&block, size, metadata).await;
        Ok(Room::Ready(block))
    }

    /// Writes a host object's metadata into its block, after the data padded to
    /// [`ALIGNMENT`] (where `allocate` made room): where readers of the shared directory
    /// find it. The store writes it, not the creator, so it is what the store was told.
    pub(super) async fn place_metadata(&mut self, block: &Block, size: u64, metadata: &[u8]) {
        let Location::Host {
            segment: segment_id,
            offset,
        } = block.location()
        else {
            return;
        };
        if metadata.is_empty() {
            return;
        }
        let segment = self.segment_of(segment_id).await;
        let at = size
            .checked_next_multiple_of(ALIGNMENT)
            .and_then(|d| offset.checked_add(d));
        match (segment, at) {
            (Some(seg), Some(at)) => match seg.ptr(at, metadata.len() as u64) {
                // SAFETY: inside the object's own block, past its data: nobody else writes it
                // (the creator's buffer covers only the data).
                Some(p) => unsafe {
                    std::ptr::copy_nonoverlapping(metadata.as_ptr(), p, metadata.len())
                },
                None => tracing::error!("metadata outside segment {segment_id}"),
            },
            _ => tracing::error!("no segment {segment_id} for an object's metadata"),
        }
    }

    /// The store's mapping of segment `segment_id` (its own, or a client's arena, asked of the
    /// allocator once and remembered weakly: the allocator decides when an arena goes).
    pub(super) async fn segment_of(&mut self, segment_id: u32) -> Option<Arc<Segment>> {
        if let Some(s) = self
            .segments
            .get(segment_id as usize)
            .filter(|s| s.id() == segment_id)
        {
            return Some(s.clone());
        }
        if let Some(s) = self
            .arenas
            .get(&segment_id)
            .and_then(std::sync::Weak::upgrade)
        {
            return Some(s);
        }
        let s = self
            .allocator
            .ask(SegmentById(segment_id))
            .await
            .ok()
            .flatten();
        if let Some(s) = &s {
            self.arenas.retain(|_, w| w.strong_count() > 0);
            self.arenas.insert(segment_id, Arc::downgrade(s));
        }
        s
    }

    /// Keeps the parked objects' timer going while any is parked: each tick is a
    /// [`CollectParked`], which frees what hold tables let go of since.
    pub(super) async fn schedule_parked_rescan(&mut self, ctx: &ActorRef<Self>) {
        if self.table.parked() > 0 && !self.rescan_scheduled {
            self.rescan_scheduled = true;
            let me = ctx.clone();
            tokio::spawn(async move {
                tokio::time::sleep(PARKED_RESCAN).await;
                let _ = me.tell(CollectParked).await;
            });
        }
    }

    pub(super) async fn host_usage(&self) -> Result<HostUsage, Error> {
        self.allocator
            .ask(Usage)
            .await
            .map_err(|_| Error::ShuttingDown)
    }

    /// (capacity, used) of a device's memory; `None` for a GPU whose pool does not exist yet.
    async fn device_usage(&self, device: Device) -> Result<Option<(u64, u64)>, Error> {
        match device {
            Device::Cpu => {
                let u = self.host_usage().await?;
                // Past what the machine can back, the store's free bytes are not available.
                Ok(Some((
                    u.capacity.min(u.used.saturating_add(u.backable)),
                    u.used,
                )))
            }
            Device::Cuda(n) => {
                let usage = self
                    .gpu
                    .ask(GpuUsage)
                    .await
                    .map_err(|_| Error::ShuttingDown)?;
                Ok(usage
                    .into_iter()
                    .find(|u| u.device == n)
                    .map(|u| (u.capacity, u.used)))
            }
        }
    }

    /// Memory for an object of `size` data bytes and `metadata_len` metadata bytes on `device`,
    /// evicting LRU objects of that device as needed (never waiting: victims are evicted even
    /// when spilling is on; see [`Self::allocate_room`]).
    pub(super) async fn allocate(
        &mut self,
        size: u64,
        metadata_len: usize,
        device: Device,
        writer: Writer,
    ) -> Result<Block, Error> {
        match self
            .allocate_room(size, metadata_len, device, writer, false)
            .await?
        {
            Room::Ready(block) => Ok(block),
            // Not asked to wait: never.
            Room::Wait => Err(Error::Internal(
                "an allocation that may not wait waits".into(),
            )),
        }
    }

    /// Memory for an object of `size` data bytes and `metadata_len` metadata bytes on `device`,
    /// evicting LRU objects of that device as needed. A request that cannot fit even after
    /// evicting everything evictable fails before evicting anything, so a hopeless create never
    /// empties the cache.
    ///
    /// With `may_wait` and spilling on (host memory), victims are spilled rather than evicted:
    /// [`Room::Wait`] then says the memory comes when their writes land (the caller waits in
    /// the actor's queue of requests waiting for room, `spilling.rs`, and asks again then).
    /// Bytes being spilled already count as coming, once for each waiter (`claimed`).
    ///
    /// A host object's metadata is counted in its block (data padded to [`ALIGNMENT`], then
    /// room for the metadata), so `-m` bounds what the metadata the table keeps on the heap
    /// can cost as well (CUDA objects: see [`Self::allocate_object`]).
    ///
    /// Termination: every pass either returns, or evicts or starts spilling at least one object
    /// from the device's LRU, and nothing else can touch the table in between (an actor
    /// handles one message at a time), so there are at most as many passes as evictable
    /// objects plus one; a waiter is asked again only after a write in flight completed.
    pub(super) async fn allocate_room(
        &mut self,
        size: u64,
        metadata_len: usize,
        device: Device,
        writer: Writer,
        may_wait: bool,
    ) -> Result<Room, Error> {
        let bytes = match device {
            Device::Cpu => size.checked_next_multiple_of(ALIGNMENT),
            Device::Cuda(_) => Some(size),
        }
        .and_then(|b| b.checked_add(metadata_len as u64));
        // What eviction must free: the bytes the object is charged (`None` only for sizes near
        // 2^64, which nothing can hold).
        let needed = match device {
            Device::Cpu => vovp_types::lends::block_len(size, metadata_len as u64),
            Device::Cuda(_) => bytes,
        };
        let oom = |available| Error::OutOfMemory {
            requested: size,
            available,
        };
        let spills = may_wait && device == Device::Cpu && self.spill.is_some();
        loop {
            let failure = match (bytes, needed) {
                (Some(bytes), Some(_)) => self.try_allocate(bytes, device, writer).await?,
                _ => Err(AllocFailure::NoSpace),
            };
            let failure = match failure {
                Ok(block) => return Ok(Room::Ready(block)),
                Err(f) => f,
            };
            // Objects kept only by hold tables that have let go since: free them first.
            let parked = self.table.collect_parked();
            if !parked.is_empty() {
                self.free(parked).await;
                continue;
            }
            // Then empty lends no put is writing into: memory nobody uses. Lends with objects
            // stay (an active client's lend taken back at every shortage would make each of
            // its puts take a whole new lend); once eviction has taken their last object they
            // are empty, and this gives them back on the next turn.
            if device == Device::Cpu && self.revoke_empty_lends().await {
                continue;
            }
            // Usage is asked only on failure: the hot path is one message to the allocator.
            let (capacity, used) = self.device_usage(device).await?.unwrap_or((0, 0));
            let evictable = self.table.evictable_bytes(device);
            // Memory that spills in flight will free and no other waiter counts on.
            let coming = match &self.spill {
                Some(s) if spills => s.freeing().saturating_sub(self.claimed),
                _ => 0,
            };
            let available = capacity
                .saturating_sub(used)
                .saturating_add(evictable)
                .saturating_add(coming);
            let Some(needed) = needed else {
                return Err(oom(available));
            };

            let target = match failure {
                AllocFailure::TooManyAllocations { limit } => {
                    if self.table.evictable_objects(device) == 0 && coming == 0 {
                        return Err(Error::TooManyObjects { limit });
                    }
                    // Any one evicted object frees a slot; retry decides whether bytes fit too.
                    1
                }
                AllocFailure::NoSpace => {
                    if (evictable == 0 && coming == 0) || needed > available {
                        return Err(oom(available));
                    }
                    needed
                }
            };
            let room = if spills {
                // Spilling: what is coming counts; victims for the rest, and a little more
                // ([`SPILL_AHEAD`]), so that the next create finds its room written already
                // while this one's client copies (the disk is not left idle between puts).
                match target.saturating_sub(coming) {
                    0 => crate::table::Room::default(),
                    rest => self.make_room(device, rest.saturating_add(capacity / SPILL_AHEAD)),
                }
            } else {
                crate::table::Room {
                    freed: self.table.evict(device, target),
                    ..Default::default()
                }
            };
            let freed_now = !room.freed.is_empty() || !room.released.is_empty();
            let started = !room.spilling.is_empty();
            if freed_now || started {
                tracing::debug!(
                    "evicted {} objects and began spilling {} to make room for {size} bytes",
                    room.freed.len(),
                    room.spilling.len()
                );
            }
            // Frees reach the allocator before the retry: one sender, one FIFO mailbox.
            self.free(room.freed).await;
            self.free_blocks(room.released).await;
            // A spill that could not even start is an eviction now.
            let evicted_now = self.start_spills(room.spilling).await;
            if freed_now || evicted_now {
                continue;
            }
            if spills && (started || coming > 0) {
                self.claimed = self.claimed.saturating_add(needed);
                return Ok(Room::Wait);
            }
            // Everything evictable is held through clients' hold tables (or, never while
            // the LRU and its byte count agree, nothing was): never loop on it.
            return Err(match failure {
                AllocFailure::TooManyAllocations { limit } => Error::TooManyObjects { limit },
                AllocFailure::NoSpace => oom(available),
            });
        }
    }

    /// Takes back every empty lend no put is writing into (its client sees it on its next put
    /// and asks for a new one); `true` when that freed memory.
    pub(super) async fn revoke_empty_lends(&mut self) -> bool {
        let mut freed = Vec::new();
        for (holder, lend) in self.lends.current_empty() {
            // Taken back through its hold table, if no put of it writes into the lend now.
            let revoked = self
                .table
                .shared_regions()
                .is_some_and(|r| r.revoke_lend(holder, lend));
            if revoked {
                freed.extend(self.lends.retire(holder, LendKind::Big));
            }
        }
        if freed.is_empty() {
            return false;
        }
        tracing::debug!("took back {} empty lends to make room", freed.len());
        let _ = self.allocator.tell(Free(freed)).await;
        true
    }

    /// One allocation attempt: the block, or why it failed (`Err` of the outer result: the
    /// store cannot answer at all).
    async fn try_allocate(
        &mut self,
        bytes: u64,
        device: Device,
        writer: Writer,
    ) -> Result<Result<Block, AllocFailure>, Error> {
        use kameo::error::SendError::HandlerError;
        match device {
            Device::Cpu => match self
                .allocator
                .ask(Allocate {
                    size: bytes,
                    writer,
                })
                .await
            {
                Ok(b) => Ok(Ok(Block::Host(b))),
                Err(HandlerError(f)) => Ok(Err(f)),
                Err(_) => Err(Error::ShuttingDown),
            },
            Device::Cuda(n) => match self
                .gpu
                .ask(AllocateDevice {
                    device: n,
                    size: bytes,
                })
                .await
            {
                Ok(b) => Ok(Ok(Block::Cuda(b))),
                Err(HandlerError(GpuError::OutOfMemory { .. })) => Ok(Err(AllocFailure::NoSpace)),
                Err(HandlerError(e)) => Err(e.into()),
                Err(_) => Err(Error::ShuttingDown),
            },
        }
    }

    /// Gives back the memory of objects that left the table; the block of one whose spill
    /// or restore is in flight waits for that IO (it still reads or writes the block).
    pub(super) async fn free(&mut self, freed: Vec<Freed>) {
        let mut now = Vec::with_capacity(freed.len());
        for f in freed {
            let id = f.id.get();
            match self.spill.as_mut() {
                Some(s) if s.in_flight(id) => {
                    self.doomed.insert(id, f.block);
                }
                Some(s) => {
                    // A resident object's file kept from an earlier spill goes with it.
                    if s.has_file(id) {
                        s.remove(id);
                    }
                    now.push(f.block);
                }
                None => now.push(f.block),
            }
        }
        self.free_blocks(now).await
    }

    pub(super) async fn free_blocks(&mut self, blocks: impl IntoIterator<Item = Block>) {
        let mut host = Vec::new();
        for block in blocks {
            match block {
                Block::Host(h) => host.push(h),
                Block::Lent(l) => host.extend(self.lends.freed(&l)),
                Block::Spilled(f) => {
                    if let Some(s) = self.spill.as_mut() {
                        s.remove(f.id);
                    }
                }
                Block::Cuda(d) => {
                    if let Some(meta) = self.cuda_metadata.remove(&(d.device, d.pool, d.offset)) {
                        host.push(meta);
                    }
                    let _ = self.gpu.tell(FreeDevice(d)).await;
                }
            }
        }
        if !host.is_empty() {
            let _ = self.allocator.tell(Free(host)).await;
        }
    }

    pub(super) fn host_slice(&mut self, r: &ObjectRef) -> Option<&mut [u8]> {
        let Location::Host { segment, offset } = r.location else {
            return None;
        };
        let seg = self.segments.get(segment as usize)?;
        let p = seg.ptr(offset, r.size)?;
        // SAFETY: the range is inside the mapping and belongs to an unsealed object that only
        // this actor writes to during PutInline.
        Some(unsafe { std::slice::from_raw_parts_mut(p, r.size as usize) })
    }
}
