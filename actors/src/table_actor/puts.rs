//! The messages that make objects: CREATE (then the client writes, then SEAL or ABORT), the
//! inline PUT (create, copy and seal in one), LEND and PUBLISH (the client writes into memory
//! lent to it, then one message creates and seals), and the bookkeeping of pipelined puts
//! (sent without waiting for the reply; see [`crate::pipelined`]).
//!
//! What a caller asks of a put travels as the one [`PutOptions`] (the clients' and the
//! engine's spelling, `vovp_types::put`): CREATE reads its `ephemeral`, `device`, `replace`
//! and `version`; PUT and PUBLISH read all but `device` (they make host objects).
//!
//! # A buffer kept after ABORT
//!
//! Over the socket, ABORT frees the object at once, and the creator's next object of that
//! size gets exactly that range back (bin rounding), which a buffer the client kept can still
//! write: the client's own use-after-free, like memory used after `free()`. Isolation bounds
//! it to that client's arena (no other client's object lives there; everyone else maps it
//! read-only); a write after the range was punched also faults a page back in outside the
//! budget, at most the arena's size, charged to the writer. The embedded engine keeps an
//! aborted object's memory until its buffer is dropped. Doing the same over the socket needs a
//! protocol change: ABORT keeping the creator's reference on the block (not the name) until a
//! RELEASE of the object id, which clients would send when the buffer is dropped; today's
//! clients send nothing after ABORT, and a daemon that waited for it would hold the memory
//! until they disconnect.

use std::sync::Arc;

use kameo::actor::ActorRef;
use kameo::message::{Context, Message};
use kameo::reply::DelegatedReply;
use tokio::sync::oneshot;
use vovp_types::{
    check_metadata, Device, Error, HolderId, Lend, ObjectId, ObjectName, ObjectRef, PutOptions,
};

use super::spilling::{Room, RoomWaiter};
use super::ObjectTableActor;
use crate::allocator::{Free, Writer};
use crate::block::Block;
use crate::lend_ledger::LendKind;
use crate::shared_regions::SharedRegions;
use crate::table::NewObject;

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
    /// `ephemeral`, `device` (host memory when `None`) and `replace`; the creator always
    /// keeps its reference until it seals or aborts.
    pub options: PutOptions,
}

impl Message<Create> for ObjectTableActor {
    /// Delegated: a create that waits for spills to free its memory is answered later
    /// (`spilling.rs`), while the actor serves other messages.
    type Reply = DelegatedReply<Result<ObjectRef, Error>>;

    async fn handle(&mut self, m: Create, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let r = self.try_create(&m).await;
        self.schedule_parked_rescan(ctx.actor_ref()).await;
        self.reply_or_park(ctx, m, r, RoomWaiter::Create)
    }
}

impl ObjectTableActor {
    /// What every new object (CREATE, PUT, PUBLISH) must pass before memory is found for it:
    /// metadata within its limit, a name `holder` may take (or replace), and a version above
    /// the name's current one when one is asked for.
    fn check_new(
        &self,
        name: &ObjectName,
        metadata: &[u8],
        options: &PutOptions,
        holder: HolderId,
    ) -> Result<(), Error> {
        check_metadata(metadata)?;
        self.table.check_name_free(name, options.replace, holder)?;
        self.table.check_version(name, options.version)
    }

    /// Memory for a CREATE's or an inline PUT's object ([`Self::allocate_object`], which may
    /// wait); `None` while it waits for spills to land (the caller parks the message).
    async fn room_for_new(
        &mut self,
        size: u64,
        metadata: &[u8],
        device: Device,
        writer: Writer,
    ) -> Option<Result<Block, Error>> {
        match self
            .allocate_object(size, metadata, device, writer, true)
            .await
        {
            Ok(Room::Ready(block)) => Some(Ok(block)),
            Ok(Room::Wait) => None,
            Err(e) => Some(Err(e)),
        }
    }

