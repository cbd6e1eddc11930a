//! The eviction/refcount actor: owns the [`ObjectTable`], asks the allocator actor (host) or the
//! GPU actor (CUDA) for memory, evicts LRU objects when a pool is full, answers waiting gets and
//! pushes notifications to subscribers. Every client (connection actor or embedded handle)
//! talks to this one actor, so the whole life cycle is serialised in one place.

use std::sync::Arc;
use std::time::Duration;

use kameo::actor::ActorRef;
use kameo::message::{Context, Message};
use kameo::Actor;
use tokio::sync::{mpsc, oneshot};
use vovp_gpu::{AllocateDevice, FreeDevice, GpuActor, GpuError, GpuUsage};

use crate::allocator::{Allocate, AllocatorActor, Free, HostUsage, Usage};
use crate::segment::Segment;
use crate::table::{Block, CompletedGet, Freed, GetResults, ObjectTable, Pool, WaiterId};
use crate::types::*;
use crate::StoreError;

/// Notifications buffered per subscriber before it is dropped as too slow.
const SUBSCRIBER_BUFFER: usize = 4096;

/// The eviction/refcount actor.
#[derive(Actor)]
pub struct ObjectTableActor {
    table: ObjectTable,
    allocator: ActorRef<AllocatorActor>,
    gpu: ActorRef<GpuActor>,
    segments: Arc<[Arc<Segment>]>,
    subscribers: Vec<mpsc::Sender<Notification>>,
}

impl ObjectTableActor {
    pub fn new(
        allocator: ActorRef<AllocatorActor>,
        gpu: ActorRef<GpuActor>,
        segments: Arc<[Arc<Segment>]>,
    ) -> Self {
        ObjectTableActor {
            table: ObjectTable::new(),
            allocator,
            gpu,
            segments,
            subscribers: Vec::new(),
        }
    }

    async fn host_usage(&self) -> Result<HostUsage, StoreError> {
        self.allocator
            .ask(Usage)
            .await
            .map_err(|_| StoreError::ShuttingDown)
    }

    /// (capacity, used) of a pool; `None` for a GPU whose pool does not exist yet.
    async fn pool_usage(&self, pool: Pool) -> Result<Option<(u64, u64)>, StoreError> {
        match pool {
            Pool::Host => {
                let u = self.host_usage().await?;
                Ok(Some((u.capacity, u.used)))
            }
            Pool::Cuda(n) => {
                let usage = self
                    .gpu
                    .ask(GpuUsage)
                    .await
                    .map_err(|_| StoreError::ShuttingDown)?;
                Ok(usage
                    .into_iter()
                    .find(|u| u.device == n)
                    .map(|u| (u.capacity, u.used)))
            }
        }
    }

    /// Memory for `size` bytes on `device`, evicting LRU objects of that pool as needed. A
    /// request that cannot fit even after evicting everything evictable fails before evicting
    /// anything, so a hopeless create never empties the cache.
    async fn allocate(&mut self, size: u64, device: Device) -> Result<Block, StoreError> {
        let pool = Pool::from(device);
        let needed = match pool {
            Pool::Host => crate::allocator::reserved_bytes(size),
            Pool::Cuda(_) => size,
        };
        loop {
            let got = match device {
                Device::Cpu => self
                    .allocator
                    .ask(Allocate { size })
                    .await
                    .map_err(|_| StoreError::ShuttingDown)?
                    .map(Block::Host),
                Device::Cuda(n) => match self.gpu.ask(AllocateDevice { device: n, size }).await {
                    Ok(b) => Some(Block::Cuda(b)),
                    Err(kameo::error::SendError::HandlerError(GpuError::OutOfMemory {
                        ..
                    })) => None,
                    Err(kameo::error::SendError::HandlerError(e)) => return Err(e.into()),
                    Err(_) => return Err(StoreError::ShuttingDown),
                },
            };
            if let Some(block) = got {
                return Ok(block);
            }
            let evictable = self.table.evictable_bytes(pool);
            let (capacity, used) = self.pool_usage(pool).await?.unwrap_or((0, 0));
            let available = capacity.saturating_sub(used) + evictable;
            if evictable == 0 || needed > available {
                return Err(StoreError::OutOfMemory {
                    requested: size,
                    available,
                });
            }
            let freed = self.table.evict(pool, needed);
            tracing::debug!(
                "evicted {} objects to make room for {size} bytes",
                freed.len()
            );
            // Frees reach the allocator before the retry: one sender, one FIFO mailbox.
            self.free(freed).await;
        }
    }

    async fn free(&mut self, freed: Vec<Freed>) {
        self.free_blocks(freed.into_iter().map(|f| f.block)).await
    }

    async fn free_blocks(&mut self, blocks: impl IntoIterator<Item = Block>) {
        let mut host = Vec::new();
        for block in blocks {
            match block {
                Block::Host(h) => host.push(h),
                Block::Cuda(d) => {
                    let _ = self.gpu.tell(FreeDevice(d)).await;
                }
            }
        }
        if !host.is_empty() {
            let _ = self.allocator.tell(Free(host)).await;
        }
    }

