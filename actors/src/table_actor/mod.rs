//! The eviction/refcount actor: owns the [`ObjectTable`], asks the allocator actor (host) or the
//! GPU actor (CUDA) for memory, evicts LRU objects when a device is full, answers waiting gets and
//! pushes notifications to subscribers. Every client (a daemon connection or an embedded
//! handle, each through its engine `Session`) talks to this one actor, so the whole life cycle
//! is serialised in one place.
//!
//! - this module: the actor's state, and the steps every message that changes objects ends
//!   with (seal, answer waiting gets, notify subscribers);
//! - `memory`: memory for objects (allocate, evict and retry; lends taken back; metadata
//!   placed; blocks freed to whoever gave them) and the parked objects' timer;
//! - `puts`: the messages that make objects (CREATE/SEAL/ABORT, inline PUT, LEND/PUBLISH,
//!   pipelined puts' bookkeeping);
//! - `access`: the messages that read, release, delete and list them, STATS and the metrics,
//!   and a client's attach/subscribe/detach;
//! - `spilling`: spilling's side of it (requests waiting for room, restores, the IO worker's
//!   completions; the mechanism is [`crate::spill`]).

mod access;
mod memory;
mod puts;
mod spilling;

use std::sync::Arc;

use std::collections::{HashMap, HashSet, VecDeque};

use kameo::actor::ActorRef;
use kameo::Actor;
use tokio::sync::mpsc;

use crate::allocator::{AllocatorActor, HostBlock};
use crate::block::Block;
use crate::gpu::GpuActor;
use crate::lend_ledger::LendLedger;
use crate::pipelined::PipelinedPuts;
use crate::segment::Segment;
use crate::shared_regions::{SharedConfig, SharedRegions};
use crate::spill::{Spill, SpillConfig};
use crate::table::{CompletedGet, ObjectTable};
use vovp_types::{Error, HolderId, Notification, ObjectId, ObjectName, ObjectRef};

pub use access::{
    AttachShared, CheckInvariants, CollectParked, Contains, Delete, Evict, Get, List, ListPage,
    Metrics, Release, ReleaseHolder, Stats, Subscribe, WaiterTimedOut,
};
pub use puts::{
    Abort, AwaitSentPuts, Create, PipelinedPutRefused, Publish, PublishMany, PutInline,
    RefusedPublish, Seal, TakeLend,
};
pub use spilling::SpillIoDone;

/// The eviction/refcount actor.
pub struct ObjectTableActor {
    table: ObjectTable,
    allocator: ActorRef<AllocatorActor>,
    gpu: ActorRef<GpuActor>,
    segments: Arc<[Arc<Segment>]>,
    subscribers: Vec<mpsc::Sender<Notification>>,
    /// The host blocks charged for CUDA objects' metadata, by (device, pool, offset).
    cuda_metadata: std::collections::HashMap<(u32, u32, u64), HostBlock>,
    /// Arenas this actor wrote metadata into, so the next write needs no allocator ask
    /// (weak: the allocator decides when an arena goes).
    arenas: std::collections::HashMap<u32, std::sync::Weak<Segment>>,
    /// A [`CollectParked`] is on its way.
    rescan_scheduled: bool,
    /// Parts of clients' arenas lent to them (LEND / PUBLISH).
    lends: LendLedger,
    /// Pipelined puts applied, and misses waiting for more of them.
    pipelined: PipelinedPuts,
    /// Spilling to disk (`None`: off, victims are evicted).
    spill: Option<Spill>,
    /// Requests waiting for memory that spills in flight will free (`spilling.rs`).
    room_waiters: VecDeque<spilling::RoomWaiter>,
    /// Bytes of the spills in flight the waiting requests count on.
    claimed: u64,
    /// Spilled objects whose restore waits for room.
    restores_queued: HashSet<ObjectId>,
    /// Blocks of objects that left the table while a spill or restore IO used them: freed
    /// when it reports.
    doomed: HashMap<u64, Block>,
}

impl Actor for ObjectTableActor {
    type Args = Self;
    type Error = std::convert::Infallible;

    /// Starts the spill worker, which reports to this actor (weakly: it does not keep the
    /// actor alive).
    async fn on_start(mut state: Self, me: ActorRef<Self>) -> Result<Self, Self::Error> {
        if let Some(spill) = state.spill.as_mut() {
            let me = me.downgrade();
            let started = spill.start(|| {
                Box::new(move |done| {
                    if let Some(me) = me.upgrade() {
                        let _ = me.tell(SpillIoDone(done)).try_send();
                    }
                })
            });
            if let Err(e) = started {
                tracing::error!("spilling is off: {e}");
                state.spill = None;
            }
        }
        Ok(state)
    }
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
    /// their hold tables (`None`: every get is a message). `spill`: spill victims to a
    /// directory instead of evicting them (`None`: off); it is locked and cleaned here, so a
    /// directory another daemon uses fails the start. `max_objects`: the store's object limit
    /// (spill files count against it too).
    pub fn new(
        allocator: ActorRef<AllocatorActor>,
        gpu: ActorRef<GpuActor>,
        segments: Arc<[Arc<Segment>]>,
        shared: Option<SharedConfig>,
        spill: Option<&SpillConfig>,
        max_objects: usize,
    ) -> Result<Self, Error> {
        let spill = spill.map(|c| Spill::open(c, max_objects)).transpose()?;
        let table = match shared {
            Some(c) => ObjectTable::with_shared(SharedRegions::new(c)?),
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
            lends: LendLedger::new(),
            pipelined: PipelinedPuts::default(),
            spill,
            room_waiters: VecDeque::new(),
            claimed: 0,
            restores_queued: HashSet::new(),
            doomed: HashMap::new(),
        })
    }

    /// Sends completed gets (counting the hits and misses of those that did not fail); a
    /// requester that went away, or a get that failed, gets its references released.
    async fn deliver(&mut self, done: Vec<CompletedGet>) {
        let mut freed = Vec::new();
        for d in done {
            let unsent = match d.error {
                None => {
                    self.table.count_get(&d.results);
                    d.reply.send(Ok(d.results)).err().and_then(Result::ok)
                }
                Some(e) => {
                    let _ = d.reply.send(Err(e));
                    Some(d.results)
                }
            };
            for r in unsent.into_iter().flatten().flatten() {
                if let Ok(Some(f)) = self.table.release(r.id, d.holder) {
                    freed.push(f);
                }
            }
        }
        self.free(freed).await;
    }

    /// Sends the notifications the table recorded to every subscriber; one that is gone or too
    /// slow is dropped, and recording stops with the last one.
    fn notify_subscribers(&mut self) {
        if !self.table.recording() {
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
        self.table.set_recording(!self.subscribers.is_empty());
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
        self.notify_subscribers();
        self.schedule_parked_rescan(me).await;
        Ok(())
    }
}
