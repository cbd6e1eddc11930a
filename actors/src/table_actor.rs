//! The eviction/refcount actor: owns the [`ObjectTable`], asks the allocator actor (host) or the
//! GPU actor (CUDA) for memory, evicts LRU objects when a pool is full, answers waiting gets and
//! pushes notifications to subscribers. Every client (a daemon connection or an embedded
//! handle, each through its engine `Session`) talks to this one actor, so the whole life cycle
//! is serialised in one place.

use std::sync::Arc;
use std::time::Duration;

use kameo::actor::ActorRef;
use kameo::message::{Context, Message};
use kameo::Actor;
use tokio::sync::{mpsc, oneshot};
use vovp_gpu::GpuError;

use crate::gpu::{AllocateDevice, FreeDevice, GpuActor, GpuUsage};

use crate::allocator::{
    AllocFailure, Allocate, AllocatorActor, Free, HostUsage, OwnerGone, Usage, Writer,
};
use crate::lends::{LendKind, Lends};
use crate::pipelined::PipelinedPuts;
use crate::segment::Segment;
use crate::shared::{Shared, SharedConfig, SharedFds};
use crate::table::{Block, CompletedGet, Freed, GetResults, ObjectTable, Pool, WaiterId};
use vovp_types::Error;
use vovp_types::*;

/// Notifications buffered per subscriber before it is dropped as too slow.
const SUBSCRIBER_BUFFER: usize = 4096;

/// How often parked objects (kept because a client's hold table names them) are looked at
/// again: a release through a hold table sends no message, so a deferred delete's memory
/// comes back within this long of the last release (at once when memory runs short).
const PARKED_RESCAN: Duration = Duration::from_millis(5);

/// The eviction/refcount actor.
#[derive(Actor)]
pub struct ObjectTableActor {
    table: ObjectTable,
    allocator: ActorRef<AllocatorActor>,
    gpu: ActorRef<GpuActor>,
    segments: Arc<[Arc<Segment>]>,
    subscribers: Vec<mpsc::Sender<Notification>>,
    /// The host blocks charged for CUDA objects' metadata, by (device, pool, offset).
    cuda_metadata: std::collections::HashMap<(u32, u32, u64), crate::allocator::HostBlock>,
    /// Arenas this actor wrote metadata into, so the next write needs no allocator ask
    /// (weak: the allocator decides when an arena goes).
    arenas: std::collections::HashMap<u32, std::sync::Weak<Segment>>,
    /// A [`CollectParked`] is on its way.
    rescan_scheduled: bool,
    /// Parts of clients' arenas lent to them (LEND / PUBLISH).
    lends: Lends,
    /// Pipelined puts applied, and misses waiting for more of them.
    pipelined: PipelinedPuts,
}

impl std::fmt::Debug for ObjectTableActor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The actor's state is large and changes under the caller; its name is what a log needs.
        f.debug_struct("ObjectTableActor").finish_non_exhaustive()
    }
}

impl ObjectTableActor {
    /// How many pipelined puts this actor has applied, ever ([`crate::pipelined`]).
    pub fn pipelined_puts_applied(&self) -> Arc<std::sync::atomic::AtomicU64> {
        self.pipelined.total()
    }

    /// `shared`: publish sealed host objects in a shared directory, read by clients through
    /// their hold tables (`None`: every get is a message).
    pub fn new(
        allocator: ActorRef<AllocatorActor>,
        gpu: ActorRef<GpuActor>,
        segments: Arc<[Arc<Segment>]>,
        shared: Option<SharedConfig>,
    ) -> Result<Self, Error> {
        let table = match shared {
            Some(c) => ObjectTable::with_shared(Shared::new(c)?),
            None => ObjectTable::new(),
        };
        Ok(ObjectTableActor {
            table,
            allocator,
            gpu,
            segments,
            subscribers: Vec::new(),
            cuda_metadata: std::collections::HashMap::new(),
            arenas: std::collections::HashMap::new(),
            rescan_scheduled: false,
            lends: Lends::new(),
            pipelined: PipelinedPuts::default(),
        })
    }

