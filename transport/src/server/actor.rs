//! The per-connection actor: each request of one client, in order, as a call on that client's
//! engine `Session`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kameo::message::{Context, Message};
use kameo::Actor;
use vovp::{LentObject, ObjectId, PutOptions, Session, StoreStats};
use vovp_proto::{
    Failure, Reply, Request, Status, LEND_SMALL, LIST_END, LIST_PAGE_BYTES, MAX_INLINE,
};

use super::Shared;
use crate::response::{error_response, Response};

/// PUT's and PUBLISH's flags and explicit version (host objects).
fn put_options(flags: u32, version: Option<u64>) -> PutOptions {
    PutOptions {
        version,
        ..vovp_proto::put_options(flags, None)
    }
}

/// A PUBLISH's object (or one of a PUBLISH_MANY's) as the session publishes it.
fn lent_object<'r>(
    offset: u64,
    name: &'r str,
    size: u64,
    metadata: &'r [u8],
    flags: u32,
    version: Option<u64>,
) -> LentObject<'r> {
    LentObject {
        offset,
        name,
        size,
        metadata,
        options: put_options(flags, version),
    }
}

/// The per-connection actor: turns this client's requests into calls on the connection's
/// engine [`Session`] (its own reference holder) and tracks the HELLO state. The engine keeps
/// the authoritative record of what each holder holds, so cleanup on disconnect is one call
/// (`Session::release_all`) whatever state the client left things in.
#[derive(Actor)]
pub struct ConnectionActor {
    session: Session,
    shared: Arc<Shared>,
    greeted: bool,
    /// The peer runs as the daemon's uid.
    own_uid: bool,
}

impl std::fmt::Debug for ConnectionActor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectionActor")
            .field("session", &self.session)
            .field("greeted", &self.greeted)
            .field("own_uid", &self.own_uid)
            .finish_non_exhaustive()
    }
}

/// A decoded request from the socket.
#[derive(Debug)]
pub struct Incoming {
    pub request: Request<'static>,
    pub no_reply: bool,
}

/// The client went away.
#[derive(Debug)]
pub struct Disconnect;

/// The segments whose fds a HELLO reply carries.
#[derive(Debug)]
pub struct SegmentFds;

/// GET's `timeout_ms`: negative waits for ever, 0 answers at once.
fn get_wait(timeout_ms: i64) -> Option<Duration> {
    match u64::try_from(timeout_ms) {
        Err(_) => Some(Duration::MAX),
        Ok(0) => None,
        Ok(ms) => Some(Duration::from_millis(ms)),
    }
}

/// The ids of a RELEASE as the client sent them (the table checks each against its object).
fn object_ids(ids: &[u64]) -> Vec<ObjectId> {
    ids.iter().copied().map(ObjectId::from_raw).collect()
}

impl ConnectionActor {
    /// The actor of a new connection: `session` is its holder; `own_uid`, whether the peer
    /// runs as the daemon's uid.
    pub(super) fn new(session: Session, shared: Arc<Shared>, own_uid: bool) -> Self {
        ConnectionActor {
            session,
            shared,
            greeted: false,
            own_uid,
        }
    }

    /// HELLO: once per connection; the reply names the store's own segment (arenas are mapped
    /// on demand, through SEGMENT).
    fn hello(&mut self, pid: u32) -> Response {
        if self.greeted {
            return Response::error(Status::ProtocolState, "HELLO was already sent");
        }
        self.greeted = true;
        let session = &self.session;
        tracing::debug!("client pid {pid} connected as holder {}", session.holder());
        Reply::Hello {
            capacity: session.config().capacity,
            max_inline: MAX_INLINE,
            segments: session
                .segments()
                .iter()
                .take(1)
                .map(|s| (s.id(), s.len()))
                .collect(),
        }
        .into()
    }