    /// A create, or `None` when it waits for spills to land (asked again then).
    pub(super) async fn try_create(&mut self, m: &Create) -> Option<Result<ObjectRef, Error>> {
        if let Err(e) = self.check_new(&m.name, &m.metadata, &m.options, m.holder) {
            return Some(Err(e));
        }
        let device = m.options.device.unwrap_or(Device::Cpu);
        let block = match self
            .room_for_new(m.size, &m.metadata, device, m.writer)
            .await?
        {
            Ok(b) => b,
            Err(e) => return Some(Err(e)),
        };
        let name = m.name.clone();
        Some(
            self.insert_or_free(
                name,
                m.size,
                m.metadata.clone(),
                block,
                &m.options,
                m.holder,
            )
            .await,
        )
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
        self.notify_subscribers();
        self.schedule_parked_rescan(ctx.actor_ref()).await;
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
    /// `keep_reference`: the reply's object id must be released later; `pipelined`: sent
    /// without waiting for the reply, so counted as applied whatever the outcome
    /// ([`crate::pipelined`]); `replace`: becomes the name's next version if it is taken;
    /// `version`: seal as exactly that version ([`PutOptions::version`]).
    pub options: PutOptions,
}

impl Message<PutInline> for ObjectTableActor {
    /// Delegated, as [`Create`]'s.
    type Reply = DelegatedReply<Result<ObjectRef, Error>>;

    async fn handle(&mut self, m: PutInline, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let r = self.try_put_inline(&m, ctx.actor_ref()).await;
        self.reply_or_park(ctx, m, r, RoomWaiter::PutInline)
    }
}

impl ObjectTableActor {
    /// An inline put, counted applied if it was pipelined, or `None` when it waits for spills
    /// to land (it is counted when it ends).
    pub(super) async fn try_put_inline(
        &mut self,
        m: &PutInline,
        me: &ActorRef<Self>,
    ) -> Option<Result<ObjectRef, Error>> {
        let r = self.put_inline(m, me).await?;
        self.count_if_pipelined(m.holder, &m.options);
        Some(r)
    }

    async fn put_inline(
        &mut self,
        m: &PutInline,
        me: &ActorRef<Self>,
    ) -> Option<Result<ObjectRef, Error>> {
        if let Err(e) = self.check_new(&m.name, &m.metadata, &m.options, m.holder) {
            return Some(Err(e));
        }
        let size = m.data.len() as u64;
        // The store copies inline payloads in itself: segment 0, which no client can write.
        match self
            .room_for_new(size, &m.metadata, Device::Cpu, Writer::Store)
            .await?
        {
            Ok(block) => Some(self.fill_inline(m, block, me).await),
            Err(e) => Some(Err(e)),
        }
    }

    /// The rest of an inline put once it has its block: insert, copy, seal.
    async fn fill_inline(
        &mut self,
        m: &PutInline,
        block: Block,
        me: &ActorRef<Self>,
    ) -> Result<ObjectRef, Error> {
        let size = m.data.len() as u64;
        let mut r = self
            .insert_or_free(
                m.name.clone(),
                size,
                m.metadata.clone(),
                block,
                &m.options,
                m.holder,
            )
            .await?;
        match self.host_slice(&r) {
            Some(dst) => vovp_shm::copy::parallel_copy(dst, &m.data),
            None => {
                let f = self.table.abort(&m.name, m.holder, false)?;
                self.free(f.into_iter().collect()).await;
                return Err(Error::Memory("allocation outside its segment".into()));
            }
        }
        self.seal_put(&mut r, m.holder, m.options.keep_reference, me)
            .await?;
        Ok(r)
    }

    /// Inserts the new unsealed object `name` of `size` bytes in `block` (created by `holder`
    /// with `options`); the block is freed if the table refuses it.
    async fn insert_or_free(
        &mut self,
        name: ObjectName,
        size: u64,
        metadata: Arc<[u8]>,
        block: Block,
        options: &PutOptions,
        holder: HolderId,
    ) -> Result<ObjectRef, Error> {
        let inserted = self.table.insert(NewObject {
            name,
            size,
            metadata,
            block,
            ephemeral: options.ephemeral,
            replace: options.replace,
            creator: holder,
            version: options.version,
        });
        if inserted.is_err() {
            self.free_blocks([block]).await;
        }
        inserted
    }