    /// Writes a host object's metadata into its block, after the data padded to
    /// [`ALIGNMENT`] (where `allocate` made room): where readers of the shared directory
    /// find it. The store writes it, not the creator, so it is what the store was told.
    async fn place_metadata(&mut self, block: &Block, size: u64, metadata: &[u8]) {
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
        let segment = match self
            .segments
            .get(segment_id as usize)
            .filter(|s| s.id() == segment_id)
        {
            Some(s) => Some(s.clone()),
            None => match self
                .arenas
                .get(&segment_id)
                .and_then(std::sync::Weak::upgrade)
            {
                Some(s) => Some(s),
                None => {
                    let s = self
                        .allocator
                        .ask(crate::allocator::SegmentById(segment_id))
                        .await
                        .ok()
                        .flatten();
                    if let Some(s) = &s {
                        self.arenas.retain(|_, w| w.strong_count() > 0);
                        self.arenas.insert(segment_id, Arc::downgrade(s));
                    }
                    s
                }
            },
        };
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

    /// Frees what `collect_parked` lets go, and keeps the timer going while anything is
    /// parked.
    async fn after_change(&mut self, ctx: &ActorRef<Self>) {
        if self.table.parked() > 0 && !self.rescan_scheduled {
            self.rescan_scheduled = true;
            let me = ctx.clone();
            tokio::spawn(async move {
                tokio::time::sleep(PARKED_RESCAN).await;
                let _ = me.tell(CollectParked).await;
            });
        }
    }

    async fn host_usage(&self) -> Result<HostUsage, Error> {
        self.allocator
            .ask(Usage)
            .await
            .map_err(|_| Error::ShuttingDown)
    }

    /// (capacity, used) of a pool; `None` for a GPU whose pool does not exist yet.
    async fn pool_usage(&self, pool: Pool) -> Result<Option<(u64, u64)>, Error> {
        match pool {
            Pool::Host => {
                let u = self.host_usage().await?;
                // Past what the machine can back, the store's free bytes are not available.
                Ok(Some((
                    u.capacity.min(u.used.saturating_add(u.backable)),
                    u.used,
                )))
            }
            Pool::Cuda(n) => {
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
    /// evicting LRU objects of that pool as needed. A request that cannot fit even after
    /// evicting everything evictable fails before evicting anything, so a hopeless create never
    /// empties the cache.
    ///
    /// A host object's metadata is counted in its block (data padded to [`ALIGNMENT`], then
    /// room for the metadata), so `-m` bounds what the metadata the table keeps on the heap
    /// can cost as well (CUDA objects: see `Create`).
    ///
    /// Termination: every pass either returns or evicts at least one object from the pool's
    /// LRU, and nothing else can touch the table in between (an actor handles one message at a
    /// time), so there are at most as many passes as evictable objects plus one.
    async fn allocate(
        &mut self,
        size: u64,
        metadata_len: usize,
        device: Device,
        writer: Writer,
    ) -> Result<Block, Error> {
        let pool = Pool::from(device);
        let bytes = match pool {
            Pool::Host => size.checked_next_multiple_of(ALIGNMENT),
            Pool::Cuda(_) => Some(size),
        }
        .and_then(|b| b.checked_add(metadata_len as u64));
        // What eviction must free: the bytes the object is charged (`None` only for sizes near
        // 2^64, which nothing can hold).
        let needed = match pool {
            Pool::Host => vovp_types::lends::block_len(size, metadata_len as u64),
            Pool::Cuda(_) => bytes,
        };
        let oom = |available| Error::OutOfMemory {
            requested: size,
            available,
        };
        loop {
            let failure = match (bytes, needed) {
                (Some(bytes), Some(_)) => self.try_allocate(bytes, device, writer).await?,
                _ => Err(AllocFailure::NoSpace),
            };
            let failure = match failure {
                Ok(block) => return Ok(block),
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
            if pool == Pool::Host && self.revoke_empty_lends().await {
                continue;
            }
            // Usage is asked only on failure: the hot path is one message to the allocator.
            let (capacity, used) = self.pool_usage(pool).await?.unwrap_or((0, 0));
            let evictable = self.table.evictable_bytes(pool);
            let available = capacity.saturating_sub(used).saturating_add(evictable);
            let Some(needed) = needed else {
                return Err(oom(available));
            };

            let target = match failure {
                AllocFailure::TooManyAllocations { limit } => {
                    if self.table.evictable_objects(pool) == 0 {
                        return Err(Error::TooManyObjects { limit });
                    }
                    // Any one evicted object frees a slot; retry decides whether bytes fit too.
                    1
                }
                AllocFailure::NoSpace => {
                    if evictable == 0 || needed > available {
                        return Err(oom(available));
                    }
                    needed
                }
            };
            let freed = self.table.evict(pool, target);
            if freed.is_empty() {
                // Everything evictable is held through clients' hold tables (or, never while
                // the LRU and its byte count agree, nothing was): never loop on it.
                return Err(match failure {
                    AllocFailure::TooManyAllocations { limit } => Error::TooManyObjects { limit },
                    AllocFailure::NoSpace => oom(available),
                });
            }
            tracing::debug!(
                "evicted {} objects to make room for {size} bytes",
                freed.len()
            );
            // Frees reach the allocator before the retry: one sender, one FIFO mailbox.
            self.free(freed).await;
        }
    }

    /// Takes back every empty lend no put is writing into (its client sees it on its next put
    /// and asks for a new one); `true` when that freed memory.
    async fn revoke_empty_lends(&mut self) -> bool {
        let mut freed = Vec::new();
        for (holder, lend) in self.lends.current_empty() {
            if self.table.revoke_lend(holder, lend) {
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

    async fn free(&mut self, freed: Vec<Freed>) {
        self.free_blocks(freed.into_iter().map(|f| f.block)).await
    }

    async fn free_blocks(&mut self, blocks: impl IntoIterator<Item = Block>) {
        let mut host = Vec::new();
        for block in blocks {
            match block {
                Block::Host(h) => host.push(h),
                Block::Lent(l) => host.extend(self.lends.freed(&l)),
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

    /// Seals `name` for `holder` (with `id`, that incarnation only), answers the gets waiting
    /// for it, frees a replaced version nobody holds: the version it became.
    async fn seal_object(
        &mut self,
        name: &ObjectName,
        holder: HolderId,
        id: Option<ObjectId>,
    ) -> Result<u64, Error> {
        let sealed = self.table.seal(name, holder, id)?;
        self.deliver(sealed.done).await;
        self.free(sealed.freed.into_iter().collect()).await;
        Ok(sealed.version)
    }

    /// The end of a put (inline or published from a lend): seals the object just inserted as
    /// `r` (setting its version), answers the gets waiting for it, and drops the putter's
    /// reference unless it keeps one.
    async fn seal_put(
        &mut self,
        r: &mut ObjectRef,
        holder: HolderId,
        keep_reference: bool,
        me: &ActorRef<Self>,
    ) -> Result<(), Error> {
        r.version = self.seal_object(&r.name, holder, Some(r.id)).await?;
        if !keep_reference {
            let freed = self.table.release(r.id, holder)?;
            self.free(freed.into_iter().collect()).await;
        }
        self.publish();
        self.after_change(me).await;
        Ok(())
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

/// Create an unsealed object; the creator holds one reference and writes the bytes.
#[derive(Debug)]
pub struct Create {
    pub holder: HolderId,
    /// A client that writes the bytes through its own mapping (its objects go into its own
    /// arena, which only it can write), or the store (embedded engine: segment 0).
    pub writer: Writer,
    pub name: ObjectName,
    pub size: u64,
    pub metadata: Arc<[u8]>,
    pub options: CreateOptions,
}

impl Message<Create> for ObjectTableActor {
    type Reply = Result<ObjectRef, Error>;

    async fn handle(&mut self, m: Create, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        check_metadata(&m.metadata)?;
        self.table
            .check_name_free(&m.name, m.options.replace, m.holder)?;
        let device = m.options.device.unwrap_or(Device::Cpu);
        // A CUDA object's metadata lives on the daemon's heap: it is charged to host memory (a
        // block of segment 0 that is never touched), so `-m` bounds it and `--gpu-memory`
        // stays whole for tensor data.
        let cuda_metadata = match device {
            Device::Cuda(_) if !m.metadata.is_empty() => {
                match self
                    .allocate(m.metadata.len() as u64, 0, Device::Cpu, Writer::Store)
                    .await?
                {
                    Block::Host(h) => Some(h),
                    Block::Cuda(_) | Block::Lent(_) => None,
                }
            }
            _ => None,
        };
        let block = match device {
            Device::Cpu => {
                self.allocate(m.size, m.metadata.len(), device, m.writer)
                    .await
            }
            Device::Cuda(_) => self.allocate(m.size, 0, device, m.writer).await,
        };
        let block = match block {
            Ok(b) => b,
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
        self.place_metadata(&block, m.size, &m.metadata).await;
        let r = self.table.insert(
            m.name,
            m.size,
            m.metadata,
            block,
            m.options.ephemeral,
            m.options.replace,
            m.holder,
        );
        if r.is_err() {
            self.free_blocks([block]).await;
        }
        self.after_change(ctx.actor_ref()).await;
        r
    }
}

/// Seal an object: immutable and visible from now on; waiting gets are answered.
#[derive(Debug)]
pub struct Seal {
    pub holder: HolderId,
    pub name: ObjectName,
    /// The incarnation to seal, when the caller knows it (an embedded buffer does; the wire
    /// protocol seals by name only).
    pub id: Option<ObjectId>,
}

impl Message<Seal> for ObjectTableActor {
    /// The version the object became.
    type Reply = Result<u64, Error>;

    async fn handle(&mut self, m: Seal, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let version = self.seal_object(&m.name, m.holder, m.id).await?;
        self.publish();
        self.after_change(ctx.actor_ref()).await;
        Ok(version)
    }
}

/// Abort an unsealed object and free its memory.
#[derive(Debug)]
pub struct Abort {
    pub holder: HolderId,
    pub name: ObjectName,
    /// Free the memory only when the creator releases its reference (see `ObjectTable::abort`):
    /// the embedded engine, whose buffers point straight at it. The daemon frees at once, as
    /// PROTOCOL.md says.
    pub keep_while_held: bool,
}

impl Message<Abort> for ObjectTableActor {
    type Reply = Result<(), Error>;

    async fn handle(&mut self, m: Abort, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let f = self.table.abort(&m.name, m.holder, m.keep_while_held)?;
        self.free(f.into_iter().collect()).await;
        Ok(())
    }
}

/// Create, copy and seal a host object in one message (small payloads: one round trip).
#[derive(Debug)]
pub struct PutInline {
    pub holder: HolderId,
    pub name: ObjectName,
    pub data: Vec<u8>,
    pub metadata: Arc<[u8]>,
    pub ephemeral: bool,
    /// Becomes the name's next version if it is taken (see [`CreateOptions::replace`]).
    pub replace: bool,
    /// Keep the creator's reference (the reply's object id must be released later).
    pub keep_reference: bool,
    /// Sent without waiting for the reply: counted as applied, whatever the outcome
    /// ([`crate::pipelined`]).
    pub pipelined: bool,
}

impl Message<PutInline> for ObjectTableActor {
    type Reply = Result<ObjectRef, Error>;

    async fn handle(&mut self, m: PutInline, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let (holder, pipelined) = (m.holder, m.pipelined);
        let r = self.put_inline(m, ctx.actor_ref()).await;
        if pipelined {
            self.pipelined.applied_one(holder);
        }
        r
    }
}

impl ObjectTableActor {
    async fn put_inline(&mut self, m: PutInline, me: &ActorRef<Self>) -> Result<ObjectRef, Error> {
        check_metadata(&m.metadata)?;
        self.table.check_name_free(&m.name, m.replace, m.holder)?;
        let size = m.data.len() as u64;
        // The store copies inline payloads in itself: segment 0, which no client can write.
        let block = self
            .allocate(size, m.metadata.len(), Device::Cpu, Writer::Store)
            .await?;
        self.place_metadata(&block, size, &m.metadata).await;
        let mut r = self.table.insert(
            m.name.clone(),
            size,
            m.metadata,
            block,
            m.ephemeral,
            m.replace,
            m.holder,
        )?;
        match self.host_slice(&r) {
            Some(dst) => vovp_shm::copy::parallel_copy(dst, &m.data),
            None => {
                let f = self.table.abort(&m.name, m.holder, false)?;
                self.free(f.into_iter().collect()).await;
                return Err(Error::Memory("allocation outside its segment".into()));
            }
        }
        self.seal_put(&mut r, m.holder, m.keep_reference, me)
            .await?;
        Ok(r)
    }
}

/// A pipelined put of `holder` that failed before reaching the table (its request was
/// refused on the way): done, as far as waiting misses are concerned.
#[derive(Debug)]
pub struct PipelinedPutRefused {
    pub holder: HolderId,
}

impl Message<PipelinedPutRefused> for ObjectTableActor {
    type Reply = ();

    async fn handle(&mut self, m: PipelinedPutRefused, _: &mut Context<Self, Self::Reply>) {
        self.pipelined.applied_one(m.holder);
    }
}

/// Before `holder` is told that a name is missing: the other clients' pipelined puts sent
/// before (their hold tables' counts) that are not applied yet. `None`: none, answer now;
/// else the receiver fires once they are all applied (or their clients gone).
#[derive(Debug)]
pub struct AwaitSentPuts {
    pub holder: HolderId,
}

impl Message<AwaitSentPuts> for ObjectTableActor {
    type Reply = Option<oneshot::Receiver<()>>;

    async fn handle(
        &mut self,
        m: AwaitSentPuts,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        self.pipelined.barrier(m.holder, self.table.puts_sent())
    }
}

/// Lend `holder` a part of its own arena (its previous lend takes no new object).
#[derive(Debug)]
pub struct TakeLend {
    pub holder: HolderId,
    /// The block the client wants to write next (data padded to 64 bytes, then metadata).
    pub at_least: u64,
    /// The store's lend size ([`crate::lends::lend_size`]), or the small lend's.
    pub size: u64,
    /// The small-object lend (LEND_SMALL): the holder's second lend, never taken back.
    pub small: bool,
}

impl Message<TakeLend> for ObjectTableActor {
    type Reply = Result<Lend, Error>;

    async fn handle(&mut self, m: TakeLend, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let max = vovp_types::lends::max_object(m.size);
        if m.at_least > max {
            return Err(Error::TooLarge(format!(
                "a lend is for objects of up to {max} bytes, not {}: use CREATE",
                m.at_least
            )));
        }
        // A lend is taken back through the client's hold table (when the store is short of
        // memory), so a client without one, or one that does not count its puts there, gets
        // none.
        if !self.table.takes_part_in_lends(m.holder) {
            return Err(Error::Config(
                "lends need this connection's hold table, mapped and taking part in the lend \
                 handshake (SHARED; not with --no-shared-reads): use CREATE"
                    .into(),
            ));
        }
        let kind = if m.small {
            LendKind::Small
        } else {
            LendKind::Big
        };
        // The client asks for a big lend only while none of its puts writes into one. (Not
        // for a small one: the mark may name a big lend the client has not seen taken back
        // yet, and clearing it would let the client write into that lend.)
        if kind == LendKind::Big {
            self.table.clear_lend_revocation(m.holder);
        }
        if let Some(again) = self
            .lends
            .reuse_empty(m.holder, kind)
            .filter(|l| l.size == m.size)
        {
            return Ok(again);
        }
        // Retired first, so that an emptied lend's memory can serve the new one.
        if let Some(old) = self.lends.retire(m.holder, kind) {
            let _ = self.allocator.tell(Free(vec![old])).await;
        }
        match self
            .allocate(m.size, 0, Device::Cpu, Writer::Client(m.holder))
            .await?
        {
            Block::Host(h) => Ok(self.lends.insert(m.holder, kind, h)),
            other => {
                self.free_blocks([other]).await;
                Err(Error::Internal("a lend outside host memory".into()))
            }
        }
    }
}

/// Make the bytes a client wrote into its lend a sealed object (create + seal in one message).
#[derive(Debug)]
pub struct Publish {
    pub holder: HolderId,
    pub lend: u64,
    pub offset: u64,
    pub name: ObjectName,
    pub size: u64,
    pub metadata: Arc<[u8]>,
    pub ephemeral: bool,
    /// Becomes the name's next version if it is taken (see [`CreateOptions::replace`]).
    pub replace: bool,
    /// Keep the creator's reference (the reply's object id must be released later).
    pub keep_reference: bool,
    /// Sent without waiting for the reply: counted as applied, whatever the outcome
    /// ([`crate::pipelined`]).
    pub pipelined: bool,
}

impl Message<Publish> for ObjectTableActor {
    type Reply = Result<ObjectRef, Error>;

    async fn handle(&mut self, m: Publish, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.publish_counted(m, ctx.actor_ref()).await
    }
}

/// Several PUBLISHes of one holder in one message (PUBLISH_MANY): each carried out as its own
/// [`Publish`] would be, in order; one result each. An item refused before the table (an
/// invalid name) comes as its error, counted applied here if it was pipelined.
#[derive(Debug)]
pub struct PublishMany {
    pub holder: HolderId,
    pub items: Vec<Result<Publish, RefusedPublish>>,
}

/// A PUBLISH_MANY item the session refused: why, and whether the client pipelined it.
#[derive(Debug)]
pub struct RefusedPublish {
    pub error: Error,
    pub pipelined: bool,
}

impl Message<PublishMany> for ObjectTableActor {
    type Reply = Vec<Result<ObjectRef, Error>>;

    async fn handle(
        &mut self,
        m: PublishMany,
        ctx: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        let mut results = Vec::with_capacity(m.items.len());
        for item in m.items {
            results.push(match item {
                Ok(p) => self.publish_counted(p, ctx.actor_ref()).await,
                Err(refused) => {
                    if refused.pipelined {
                        self.pipelined.applied_one(m.holder);
                    }
                    Err(refused.error)
                }
            });
        }
        results
    }
}

impl ObjectTableActor {
    /// One PUBLISH, counted applied if it was pipelined, whatever its outcome.
    async fn publish_counted(
        &mut self,
        m: Publish,
        me: &ActorRef<Self>,
    ) -> Result<ObjectRef, Error> {
        let (holder, pipelined) = (m.holder, m.pipelined);
        let r = self.publish_lent(m, me).await;
        if pipelined {
            self.pipelined.applied_one(holder);
        }
        r
    }

    async fn publish_lent(&mut self, m: Publish, me: &ActorRef<Self>) -> Result<ObjectRef, Error> {
        check_metadata(&m.metadata)?;
        self.table.check_name_free(&m.name, m.replace, m.holder)?;
        let lent = self
            .lends
            .claim(m.holder, m.lend, m.offset, m.size, m.metadata.len() as u64)?;
        let block = Block::Lent(lent);
        self.place_metadata(&block, m.size, &m.metadata).await;
        let mut r = match self.table.insert(
            m.name.clone(),
            m.size,
            m.metadata,
            block,
            m.ephemeral,
            m.replace,
            m.holder,
        ) {
            Ok(r) => r,
            Err(e) => {
                self.free_blocks([block]).await;
                return Err(e);
            }
        };
        self.seal_put(&mut r, m.holder, m.keep_reference, me)
            .await?;
        Ok(r)
    }
}

/// Get a batch of objects. `wait`: `None` answers at once; `Some(d)` waits up to `d` for names
/// not sealed yet. The reply is a receiver that yields the results (in request order).
#[derive(Debug)]
pub struct Get {
    pub holder: HolderId,
    pub names: Vec<ObjectName>,
    /// Per name, the version it must be above (empty: any sealed version).
    pub newer_than: Vec<u64>,
    pub wait: Option<Duration>,
}

impl Message<Get> for ObjectTableActor {
    type Reply = Result<oneshot::Receiver<GetResults>, Error>;

    async fn handle(&mut self, m: Get, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let (tx, rx) = oneshot::channel();
        let wait = m.wait.filter(|d| !d.is_zero());
        match self
            .table
            .begin_get(m.holder, m.names, m.newer_than, wait.is_some(), tx)
        {
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
#[derive(Debug)]
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
#[derive(Debug)]
pub struct Release {
    pub holder: HolderId,
    pub ids: Vec<ObjectId>,
}

impl Message<Release> for ObjectTableActor {
    type Reply = Option<Error>;

    async fn handle(&mut self, m: Release, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
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
        self.after_change(ctx.actor_ref()).await;
        first_err
    }
}

/// Delete a sealed object (deferred while referenced).
#[derive(Debug)]
pub struct Delete {
    pub name: ObjectName,
}

impl Message<Delete> for ObjectTableActor {
    type Reply = Result<(), Error>;

    async fn handle(&mut self, m: Delete, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let freed = self.table.delete(&m.name)?;
        self.free(freed.into_iter().collect()).await;
        self.publish();
        self.after_change(ctx.actor_ref()).await;
        Ok(())
    }
}

/// Is `name` sealed and present?
#[derive(Debug)]
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
#[derive(Debug)]
pub struct List;

impl Message<List> for ObjectTableActor {
    type Reply = Vec<ObjectInfo>;

    async fn handle(&mut self, _: List, _: &mut Context<Self, Self::Reply>) -> Vec<ObjectInfo> {
        self.table.list()
    }
}

/// One page of the object list (see [`ObjectTable::list_page`]); the reply's cursor is `None`
/// after the last page.
#[derive(Debug)]
pub struct ListPage {
    pub start: u64,
    pub limit: usize,
    pub max_bytes: usize,
    /// Encoded size of one entry, so the page can be bounded in wire bytes.
    pub entry_bytes: fn(&ObjectInfo) -> usize,
}

impl Message<ListPage> for ObjectTableActor {
    type Reply = (Vec<ObjectInfo>, Option<u64>);

    async fn handle(&mut self, m: ListPage, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.table
            .list_page(m.start, m.limit, m.max_bytes, m.entry_bytes)
    }
}

/// Evict at least `bytes` of unreferenced host objects (LRU first); replies the bytes freed.
#[derive(Debug)]
pub struct Evict {
    pub bytes: u64,
}

impl Message<Evict> for ObjectTableActor {
    type Reply = u64;

    async fn handle(&mut self, m: Evict, ctx: &mut Context<Self, Self::Reply>) -> u64 {
        let freed = self.table.evict(Pool::Host, m.bytes);
        let bytes = freed.iter().map(|f| f.block.reserved()).sum();
        self.free(freed).await;
        self.publish();
        self.after_change(ctx.actor_ref()).await;
        bytes
    }
}

/// Counters of the store.
#[derive(Debug)]
pub struct Stats;

impl Message<Stats> for ObjectTableActor {
    type Reply = Result<StoreStats, Error>;

    async fn handle(&mut self, _: Stats, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let usage = self.host_usage().await?;
        let mut s = self.table.stats();
        s.put_barriers = self.pipelined.barriers_made();
        s.capacity = usage.capacity;
        s.used_bytes = usage.used;
        Ok(s)
    }
}

/// A holder went away: release all it held, abort what it left unsealed.
#[derive(Debug)]
pub struct ReleaseHolder {
    pub holder: HolderId,
}

impl Message<ReleaseHolder> for ObjectTableActor {
    type Reply = ();

    async fn handle(&mut self, m: ReleaseHolder, ctx: &mut Context<Self, Self::Reply>) {
        let freed = self.table.release_holder(m.holder);
        self.pipelined.forget(m.holder);
        if !freed.is_empty() {
            tracing::debug!("holder {} gone: {} objects freed", m.holder, freed.len());
        }
        self.free(freed).await;
        let lends: Vec<_> = [LendKind::Big, LendKind::Small]
            .into_iter()
            .filter_map(|kind| self.lends.retire(m.holder, kind))
            .collect();
        if !lends.is_empty() {
            let _ = self.allocator.tell(Free(lends)).await;
        }
        let _ = self.allocator.tell(OwnerGone(m.holder)).await;
        self.publish();
        self.after_change(ctx.actor_ref()).await;
    }
}

/// Internal (the parked timer): free or re-publish parked objects no hold table names now.
#[derive(Debug)]
pub struct CollectParked;

impl Message<CollectParked> for ObjectTableActor {
    type Reply = ();

    async fn handle(&mut self, _: CollectParked, ctx: &mut Context<Self, Self::Reply>) {
        self.rescan_scheduled = false;
        let freed = self.table.collect_parked();
        self.free(freed).await;
        self.after_change(ctx.actor_ref()).await;
    }
}

/// A holder's hold table and the shared directory's fd, to hand to a client (`None`: the store
/// does not publish).
#[derive(Debug)]
pub struct AttachShared {
    pub holder: HolderId,
}

impl Message<AttachShared> for ObjectTableActor {
    type Reply = Result<Option<SharedFds>, Error>;

    async fn handle(&mut self, m: AttachShared, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.table.attach_shared(m.holder).transpose()
    }
}

/// The shared directory's read-only fd, duplicated (the embedded engine reads it as a
/// client does); `None`: the store does not publish.
#[derive(Debug)]
pub struct SharedDirectory;

impl Message<SharedDirectory> for ObjectTableActor {
    type Reply = Option<std::fs::File>;

    async fn handle(
        &mut self,
        _: SharedDirectory,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        self.table
            .shared_directory()
            .and_then(|f| f.try_clone().ok())
    }
}

/// Subscribe to seal/delete/evict notifications.
#[derive(Debug)]
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
#[derive(Debug)]
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
