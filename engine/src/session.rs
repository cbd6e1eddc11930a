//! [`Session`]: one holder of references and every store operation made as that holder. The
//! one way into the engine's actors: the embedded [`EngineHandle`](crate::EngineHandle) builds
//! its views on a session, and each daemon connection is a [`client
//! session`](crate::EngineHandle::client_session). The actors' messages stay behind it, so the
//! life-cycle rules are written once, in the object table, whoever the caller is.

use std::sync::Arc;
use std::time::Duration;
use vovp_actors::Answer;

use tokio::sync::mpsc;
use vovp_actors::table_actor as msg;
use vovp_actors::Segment;
use vovp_actors::SharedFds;
use vovp_actors::{SegmentFor, SegmentGrant, Writer};
use vovp_types::{
    CreateOptions, HolderId, Lend, Location, Notification, ObjectId, ObjectInfo, ObjectName,
    ObjectRef, PutOptions, StoreMetrics, StoreStats,
};

use crate::core::{block_on, Core};
use crate::{Config, Error, MAX_INLINE_PUT};
use vovp_types::{Mapped, ObjectSink};

/// Notifications of one [`Session::subscribe`], in order. The engine drops a subscriber that
/// falls 4096 notifications behind (the receiver then reports closed). (Not the clients'
/// `vovp_client::Subscription`, a connection of its own that reads them from a socket.)
pub type Notifications = mpsc::Receiver<Notification>;

/// Who writes a session's objects, which decides where they go and what an abort frees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// The engine's own process writes through its mapping of segment 0; a buffer of an
    /// aborted object may still be alive, so its memory goes with the creator's reference.
    Embedded,
    /// A client in another process writes through its own arena (only it maps it
    /// read-write); an abort frees the memory at once, as PROTOCOL.md says.
    Client,
}

/// One holder of references. Cheap to clone; clones are the same holder. When the last clone
/// and the last view made through it are gone, everything it still held is released (unsealed
/// objects it created are aborted), as [`Session::release_all`] does.
#[derive(Clone)]
pub struct Session {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("holder", &self.inner.holder)
            .finish_non_exhaustive()
    }
}

struct Inner {
    core: Arc<Core>,
    holder: HolderId,
    kind: Kind,
    /// This session's mapping of the shared directory and of its hold table, made on its
    /// first get (`None` inside: the store does not publish, or mapping failed).
    shared: std::sync::OnceLock<Option<Arc<vovp_shm::SharedReader>>>,
}

/// The object of a [`Session::publish`] (or one of a [`Session::publish_many`]): the `size`
/// bytes written at `offset` of the lend, to become `name` (the metadata goes after the data
/// padded to 64 bytes, written by the store).
#[derive(Clone, Copy, Debug)]
pub struct LentObject<'a> {
    pub offset: u64,
    pub name: &'a str,
    pub size: u64,
    pub metadata: &'a [u8],
    pub options: PutOptions,
}

/// How long a "missing" answer waits for other clients' pipelined puts sent before the
/// question (vovp-shm's `sent`), per round. A bound, not a delay: the wait ends as soon as
/// they are applied. A round that runs out while the store applied pipelined puts (a store
/// busy or stalled, not a client that counts puts it never sends) is followed by another, up
/// to [`SENT_PUTS_ROUNDS`].
const SENT_PUTS_WAIT: Duration = Duration::from_millis(200);
const SENT_PUTS_ROUNDS: u32 = 5;

fn object_name(name: &str) -> Result<ObjectName, Error> {
    ObjectName::new(name)
}

impl Session {
    pub(crate) fn embedded(core: Arc<Core>) -> Self {
        Self::new(core, Kind::Embedded)
    }

    pub(crate) fn client(core: Arc<Core>) -> Self {
        Self::new(core, Kind::Client)
    }

    fn new(core: Arc<Core>, kind: Kind) -> Self {
        let holder = core.new_holder();
        Session {
            inner: Arc::new(Inner {
                core,
                holder,
                kind,
                shared: std::sync::OnceLock::new(),
            }),
        }
    }

