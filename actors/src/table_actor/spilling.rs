//! The table actor's side of spilling ([`crate::spill`] has the mechanism): starting the
//! writes of the victims eviction chose to spill, the queue of requests waiting for room, the
//! restores gets ask for, and the IO worker's completions ([`SpillIoDone`]).
//!
//! No handler waits on a disk. A create (inline put, lend) that needs memory which spills in
//! flight will free is *parked* with its reply sender ([`RoomWaiter`], kameo's delegated
//! reply) and the actor goes on with other messages; every completed write frees memory and
//! asks the parked requests again, in the order they came (a request that still does not fit
//! spills more, waits again, or fails as it would have). A restore that needs room waits the
//! same way, and gets wait for restores in the table's get queue. A request from a holder that
//! went away is dropped from the queue.
//!
//! The memory a spill or restore reads or writes stays the object's until its IO reports: an
//! object removed meanwhile leaves its block here (`doomed`), freed at the IO's end.

use kameo::actor::ActorRef;
use kameo::message::{Context, Message};
use kameo::reply::{DelegatedReply, ReplySender};
use vovp_types::{Device, Error, HolderId, Lend, Location, ObjectId, ObjectRef};

use super::puts::{Create, PutInline, TakeLend};
use super::ObjectTableActor;
use crate::allocator::Writer;
use crate::block::Block;
use crate::spill::{Done, Header, Memory};
use crate::table::{RestoreEnd, SpillEnd, Spilling};

#[cfg(test)]
#[path = "spilling/tests.rs"]
mod tests;

/// What an allocation that may wait for spills got.
#[derive(Debug)]
pub(super) enum Room {
    Ready(Block),
    /// Spills in flight will free the memory: ask again when one lands.
    Wait,
}

/// A request waiting for memory that spills in flight will free.
pub(super) enum RoomWaiter {
    Create(Create, Option<ReplySender<Result<ObjectRef, Error>>>),
    PutInline(PutInline, Option<ReplySender<Result<ObjectRef, Error>>>),
    TakeLend(TakeLend, Option<ReplySender<Result<Lend, Error>>>),
    /// A spilled object gets wait for, to be read back once it has a block.
    Restore(ObjectId),
}

impl RoomWaiter {
    fn holder(&self) -> Option<HolderId> {
        match self {
            RoomWaiter::Create(m, _) => Some(m.holder),
            RoomWaiter::PutInline(m, _) => Some(m.holder),
            RoomWaiter::TakeLend(m, _) => Some(m.holder),
            RoomWaiter::Restore(_) => None,
        }
    }
}

/// Sends a delegated reply (a told message has no sender).
fn answer<T: kameo::Reply>(to: Option<ReplySender<T>>, value: T) {
    if let Some(tx) = to {
        tx.send(value);
    }
}

/// Internal: the IO worker finished a job.
#[derive(Debug)]
pub struct SpillIoDone(pub(crate) Done);

impl Message<SpillIoDone> for ObjectTableActor {
    type Reply = ();

    async fn handle(&mut self, m: SpillIoDone, ctx: &mut Context<Self, Self::Reply>) {
        match m.0 {
            Done::Written { id, result } => self.spill_written(id, result).await,
            Done::Read { id, result } => {
                self.restore_read(id, result.map_err(|d| d.to_string()))
                    .await
            }
        }
        self.after_spill_io(ctx.actor_ref()).await;
        let finished = self.table.take_finished_gets();
        self.deliver(finished).await;
        self.notify_subscribers();
        self.schedule_parked_rescan(ctx.actor_ref()).await;
    }
}