    /// Sends completed gets; a requester that went away gets its references released.
    async fn deliver(&mut self, done: Vec<CompletedGet>) {
        let mut freed = Vec::new();
        for d in done {
            if let Err(results) = d.reply.send(d.results) {
                for r in results.into_iter().flatten() {
                    if let Ok(Some(f)) = self.table.release(r.id, d.holder) {
                        freed.push(f);
                    }
                }
            }
        }
        self.free(freed).await;
    }

    fn publish(&mut self) {
        if !self.table.record_events {
            return;
        }
        let events = self.table.take_events();
        self.subscribers.retain(|s| {
            events.iter().all(|e| match s.try_send(e.clone()) {
                Ok(()) => true,
                Err(_) => {
                    tracing::warn!("dropping a notification subscriber that is gone or too slow");
                    false
                }
            })
        });
        self.table.record_events = !self.subscribers.is_empty();
    }

    fn host_slice(&mut self, r: &ObjectRef) -> Option<&mut [u8]> {
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

fn check_metadata(metadata: &[u8]) -> Result<(), StoreError> {
    if metadata.len() > MAX_METADATA_LEN {
        return Err(StoreError::MetadataTooLarge {
            len: metadata.len(),
            max: MAX_METADATA_LEN,
        });
    }
    Ok(())
}

/// Create an unsealed object; the creator holds one reference and writes the bytes.
pub struct Create {
    pub holder: HolderId,
    pub name: ObjectName,
    pub size: u64,
    pub metadata: Arc<[u8]>,
    pub options: CreateOptions,
}

impl Message<Create> for ObjectTableActor {
    type Reply = Result<ObjectRef, StoreError>;

    async fn handle(&mut self, m: Create, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        check_metadata(&m.metadata)?;
        self.table.check_name_free(&m.name)?;
        let block = self
            .allocate(m.size, m.options.device.unwrap_or(Device::Cpu))
            .await?;
        let r = self.table.insert(
            m.name,
            m.size,
            m.metadata,
            block,
            m.options.ephemeral,
            m.holder,
        );
        if r.is_err() {
            self.free_blocks([block]).await;
        }
        r
    }
}

/// Seal an object: immutable and visible from now on; waiting gets are answered.
pub struct Seal {
    pub holder: HolderId,
    pub name: ObjectName,
}

impl Message<Seal> for ObjectTableActor {
    type Reply = Result<(), StoreError>;

    async fn handle(&mut self, m: Seal, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let done = self.table.seal(&m.name, m.holder)?;
        self.deliver(done).await;
        self.publish();
        Ok(())
    }
}

/// Abort an unsealed object and free its memory.
pub struct Abort {
    pub holder: HolderId,
    pub name: ObjectName,
}

impl Message<Abort> for ObjectTableActor {
    type Reply = Result<(), StoreError>;

    async fn handle(&mut self, m: Abort, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let f = self.table.abort(&m.name, m.holder)?;
        self.free(vec![f]).await;
        Ok(())
    }
}

/// Create, copy and seal a host object in one message (small payloads: one round trip).
pub struct PutInline {
    pub holder: HolderId,
    pub name: ObjectName,
    pub data: Vec<u8>,
    pub metadata: Arc<[u8]>,
    pub ephemeral: bool,
    /// Keep the creator's reference (the reply's object id must be released later).
    pub keep_reference: bool,
}

impl Message<PutInline> for ObjectTableActor {
    type Reply = Result<ObjectRef, StoreError>;

    async fn handle(&mut self, m: PutInline, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        check_metadata(&m.metadata)?;
        self.table.check_name_free(&m.name)?;
        let size = m.data.len() as u64;
        let block = self.allocate(size, Device::Cpu).await?;
        let r = self.table.insert(
            m.name.clone(),
            size,
            m.metadata,
            block,
            m.ephemeral,
            m.holder,
        )?;
        match self.host_slice(&r) {
            Some(dst) => crate::copy::parallel_copy(dst, &m.data),
            None => {
                let f = self.table.abort(&m.name, m.holder)?;
                self.free(vec![f]).await;
                return Err(StoreError::Segment("allocation outside its segment".into()));
            }
        }
        let done = self.table.seal(&m.name, m.holder)?;
        self.deliver(done).await;
        if !m.keep_reference {
            let freed = self.table.release(r.id, m.holder)?;
            self.free(freed.into_iter().collect()).await;
        }
        self.publish();
        Ok(r)
    }
}

/// Get a batch of objects. `wait`: `None` answers at once; `Some(d)` waits up to `d` for names
/// not sealed yet. The reply is a receiver that yields the results (in request order).
pub struct Get {
    pub holder: HolderId,
    pub names: Vec<ObjectName>,
    pub wait: Option<Duration>,
}

impl Message<Get> for ObjectTableActor {
    type Reply = Result<oneshot::Receiver<GetResults>, StoreError>;

    async fn handle(&mut self, m: Get, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let (tx, rx) = oneshot::channel();
        let wait = m.wait.filter(|d| !d.is_zero());
        match self.table.begin_get(m.holder, m.names, wait.is_some(), tx) {
            Err((results, tx)) => {
                let done = CompletedGet {
                    holder: m.holder,
                    results,
                    reply: tx,
                };
                self.deliver(vec![done]).await;
            }
            Ok(waiter) => {
                let timeout = wait.unwrap_or_default();
                // Durations beyond ~a century mean "forever": no timer.
                if timeout < Duration::from_secs(100 * 365 * 86400) {
                    let me = ctx.actor_ref().clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(timeout).await;
                        let _ = me.tell(WaiterTimedOut(waiter)).await;
                    });
                }
            }
        }
        Ok(rx)
    }
}