    /// A put of `holder` sent without waiting for its reply (`options.pipelined`) is done,
    /// whatever its outcome: counted applied for the misses waiting on it.
    fn count_if_pipelined(&mut self, holder: HolderId, options: &PutOptions) {
        if options.pipelined {
            self.pipelined.applied_one(holder);
        }
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
        let sent = self
            .table
            .shared_regions()
            .map(SharedRegions::puts_sent)
            .unwrap_or_default();
        self.pipelined.barrier(m.holder, sent)
    }
}

/// Lend `holder` a part of its own arena (its previous lend takes no new object).
#[derive(Debug)]
pub struct TakeLend {
    pub holder: HolderId,
    /// The block the client wants to write next (data padded to 64 bytes, then metadata).
    pub at_least: u64,
    /// The store's lend size ([`vovp_types::lends::lend_size`]), or the small lend's.
    pub size: u64,
    /// The small-object lend (LEND_SMALL): the holder's second lend, never taken back.
    pub small: bool,
}

impl Message<TakeLend> for ObjectTableActor {
    /// Delegated, as [`Create`]'s.
    type Reply = DelegatedReply<Result<Lend, Error>>;

    async fn handle(&mut self, m: TakeLend, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let r = self.try_take_lend(&m).await;
        self.reply_or_park(ctx, m, r, RoomWaiter::TakeLend)
    }
}

impl ObjectTableActor {
    /// A lend, or `None` when it waits for spills to land (asked again then).
    pub(super) async fn try_take_lend(&mut self, m: &TakeLend) -> Option<Result<Lend, Error>> {
        let max = vovp_types::lends::max_object(m.size);
        if m.at_least > max {
            return Some(Err(Error::TooLarge(format!(
                "a lend is for objects of up to {max} bytes, not {}: use CREATE",
                m.at_least
            ))));
        }
        // A lend is taken back through the client's hold table (when the store is short of
        // memory), so a client without one, or one that does not count its puts there, gets
        // none.
        let takes_part = self
            .table
            .shared_regions()
            .is_some_and(|r| r.takes_part_in_lends(m.holder));
        if !takes_part {
            return Some(Err(Error::Config(
                "lends need this connection's hold table, mapped and taking part in the lend \
                 handshake (SHARED; not with --no-shared-reads): use CREATE"
                    .into(),
            )));
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
            if let Some(regions) = self.table.shared_regions() {
                regions.clear_lend_revocation(m.holder);
            }
        }
        if let Some(again) = self
            .lends
            .reuse_empty(m.holder, kind)
            .filter(|l| l.size == m.size)
        {
            return Some(Ok(again));
        }
        // Retired first, so that an emptied lend's memory can serve the new one.
        if let Some(old) = self.lends.retire(m.holder, kind) {
            let _ = self.allocator.tell(Free(vec![old])).await;
        }
        let room = self
            .allocate_room(m.size, 0, Device::Cpu, Writer::Client(m.holder), true)
            .await;
        Some(match room {
            Ok(Room::Ready(Block::Host(h))) => Ok(self.lends.insert(m.holder, kind, h)),
            Ok(Room::Ready(other)) => {
                self.free_blocks([other]).await;
                Err(Error::Internal("a lend outside host memory".into()))
            }
            Ok(Room::Wait) => return None,
            Err(e) => Err(e),
        })
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
    /// As [`PutInline::options`].
    pub options: PutOptions,
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
        let (holder, options) = (m.holder, m.options);
        let r = self.publish_lent(m, me).await;
        self.count_if_pipelined(holder, &options);
        r
    }

    async fn publish_lent(&mut self, m: Publish, me: &ActorRef<Self>) -> Result<ObjectRef, Error> {
        self.check_new(&m.name, &m.metadata, &m.options, m.holder)?;
        let lent = self
            .lends
            .claim(m.holder, m.lend, m.offset, m.size, m.metadata.len() as u64)?;
        let block = Block::Lent(lent);
        self.place_metadata(&block, m.size, &m.metadata).await;
        let mut r = self
            .insert_or_free(m.name, m.size, m.metadata, block, &m.options, m.holder)
            .await?;
        self.seal_put(&mut r, m.holder, m.options.keep_reference, me)
            .await?;
        Ok(r)
    }
}