impl ObjectTableActor {
    /// Victims for `bytes` of `device`: spilled when the spill policy admits them, else
    /// evicted.
    pub(super) fn make_room(&mut self, device: Device, bytes: u64) -> crate::table::Room {
        match self.spill.as_mut() {
            Some(spill) => {
                let mut choose = |c: crate::table::SpillCandidate<'_>| {
                    spill.choose(c.id.get(), c.name, c.size, c.frees)
                };
                self.table.evict_with(device, bytes, Some(&mut choose))
            }
            None => crate::table::Room {
                freed: self.table.evict(device, bytes),
                ..Default::default()
            },
        }
    }

    /// Starts the writes of victims being spilled. One that cannot start is evicted instead:
    /// whether any was (its memory is free now).
    pub(super) async fn start_spills(&mut self, spilling: Vec<Spilling>) -> bool {
        let mut evicted = Vec::new();
        for s in spilling {
            let memory = self.memory_of(&s.block, s.size).await;
            let header = Header {
                id: s.id.get(),
                size: s.size,
                version: s.version,
                name: s.name.to_string(),
                crc: 0,
            };
            let Some(spill) = self.spill.as_mut() else {
                continue;
            };
            if memory.is_some_and(|m| spill.write(header, m)) {
                continue;
            }
            spill.written(s.id.get(), None, false);
            spill.fallback(s.name.as_str(), "the spill worker is not running");
            if let SpillEnd::Evicted(f) = self.table.end_spill(s.id, false) {
                evicted.push(f);
            }
        }
        let any = !evicted.is_empty();
        self.free(evicted).await;
        any
    }

    /// The store's memory of `len` bytes at `block`, for the IO worker.
    async fn memory_of(&mut self, block: &Block, len: u64) -> Option<Memory> {
        let Location::Host { segment, offset } = block.location() else {
            return None;
        };
        let seg = self.segment_of(segment).await?;
        let ptr = seg.ptr(offset, len)?;
        Some(Memory {
            owner: seg,
            ptr,
            len: usize::try_from(len).ok()?,
        })
    }

    /// Parks a request until spills in flight land.
    pub(super) fn wait_for_room(&mut self, waiter: RoomWaiter) {
        self.room_waiters.push_back(waiter);
    }

    /// A delegated reply: `outcome` now, or (`None`) the request `m` parked with its sender
    /// (`park` says as what) until spills in flight land.
    pub(super) fn reply_or_park<M, T>(
        &mut self,
        ctx: &mut Context<Self, DelegatedReply<T>>,
        m: M,
        outcome: Option<T>,
        park: fn(M, Option<ReplySender<T>>) -> RoomWaiter,
    ) -> DelegatedReply<T>
    where
        T: kameo::Reply<Value = T>,
    {
        match outcome {
            Some(r) => ctx.reply(r),
            None => {
                let (delegated, tx) = ctx.reply_sender();
                self.wait_for_room(park(m, tx));
                delegated
            }
        }
    }

    /// Drops the requests of a holder that went away (their senders are gone with it).
    pub(super) fn forget_room_waiters(&mut self, holder: HolderId) {
        self.room_waiters.retain(|w| w.holder() != Some(holder));
    }

    /// Asks every parked request again, in order (memory was freed).
    async fn retry_room_waiters(&mut self, me: &ActorRef<Self>) {
        let waiters = std::mem::take(&mut self.room_waiters);
        self.claimed = 0;
        for w in waiters {
            match w {
                RoomWaiter::Create(m, tx) => match self.try_create(&m).await {
                    Some(r) => answer(tx, r),
                    None => self.wait_for_room(RoomWaiter::Create(m, tx)),
                },
                RoomWaiter::PutInline(m, tx) => match self.try_put_inline(&m, me).await {
                    Some(r) => answer(tx, r),
                    None => self.wait_for_room(RoomWaiter::PutInline(m, tx)),
                },
                RoomWaiter::TakeLend(m, tx) => match self.try_take_lend(&m).await {
                    Some(r) => answer(tx, r),
                    None => self.wait_for_room(RoomWaiter::TakeLend(m, tx)),
                },
                RoomWaiter::Restore(id) => {
                    self.restores_queued.remove(&id);
                    self.restore(id).await;
                }
            }
        }
    }

    /// Starts the restores gets asked for (each once, however many gets wait for it).
    pub(super) async fn start_restores(&mut self, ids: Vec<ObjectId>) {
        for id in ids {
            if !self.restores_queued.contains(&id) {
                self.restore(id).await;
            }
        }
    }

    /// Brings the spilled object `id` back: a block (spilling others if need be, waiting for
    /// room like a create), its metadata written, then the read.
    async fn restore(&mut self, id: ObjectId) {
        let Some((size, metadata)) = self.table.spilled_object(id) else {
            return; // Restoring already, or gone.
        };
        let room = self
            .allocate_room(size, metadata.len(), Device::Cpu, Writer::Store, true)
            .await;
        let block = match room {
            Ok(Room::Ready(block)) => block,
            Ok(Room::Wait) => {
                self.restores_queued.insert(id);
                self.wait_for_room(RoomWaiter::Restore(id));
                return;
            }
            Err(e) => {
                // No room at all: the gets fail; the object stays on disk for a later get.
                let done = self.table.restore_refused(id, e);
                self.deliver(done).await;
                return;
            }
        };
        self.place_metadata(&block, size, &metadata).await;
        let Some(r) = self.table.begin_restore(id, block) else {
            self.free_blocks([block]).await;
            return;
        };
        let memory = self.memory_of(&block, size).await;
        let started = match (self.spill.as_mut(), memory) {
            (Some(spill), Some(m)) => spill.read(id.get(), r.name.as_str(), r.version, m),
            _ => false,
        };
        if !started {
            self.restore_read(id.get(), Err("the spill worker is not running".into()))
                .await;
        }
    }

    /// A spill's write ended.
    async fn spill_written(&mut self, raw: u64, result: Result<u32, String>) {
        let id = ObjectId::from_raw(raw);
        let crc = result.as_ref().ok().copied();
        let doomed = self.doomed.remove(&raw);
        let end = self.table.end_spill(id, crc.is_some());
        let Some(spill) = self.spill.as_mut() else {
            return;
        };
        match end {
            SpillEnd::Spilled(block) => {
                spill.written(raw, crc, false);
                self.free_blocks([block]).await;
            }
            // Used meanwhile: in memory, and its whole file kept for its next turn as a victim.
            SpillEnd::Kept => spill.written(raw, crc, true),
            SpillEnd::Evicted(f) => {
                spill.written(raw, None, false);
                let why = result.err().unwrap_or_default();
                spill.fallback(f.name.as_str(), &format!("writing its file failed: {why}"));
                self.free(vec![f]).await;
            }
            SpillEnd::Gone => {
                spill.written(raw, None, false);
                if crc.is_some() {
                    spill.remove(raw);
                }
            }
        }
        if let Some(block) = doomed {
            self.free_blocks([block]).await;
        }
    }

    /// A restore's read ended.
    async fn restore_read(&mut self, raw: u64, result: Result<(), String>) {
        let id = ObjectId::from_raw(raw);
        if let Some(block) = self.doomed.remove(&raw) {
            // The object went while it was read: its block and file are free now.
            if let Some(spill) = self.spill.as_mut() {
                spill.read_abandoned(raw);
            }
            self.free_blocks([block]).await;
            return;
        }
        if let Some(spill) = self.spill.as_mut() {
            spill.read_done(raw, result.is_ok());
        }
        match self.table.end_restore(id, result) {
            RestoreEnd::Restored(done) => self.deliver(done).await,
            RestoreEnd::Lost(freed, done) => {
                self.free(vec![freed]).await;
                self.deliver(done).await;
            }
            RestoreEnd::Gone => {}
        }
    }

    /// After a write landed (memory was freed): the parked requests' turn.
    pub(super) async fn after_spill_io(&mut self, me: &ActorRef<Self>) {
        if !self.room_waiters.is_empty() {
            self.retry_room_waiters(me).await;
        }
    }
}