/// Internal: a waiting get reached its timeout.
pub struct WaiterTimedOut(pub WaiterId);

impl Message<WaiterTimedOut> for ObjectTableActor {
    type Reply = ();

    async fn handle(&mut self, m: WaiterTimedOut, _: &mut Context<Self, Self::Reply>) {
        if let Some(done) = self.table.finish_waiter(m.0) {
            self.deliver(vec![done]).await;
        }
    }
}

/// Drop references (one per id). All ids are processed; the first error is returned as a value
/// (not an `Err`: a failed `tell` would stop the actor, and releases are mostly told).
pub struct Release {
    pub holder: HolderId,
    pub ids: Vec<ObjectId>,
}

impl Message<Release> for ObjectTableActor {
    type Reply = Option<StoreError>;

    async fn handle(&mut self, m: Release, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let mut first_err = None;
        let mut freed = Vec::new();
        for id in m.ids {
            match self.table.release(id, m.holder) {
                Ok(f) => freed.extend(f),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        self.free(freed).await;
        self.publish();
        first_err
    }
}

/// Delete a sealed object (deferred while referenced).
pub struct Delete {
    pub name: ObjectName,
}

impl Message<Delete> for ObjectTableActor {
    type Reply = Result<(), StoreError>;

    async fn handle(&mut self, m: Delete, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let freed = self.table.delete(&m.name)?;
        self.free(freed.into_iter().collect()).await;
        self.publish();
        Ok(())
    }
}

/// Is `name` sealed and present?
pub struct Contains {
    pub name: ObjectName,
}

impl Message<Contains> for ObjectTableActor {
    type Reply = bool;

    async fn handle(&mut self, m: Contains, _: &mut Context<Self, Self::Reply>) -> bool {
        self.table.contains(&m.name)
    }
}

/// Every named object.
pub struct List;

impl Message<List> for ObjectTableActor {
    type Reply = Vec<ObjectInfo>;

    async fn handle(&mut self, _: List, _: &mut Context<Self, Self::Reply>) -> Vec<ObjectInfo> {
        self.table.list()
    }
}

/// Evict at least `bytes` of unreferenced host objects (LRU first); replies the bytes freed.
pub struct Evict {
    pub bytes: u64,
}

impl Message<Evict> for ObjectTableActor {
    type Reply = u64;

    async fn handle(&mut self, m: Evict, _: &mut Context<Self, Self::Reply>) -> u64 {
        let freed = self.table.evict(Pool::Host, m.bytes);
        let bytes = freed.iter().map(|f| f.block.reserved()).sum();
        self.free(freed).await;
        self.publish();
        bytes
    }
}

/// Counters of the store.
pub struct Stats;

impl Message<Stats> for ObjectTableActor {
    type Reply = Result<StoreStats, StoreError>;

    async fn handle(&mut self, _: Stats, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let usage = self.host_usage().await?;
        let mut s = self.table.stats();
        s.capacity = usage.capacity;
        s.used_bytes = usage.used;
        Ok(s)
    }
}

/// A holder went away: release all it held, abort what it left unsealed.
pub struct ReleaseHolder {
    pub holder: HolderId,
}

impl Message<ReleaseHolder> for ObjectTableActor {
    type Reply = ();

    async fn handle(&mut self, m: ReleaseHolder, _: &mut Context<Self, Self::Reply>) {
        let freed = self.table.release_holder(m.holder);
        if !freed.is_empty() {
            tracing::debug!("holder {} gone: {} objects freed", m.holder, freed.len());
        }
        self.free(freed).await;
        self.publish();
    }
}

/// Subscribe to seal/delete/evict notifications.
pub struct Subscribe;

impl Message<Subscribe> for ObjectTableActor {
    type Reply = mpsc::Receiver<Notification>;

    async fn handle(
        &mut self,
        _: Subscribe,
        _: &mut Context<Self, Self::Reply>,
    ) -> mpsc::Receiver<Notification> {
        let (tx, rx) = mpsc::channel(SUBSCRIBER_BUFFER);
        self.subscribers.push(tx);
        self.table.record_events = true;
        rx
    }
}

/// Check the table's invariants (tests).
pub struct CheckInvariants;

impl Message<CheckInvariants> for ObjectTableActor {
    type Reply = Result<(), String>;

    async fn handle(
        &mut self,
        _: CheckInvariants,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        self.table.check_invariants()
    }
}
