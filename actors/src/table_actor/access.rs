//! The messages that use objects once made: gets (waiting or not), releases, deletes,
//! listing, STATS, the metrics and EVICT; and a client's life with the store: its hold table and the
//! directory (attach), notifications (subscribe) and everything it held when it goes.

use std::time::Duration;

use kameo::message::{Context, Message};
use tokio::sync::{mpsc, oneshot};
use vovp_types::{
    Device, Error, HolderId, Notification, ObjectId, ObjectInfo, ObjectName, StoreMetrics,
    StoreStats,
};

use super::ObjectTableActor;
use crate::allocator::{Free, HostUsage, OwnerGone};
use crate::lend_ledger::LendKind;
use crate::shared_regions::SharedFds;
use crate::table::{CompletedGet, GetResults, WaiterId};

/// Notifications buffered per subscriber before it is dropped as too slow.
const SUBSCRIBER_BUFFER: usize = 4096;

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
    type Reply = Result<oneshot::Receiver<Result<GetResults, Error>>, Error>;

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
                    error: None,
                    reply: tx,
                };
                self.deliver(vec![done]).await;
            }
            Ok(started) => {
                // Durations beyond ~a century mean "forever": no timer. A get that does not
                // wait for missing names waits only for its restores: no timer either.
                if let Some(timeout) = wait.filter(|t| *t < Duration::from_secs(100 * 365 * 86400))
                {
                    let me = ctx.actor_ref().clone();
                    let waiter = started.waiter;
                    tokio::spawn(async move {
                        tokio::time::sleep(timeout).await;
                        let _ = me.tell(WaiterTimedOut(waiter)).await;
                    });
                }
                self.start_restores(started.restores).await;
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
        if let Some(done) = self.table.expire_waiter(m.0) {
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
        self.notify_subscribers();
        self.schedule_parked_rescan(ctx.actor_ref()).await;
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
        let ended = self.table.take_finished_gets();
        self.deliver(ended).await;
        self.notify_subscribers();
        self.schedule_parked_rescan(ctx.actor_ref()).await;
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

/// One page of the object list (see `ObjectTable::list_page`); the reply's cursor is `None`
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
        let freed = self.table.evict(Device::Cpu, m.bytes);
        let bytes = freed.iter().map(|f| f.block.reserved()).sum();
        self.free(freed).await;
        self.notify_subscribers();
        self.schedule_parked_rescan(ctx.actor_ref()).await;
        bytes
    }
}

/// Counters of the store.
#[derive(Debug)]
pub struct Stats;

impl Message<Stats> for ObjectTableActor {
    type Reply = Result<StoreStats, Error>;

    async fn handle(&mut self, _: Stats, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        Ok(self.stats().await?.0)
    }
}

impl ObjectTableActor {
    /// STATS, and the host memory's use it was filled from.
    async fn stats(&self) -> Result<(StoreStats, HostUsage), Error> {
        let usage = self.host_usage().await?;
        let mut s = self.table.stats();
        if let Some(spill) = &self.spill {
            spill.fill_stats(&mut s);
        }
        s.put_barriers = self.pipelined.barriers_made();
        s.capacity = usage.capacity;
        s.used_bytes = usage.used;
        Ok((s, usage))
    }
}

/// Everything the metrics report of the store: STATS, what the store did, who holds what.
#[derive(Debug)]
pub struct Metrics;

impl Message<Metrics> for ObjectTableActor {
    type Reply = Result<StoreMetrics, Error>;

    async fn handle(&mut self, _: Metrics, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let (stats, usage) = self.stats().await?;
        let mut activity = self.table.activity();
        activity.lends = self.lends.made();
        Ok(StoreMetrics {
            stats,
            resident_bytes: usage.resident,
            live_lends: self.lends.len() as u64,
            activity,
            holders: self.table.holder_usage(),
        })
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
        self.forget_room_waiters(m.holder);
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
        self.notify_subscribers();
        self.schedule_parked_rescan(ctx.actor_ref()).await;
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
        self.schedule_parked_rescan(ctx.actor_ref()).await;
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
        self.table.set_recording(true);
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
        self.table.check_invariants()?;
        self.spill.as_ref().map_or(Ok(()), |s| s.check())
    }
}