    async fn dispatch(
        &mut self,
        request: Request<'static>,
        no_reply: bool,
    ) -> Result<Response, vovp::Error> {
        let session = &self.session;
        if !self.greeted && !matches!(request, Request::Hello { .. }) {
            return Ok(Response::error(Status::ProtocolState, "send HELLO first"));
        }
        Ok(match request {
            Request::Hello { pid } => self.hello(pid),
            Request::Create {
                name,
                size,
                flags,
                version,
                device,
                metadata,
            } => {
                let options = PutOptions {
                    version,
                    ..vovp_proto::create_options(flags, device)
                };
                Reply::Object(session.create(&name, size, &metadata, options).await?).into()
            }
            Request::Seal { name } => Reply::Version(session.seal(&name).await?).into(),
            Request::Abort { name } => {
                session.abort(&name).await?;
                Reply::Empty.into()
            }
            Request::Put {
                name,
                flags,
                version,
                metadata,
                data,
            } => {
                let options = put_options(flags, version);
                Reply::Object(
                    session
                        .put_inline(&name, data.into_owned(), &metadata, options)
                        .await?,
                )
                .into()
            }
            Request::Lend { at_least, flags } => {
                Reply::Lent(session.lend(at_least, flags & LEND_SMALL != 0).await?).into()
            }
            Request::Publish {
                lend,
                offset,
                name,
                flags,
                version,
                metadata,
                size,
            } => {
                let object = lent_object(offset, &name, size, &metadata, flags, version);
                Reply::Object(session.publish(lend, &object).await?).into()
            }
            Request::PublishMany { lend, items } => {
                let objects: Vec<LentObject<'_>> = items
                    .iter()
                    .map(|i| {
                        lent_object(i.offset, &i.name, i.size, &i.metadata, i.flags, i.version)
                    })
                    .collect();
                let results = session.publish_many(lend, &objects).await?;
                Reply::Published(
                    results
                        .into_iter()
                        .map(|r| r.map_err(|e| Failure::from_error(&e)))
                        .collect(),
                )
                .into()
            }
            Request::Get { timeout_ms, names } => {
                Reply::Objects(session.get(&names, get_wait(timeout_ms)).await?).into()
            }
            Request::GetNewer {
                timeout_ms,
                names,
                newer_than,
            } => Reply::Objects(
                session
                    .get_newer(&names, &newer_than, get_wait(timeout_ms))
                    .await?,
            )
            .into(),
            Request::Release { ids } if no_reply => {
                // Errors of one-way releases are not reported.
                session.release_later(object_ids(&ids));
                Response::NoReply
            }
            Request::Release { ids } => {
                session.release(object_ids(&ids)).await?;
                Reply::Empty.into()
            }
            Request::Contains { name } => Reply::Bool(session.contains(&name).await?).into(),
            Request::Delete { name } => {
                session.delete(&name).await?;
                Reply::Empty.into()
            }
            Request::List { start, limit } => {
                let (entries, next) = session
                    .list_page(
                        start,
                        limit as usize,
                        LIST_PAGE_BYTES,
                        vovp_proto::list_entry_bytes,
                    )
                    .await?;
                Reply::List {
                    entries,
                    next: next.unwrap_or(LIST_END),
                }
                .into()
            }
            Request::Evict { bytes } => Reply::Count(session.evict(bytes).await?).into(),
            Request::Stats { fields } => Reply::Stats {
                stats: StoreStats {
                    half_closed: self.shared.half_closed.load(Ordering::Relaxed),
                    ..session.stats().await?
                },
                connections: self.shared.connections.load(Ordering::Relaxed),
                fields,
            }
            .into(),
            // Encoded here, on the daemon's thread: a METRICS request is as rare as a LIST.
            Request::Metrics => Reply::Metrics(crate::metrics::encode_text(
                super::snapshot(session, &self.shared).await?,
            ))
            .into(),
            Request::TransferInfo => Reply::TransferInfo {
                address: self
                    .transfers()
                    .ok()
                    .and_then(|t| t.address())
                    .map(|a| a.to_string())
                    .unwrap_or_default(),
                counters: self.transfers().map(|t| t.counters()).unwrap_or_default(),
            }
            .into(),
            Request::Fetch(f) => {
                // A version this store has already (fetched before, or put here) needs no
                // transfer.
                let newer_than = f.version.saturating_sub(1);
                let name = f.name.as_ref();
                let here = session.get_newer(&[name], &[newer_than], None).await?;
                if let Some(r) = here.into_iter().flatten().next() {
                    return Ok(Reply::Object(r).into());
                }
                let received = self.transfers()?.fetch(&f).await?;
                // The transfer's session holds the object until this client holds it too.
                let sealed_as = received.version.saturating_sub(1);
                let got = session.get_newer(&[name], &[sealed_as], None).await?;
                drop(received);
                let r = got.into_iter().flatten().next().ok_or_else(|| {
                    vovp::Error::NotFound(format!("{name} (fetched, then deleted at once)"))
                })?;
                Reply::Object(r).into()
            }
            Request::Gather(g) => {
                let received = self.transfers()?.gather(&g).await?;
                let got = session.get(&[g.into.as_ref()], None).await?;
                drop(received);
                let r = got.into_iter().flatten().next().ok_or_else(|| {
                    vovp::Error::NotFound(format!("{} (gathered, then deleted at once)", g.into))
                })?;
                Reply::Object(r).into()
            }
            Request::Subscribe => Response::Subscribed(session.subscribe().await?),
            Request::Shared => Response::Shared(session.attach_shared().await?),
            Request::Segment { id } => {
                let grant = session.segment(id).await?;
                Response::Segment {
                    segment: grant.segment,
                    writable: grant.writable,
                }
            }
        })
    }
}

impl ConnectionActor {
    /// The daemon's transfers, if it takes part in them (a key was given).
    fn transfers(&self) -> Result<&crate::transfer::TransferService, vovp::Error> {
        self.shared.transfer.as_deref().ok_or_else(|| {
            vovp::Error::Config(format!(
                "this engine has no transfer key (--transfer-key-file or {}): it fetches \
                 nothing from other engines",
                crate::transfer::KEY_VARIABLE
            ))
        })
    }
}

impl Message<Incoming> for ConnectionActor {
    type Reply = Response;

    async fn handle(&mut self, m: Incoming, _: &mut Context<Self, Self::Reply>) -> Response {
        let no_reply = m.no_reply;
        match self.dispatch(m.request, no_reply).await {
            Ok(r) => r,
            Err(_) if no_reply => Response::NoReply,
            Err(e) => error_response(&e),
        }
    }
}

impl Message<Disconnect> for ConnectionActor {
    type Reply = ();

    async fn handle(&mut self, _: Disconnect, _: &mut Context<Self, Self::Reply>) {
        self.session.release_all();
    }
}

impl Message<SegmentFds> for ConnectionActor {
    /// Segment 0, and whether this client writes it: with no client arenas (`--prefault`)
    /// every object lives there and its creator writes it, as in Plasma's store; never a
    /// client of another uid (`--allow-uid`), which keeps read-only fds only.
    type Reply = (Vec<Arc<vovp::Segment>>, bool);

    async fn handle(&mut self, _: SegmentFds, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let config = self.session.config();
        let shared_writable = (config.prefault || !config.client_arenas) && self.own_uid;
        (
            self.session.segments().iter().take(1).cloned().collect(),
            shared_writable,
        )
    }
}