    pub(crate) fn core(&self) -> &Arc<Core> {
        &self.inner.core
    }

    /// What views made through this session release and seal with.
    pub(crate) fn sink(&self) -> Arc<dyn ObjectSink> {
        self.inner.clone()
    }

    /// What keeps this session alive for a view got through its hold table.
    pub(crate) fn holder_alive(&self) -> vovp_shm::held::Holder {
        self.inner.clone()
    }

    /// This session's holder id (for logs; the table keys every reference by it).
    pub fn holder(&self) -> HolderId {
        self.inner.holder
    }

    pub fn config(&self) -> &Config {
        &self.inner.core.config
    }

    /// The store's own segments: segment 0 (inline puts, embedded objects), which every client
    /// maps read-only. Clients' arenas are reached through [`Session::segment`].
    pub fn segments(&self) -> &Arc<[Arc<Segment>]> {
        &self.inner.core.segments
    }

    /// Creates an unsealed object of `size` bytes; this session holds one reference and is the
    /// only one that may seal or abort it.
    pub async fn create(
        &self,
        name: &str,
        size: u64,
        metadata: &[u8],
        options: CreateOptions,
    ) -> Result<ObjectRef, Error> {
        let writer = match self.inner.kind {
            Kind::Embedded => Writer::Store,
            Kind::Client => Writer::Client(self.inner.holder),
        };
        self.table()
            .ask(msg::Create {
                writer,
                holder: self.inner.holder,
                name: object_name(name)?,
                size,
                metadata: Arc::from(metadata),
                options,
            })
            .await
            .answer()
    }

    /// Seals `name` (created by this session): immutable and visible from now on. Returns
    /// the name's version it became (a replacement takes the name over at this point).
    pub async fn seal(&self, name: &str) -> Result<u64, Error> {
        self.seal_inner(object_name(name)?, None).await
    }

    /// Seals the object `obj` refers to: that incarnation only, so a reference that outlived
    /// its aborted object cannot seal a newer object of the same name ([`Error::NotFound`]).
    pub async fn seal_object(&self, obj: &ObjectRef) -> Result<u64, Error> {
        self.seal_inner(obj.name.clone(), Some(obj.id)).await
    }

    async fn seal_inner(&self, name: ObjectName, id: Option<ObjectId>) -> Result<u64, Error> {
        self.table()
            .ask(msg::Seal {
                holder: self.inner.holder,
                name,
                id,
            })
            .await
            .answer()
    }

    /// Aborts an unsealed object this session created: its name is free at once.
    pub async fn abort(&self, name: &str) -> Result<(), Error> {
        self.table()
            .ask(msg::Abort {
                holder: self.inner.holder,
                name: object_name(name)?,
                keep_while_held: self.inner.kind == Kind::Embedded,
            })
            .await
            .answer()
    }

    /// Creates, copies and seals a host object in one message (the engine copies `data` into
    /// its own segment): at most [`MAX_INLINE_PUT`] bytes, else [`Error::TooLarge`].
    pub async fn put_inline(
        &self,
        name: &str,
        data: Vec<u8>,
        metadata: &[u8],
        options: PutOptions,
    ) -> Result<ObjectRef, Error> {
        let checked = if data.len() > MAX_INLINE_PUT {
            Err(Error::TooLarge(format!(
                "inline PUT of {} bytes; the limit is {MAX_INLINE_PUT}: use CREATE and SEAL",
                data.len()
            )))
        } else {
            object_name(name)
        };
        let name = match checked {
            Ok(name) => name,
            Err(e) => return Err(self.refused_before_the_table(options, e).await),
        };
        self.table()
            .ask(msg::PutInline {
                holder: self.inner.holder,
                name,
                data,
                metadata: Arc::from(metadata),
                options,
            })
            .await
            .answer()
    }

    /// A put refused before the table saw it: `e`, and if it was pipelined it still counts as
    /// applied, for the misses waiting on it (else they would wait for it in vain).
    async fn refused_before_the_table(&self, options: PutOptions, e: Error) -> Error {
        if options.pipelined {
            let told = self
                .table()
                .tell(msg::PipelinedPutRefused {
                    holder: self.inner.holder,
                })
                .await
                .answer();
            if let Err(dead) = told {
                return dead;
            }
        }
        e
    }

    /// The count of pipelined puts applied, read before a question that may answer
    /// "missing" ([`Session::settle_sent_puts`]).
    fn applied_puts(&self) -> u64 {
        self.inner
            .core
            .pipelined_puts_applied
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// After a question answered "missing": waits (up to [`SENT_PUTS_WAIT`]) for the
    /// pipelined puts other clients sent before it (vovp-shm's `sent`). `true`: ask again,
    /// because it waited or because some pipelined put was applied since `applied_before`
    /// (read before the question: that put may be the one it missed).
    async fn settle_sent_puts(&self, applied_before: u64) -> Result<bool, Error> {
        let pending = self
            .table()
            .ask(msg::AwaitSentPuts {
                holder: self.inner.holder,
            })
            .await
            .answer()?;
        match pending {
            None => Ok(self.applied_puts() != applied_before),
            Some(mut applied) => {
                for _ in 0..SENT_PUTS_ROUNDS {
                    let before = self.applied_puts();
                    match tokio::time::timeout(SENT_PUTS_WAIT, &mut applied).await {
                        Err(_) if self.applied_puts() != before => continue,
                        _ => break,
                    }
                }
                Ok(true)
            }
        }
    }

    /// Lends this session a part of its own arena to write objects into itself, each made a
    /// sealed object by one [`Session::publish`]; its previous lend of the same kind takes no
    /// new object. `at_least`: the block it wants to write next (data padded to 64 bytes, then
    /// metadata). `small`: the small-object lend ([`vovp_types::lends::SMALL_LEND_SIZE`],
    /// never taken back), apart from the big one. Only for clients in other processes, and
    /// only by a store of 64 MiB or more with client arenas (not `--prefault`): otherwise
    /// [`Error::Config`], and the client creates instead.
    pub async fn lend(&self, at_least: u64, small: bool) -> Result<Lend, Error> {
        let config = &self.inner.core.config;
        let size = match (self.inner.kind, config.client_arenas && !config.prefault) {
            (Kind::Client, true) => vovp_types::lends::lend_size(config.capacity),
            _ => None,
        }
        .map(|big| {
            if small {
                vovp_types::lends::SMALL_LEND_SIZE
            } else {
                big
            }
        })
        .ok_or_else(|| {
            Error::Config(
                "this store lends no arena (embedded, --prefault, or under 64 MiB): use CREATE"
                    .into(),
            )
        })?;
        self.table()
            .ask(msg::TakeLend {
                holder: self.inner.holder,
                at_least,
                size,
                small,
            })
            .await
            .answer()
    }

    /// Makes the `object.size` bytes this session wrote at `object.offset` of its lend `lend`
    /// a sealed object named `object.name` (the metadata goes after the data padded to 64
    /// bytes, which the store writes). The range must lie in the lend and overlap no live
    /// object published from it ([`Error::Protocol`] otherwise).
    pub async fn publish(&self, lend: u64, object: &LentObject<'_>) -> Result<ObjectRef, Error> {
        match self.publish_message(lend, object) {
            Ok(publish) => self.table().ask(publish).await.answer(),
            Err(refused) => {
                let error = refused.error;
                Err(self.refused_before_the_table(object.options, error).await)
            }
        }
    }

    /// The table's message publishing `o` from lend `lend`, or why the session refuses it
    /// before the table (a bad name).
    fn publish_message(
        &self,
        lend: u64,
        o: &LentObject<'_>,
    ) -> Result<msg::Publish, msg::RefusedPublish> {
        let name = object_name(o.name).map_err(|error| msg::RefusedPublish {
            error,
            pipelined: o.options.pipelined,
        })?;
        Ok(msg::Publish {
            holder: self.inner.holder,
            lend,
            offset: o.offset,
            name,
            size: o.size,
            metadata: Arc::from(o.metadata),
            options: o.options,
        })
    }

    /// [`Session::publish`] of several objects from lend `lend` in one message to the table,
    /// in order: one result each (one failing fails no other). `Err` only when the store is
    /// stopping.
    pub async fn publish_many(
        &self,
        lend: u64,
        objects: &[LentObject<'_>],
    ) -> Result<Vec<Result<ObjectRef, Error>>, Error> {
        let holder = self.inner.holder;
        let items = objects
            .iter()
            .map(|o| self.publish_message(lend, o))
            .collect();
        self.table()
            .ask(msg::PublishMany { holder, items })
            .await
            .answer()
    }

    /// One reference per name that is sealed, in request order (`None`: not sealed in time).
    /// `wait`: `None` or zero answers at once; `Some(d)` waits up to `d` (`Duration::MAX`:
    /// forever) for names that are missing or unsealed. [`Session::release_all`] ends a wait
    /// with [`Error::ShuttingDown`].
    pub async fn get<S: AsRef<str> + Sync>(
        &self,
        names: &[S],
        wait: Option<Duration>,
    ) -> Result<Vec<Option<ObjectRef>>, Error> {
        self.get_newer(names, &[], wait).await
    }

    /// As [`Session::get`], but `names[i]` is found only as a version above `newer_than[i]`
    /// (0, or past the end of `newer_than`: any version), and a wait lasts until such a
    /// version is sealed: how a reader waits for the next version of a name it holds.
    pub async fn get_newer<S: AsRef<str> + Sync>(
        &self,
        names: &[S],
        newer_than: &[u64],
        wait: Option<Duration>,
    ) -> Result<Vec<Option<ObjectRef>>, Error> {
        let names = names
            .iter()
            .map(|n| object_name(n.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        let mut newer_than = newer_than.to_vec();
        newer_than.resize(names.len(), 0);
        let applied_before = self.applied_puts();
        let mut got = self
            .get_names(names.clone(), newer_than.clone(), wait)
            .await?;
        // Something missing (at once, or when the wait ran out): maybe a pipelined put of
        // another client is still on its way (vovp-shm's `sent`); once it is applied, ask
        // again for what was missing.
        if got.iter().any(Option::is_none) && self.settle_sent_puts(applied_before).await? {
            let missing: Vec<usize> = (0..got.len()).filter(|&i| got[i].is_none()).collect();
            let again = missing.iter().map(|&i| names[i].clone()).collect();
            let versions = missing.iter().map(|&i| newer_than[i]).collect();
            let found = self.get_names(again, versions, None).await?;
            for (i, r) in missing.into_iter().zip(found) {
                got[i] = r;
            }
        }
        Ok(got)
    }

    /// `ask`, and once more if its answer is `missing` and other clients' pipelined puts sent
    /// before it may have changed that ([`Session::settle_sent_puts`]).
    async fn again_if_missing<T, F, Fut>(
        &self,
        ask: F,
        missing: impl Fn(&Result<T, Error>) -> bool,
    ) -> Result<T, Error>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<T, Error>>,
    {
        let applied_before = self.applied_puts();
        let answer = ask().await;
        if missing(&answer) && self.settle_sent_puts(applied_before).await? {
            return ask().await;
        }
        answer
    }

    async fn get_names(
        &self,
        names: Vec<ObjectName>,
        newer_than: Vec<u64>,
        wait: Option<Duration>,
    ) -> Result<Vec<Option<ObjectRef>>, Error> {
        let rx = self
            .table()
            .ask(msg::Get {
                holder: self.inner.holder,
                names,
                newer_than,
                wait,
            })
            .await
            .answer()?;
        rx.await.map_err(|_| Error::ShuttingDown)?
    }

    /// Drops one reference per id; every id is processed, the first failure is returned.
    pub async fn release(&self, ids: Vec<ObjectId>) -> Result<(), Error> {
        match self
            .table()
            .ask(msg::Release {
                holder: self.inner.holder,
                ids,
            })
            .await
            .answer()?
        {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Drops one reference per id without waiting (and without reporting errors). Never
    /// blocks: the table's mailbox is unbounded. Still ordered before this session's next
    /// request (one FIFO mailbox).
    pub fn release_later(&self, ids: Vec<ObjectId>) {
        self.inner.release_later(ids)
    }

    /// Releases everything this session holds now: references dropped, unsealed objects it
    /// created aborted, its waiting gets ended. Never blocks; the session stays usable.
    pub fn release_all(&self) {
        self.inner.release_all()
    }

    /// Is `name` present and sealed?
    pub async fn contains(&self, name: &str) -> Result<bool, Error> {
        let name = object_name(name)?;
        let ask = || async {
            self.table()
                .ask(msg::Contains { name: name.clone() })
                .await
                .answer()
        };
        self.again_if_missing(ask, |found| matches!(found, Ok(false)))
            .await
    }

    /// Deletes a sealed object: the name is free at once, the memory goes with its last holder.
    pub async fn delete(&self, name: &str) -> Result<(), Error> {
        let name = object_name(name)?;
        let ask = || async {
            self.table()
                .ask(msg::Delete { name: name.clone() })
                .await
                .answer()
        };
        self.again_if_missing(ask, |r| matches!(r, Err(Error::NotFound(_))))
            .await
    }

    /// Every named object, sorted by name.
    pub async fn list(&self) -> Result<Vec<ObjectInfo>, Error> {
        self.table().ask(msg::List).await.answer()
    }

    /// One page of named objects from cursor `start` (0 for the first): at most `limit`
    /// entries and, after the first, at most `max_bytes` counted by `entry_bytes`. Returns the
    /// page and the next cursor (`None` after the last page). Every object present throughout
    /// is listed exactly once; the cost is the page's, not the table's.
    pub async fn list_page(
        &self,
        start: u64,
        limit: usize,
        max_bytes: usize,
        entry_bytes: fn(&ObjectInfo) -> usize,
    ) -> Result<(Vec<ObjectInfo>, Option<u64>), Error> {
        self.table()
            .ask(msg::ListPage {
                start,
                limit,
                max_bytes,
                entry_bytes,
            })
            .await
            .answer()
    }

    /// Evicts at least `bytes` of unreferenced sealed host objects, least recently used
    /// first; returns the bytes freed.
    pub async fn evict(&self, bytes: u64) -> Result<u64, Error> {
        self.table().ask(msg::Evict { bytes }).await.answer()
    }

    pub async fn stats(&self) -> Result<StoreStats, Error> {
        self.table().ask(msg::Stats).await.answer()
    }

    /// What the daemon's metrics report of the store, in one message: STATS, resident bytes,
    /// live lends, what the store did ever (seals, gets by message and through the shared
    /// directory, deletes, replaces, lends, publishes) and every holder's references and bytes.
    pub async fn metrics(&self) -> Result<StoreMetrics, Error> {
        self.table().ask(msg::Metrics).await.answer()
    }

    /// Seal, delete and evict notifications from now on.
    pub async fn subscribe(&self) -> Result<Notifications, Error> {
        self.table().ask(msg::Subscribe).await.answer()
    }

    /// A segment for this session to map: read-write for the session whose arena it is,
    /// read-only for every other. [`Error::NotFound`] once it is gone (its objects are).
    pub async fn segment(&self, id: u32) -> Result<SegmentGrant, Error> {
        self.inner
            .core
            .actors
            .allocator
            .ask(SegmentFor {
                id,
                holder: self.inner.holder,
            })
            .await
            .map_err(|_| Error::ShuttingDown)?
            .ok_or_else(|| Error::NotFound(format!("segment {id} (its objects are gone)")))
    }

    /// This session's hold table and the shared directory, for a client to map (`None`: the
    /// store does not publish; every get is then a message). Asking again gives the same table.
    pub async fn attach_shared(&self) -> Result<Option<SharedFds>, Error> {
        self.table()
            .ask(msg::AttachShared {
                holder: self.inner.holder,
            })
            .await
            .answer()
    }

    /// The session's reader if it is mapped already (no wait).
    pub(crate) fn shared_reader_now(&self) -> Option<Arc<vovp_shm::SharedReader>> {
        self.inner.shared.get().cloned().flatten()
    }

    /// This session's reader of the shared directory (its own hold table), mapped on first
    /// use; `None` when the store does not publish.
    pub(crate) async fn shared_reader(&self) -> Option<Arc<vovp_shm::SharedReader>> {
        if let Some(r) = self.inner.shared.get() {
            return r.clone();
        }
        let reader = match self.attach_shared().await {
            Ok(Some(fds)) => match vovp_shm::SharedReader::open(&fds.directory, &fds.holds) {
                Ok(r) => Some(Arc::new(r)),
                Err(e) => {
                    tracing::warn!("not using the shared directory: {e}");
                    None
                }
            },
            Ok(None) => None,
            // The engine is stopping: this get fails over the actor path anyway.
            Err(_) => return None,
        };
        self.inner.shared.get_or_init(|| reader).clone()
    }

    /// Checks the object table's internal invariants (tests).
    pub async fn check_invariants(&self) -> Result<(), Error> {
        self.table()
            .ask(msg::CheckInvariants)
            .await
            .map_err(|e| Error::Internal(format!("{e:?}")))
    }

    /// Where `r`'s bytes are in this process (the engine's own mappings).
    pub(crate) async fn mapped(&self, r: &ObjectRef) -> Result<Mapped, Error> {
        let core = &self.inner.core;
        match r.location {
            Location::Host { segment, offset } => {
                let seg = core
                    .segments
                    .get(segment as usize)
                    .ok_or_else(|| Error::Internal(format!("no segment {segment}")))?;
                let ptr = seg
                    .ptr(offset, r.size)
                    .ok_or_else(|| Error::Internal("object outside its segment".into()))?;
                Ok(Mapped::host(ptr, r.size, seg.clone()))
            }
            // In the process that owns the pool the device pointer is direct (a process cannot
            // open its own IPC handle); the GPU actor knows it.
            Location::Cuda(block) => {
                let device_ptr = core
                    .actors
                    .gpu
                    .ask(vovp_actors::gpu::BlockPtr(block))
                    .await
                    .answer()?;
                Ok(Mapped::device(device_ptr, Arc::new(())))
            }
        }
    }

    fn table(&self) -> &kameo::actor::ActorRef<msg::ObjectTableActor> {
        &self.inner.core.actors.table
    }
}

impl Inner {
    fn release_later(&self, ids: Vec<ObjectId>) {
        // Unbounded mailbox: never blocks, fails only when the engine is gone (then all is freed).
        let _ = self
            .core
            .actors
            .table
            .tell(msg::Release {
                holder: self.holder,
                ids,
            })
            .try_send();
    }

    fn release_all(&self) {
        let _ = self
            .core
            .actors
            .table
            .tell(msg::ReleaseHolder {
                holder: self.holder,
            })
            .try_send();
    }
}

impl ObjectSink for Inner {
    fn release(&self, id: ObjectId) {
        self.release_later(vec![id]);
    }

    fn seal(&self, obj: &ObjectRef) -> Result<u64, Error> {
        block_on(
            self.core
                .actors
                .table
                .ask(msg::Seal {
                    holder: self.holder,
                    name: obj.name.clone(),
                    // This buffer's object, not whatever now has its name.
                    id: Some(obj.id),
                })
                .send(),
        )
        .answer()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.release_all();
    }
}
