//! The store operations of both clients, written once as async code over a [`Driver`] (a
//! connection's I/O): a request's checks, the put route ([`vovp_types::put::route`]) and its
//! fallbacks, the get route (the shared directory first, `vovp_shm::held::DirectoryPart`),
//! what a reply becomes (views, buffers, the segments they need mapped first) and the puts
//! through the lend. The async client awaits them; the blocking client's driver does its I/O
//! before it returns a future, so every future here is ready at its first poll and the blocking
//! client runs them with [`ready`], no executor in between.
//!
//! What stays with each driver: sending a request and reading its reply (and reconnecting),
//! mapping a segment, where a view's release goes, and the blocking client's puts that do not
//! wait for their reply ([`Driver::put_later`]: the async client has none).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use vovp_proto::{Reply, Request, LIST_END};
use vovp_shm::held::{self, DirectoryPart};
use vovp_types::put::{self, PutPaths, Route};
use vovp_types::{
    Error, ObjectBuffer, ObjectId, ObjectInfo, ObjectRef, ObjectSink, ObjectView, PutOptions,
    StoreStats,
};

use crate::core::{self, requests, Answered, Core, Expect};
use crate::lent::{self, ClientLend, Lent, Reservation, Reserved};
use crate::mapping::MappedSegment;
use crate::pending::PipelinedView;

/// What a put gives back, by what it was asked to keep and whether it could return before the
/// store's answer ([`PutOptions::keep_reference`], [`PutOptions::pipelined`]).
///
/// ```no_run
/// use vovp_client::{Client, Put, PutOptions};
///
/// let client = Client::connect("/tmp/vovp.sock")?;
/// let kept = PutOptions { keep_reference: true, ..Default::default() };
/// let Put::Kept(view) = client.put_with("step", &7u64.to_le_bytes(), b"", kept)? else {
///     unreachable!("a kept put that waits answers with its view")
/// };
/// assert_eq!(view.size(), 8);
/// # Ok::<(), vovp_client::Error>(())
/// ```
#[derive(Debug)]
pub enum Put {
    /// Sent without waiting, no reference kept: its outcome comes with `Client::sync`.
    Sent,
    /// Stored, no reference kept: the new object's id.
    Stored(ObjectId),
    /// Stored and kept: the store's copy.
    Kept(ObjectView),
    /// Kept, returned before the store's answer: the store's copy, whose id and outcome come
    /// with the reply ([`PipelinedView::wait`]).
    Pending(PipelinedView),
}

/// One put's arguments, as every route takes them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PutArgs<'a> {
    pub(crate) name: &'a str,
    pub(crate) data: &'a [u8],
    pub(crate) metadata: &'a [u8],
    pub(crate) options: PutOptions,
}

/// A connection's I/O, as the operations need it (see the module doc).
pub(crate) trait Driver: Send + Sync {
    fn core(&self) -> &Core;

    /// This client's lend.
    fn lend(&self) -> &ClientLend;

    /// Whether this client sends puts without waiting for their reply where the connection
    /// allows it (its option; never the async client).
    fn pipelines(&self) -> bool;

    /// Sends `req` and reads its reply, with the mappings and generation of the connection
    /// that answered (one reconnect and retry where the client allows it).
    fn call_in_session<'a>(
        &'a self,
        req: &'a Request<'_>,
    ) -> impl Future<Output = Result<(Reply, Answered), Error>> + Send + 'a;

    /// Maps segment `segment` (SEGMENT) into the mappings of connection `on` (the one that
    /// answered with an object in it).
    fn map_segment<'a>(
        &'a self,
        on: &'a Answered,
        segment: u32,
    ) -> impl Future<Output = Result<Arc<MappedSegment>, Error>> + Send + 'a;

    /// Where the views of connection `generation` send their releases.
    fn sink(&self, generation: u64) -> Arc<dyn ObjectSink>;

    /// The shared directory's lookup for this client now: a view of a name it has, with no
    /// message (`None`: the store must answer; always, once the client is closed).
    fn directory(&self) -> impl FnMut(&str) -> Option<ObjectView> + '_;

    /// The put route (`put`, `put_blocking`), run as this driver runs its operations.
    fn put<'a>(&'a self, put: PutArgs<'a>) -> impl Future<Output = Result<Put, Error>> + Send + 'a;

    /// A put route that does not wait for the store's answer ([`Route::is_pipelined`]):
    /// `None` when not this way now (the caller falls back to the next route).
    fn put_later(&self, _route: Route, _put: &PutArgs<'_>) -> Option<Result<Put, Error>> {
        None
    }
}

/// The output of a future that is ready at its first poll (the blocking driver's, see the
/// module doc); one that is not is an internal error, never a hang.
#[inline]
pub(crate) fn ready<T>(fut: impl Future<Output = Result<T, Error>>) -> Result<T, Error> {
    poll_once(fut).unwrap_or_else(|| {
        Err(Error::Internal(
            "a blocking client's operation did not complete".into(),
        ))
    })
}

/// `fut`'s output if it is ready at its first poll.
#[inline]
pub(crate) fn poll_once<T>(mut fut: impl Future<Output = T>) -> Option<T> {
    // SAFETY: `fut` is pinned where it is, a local never moved again (it is dropped here).
    let mut fut = unsafe { std::pin::Pin::new_unchecked(&mut fut) };
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match fut.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(out) => Some(out),
        std::task::Poll::Pending => None,
    }
}

pub(crate) async fn call<D: Driver>(d: &D, req: &Request<'_>) -> Result<Reply, Error> {
    Ok(d.call_in_session(req).await?.0)
}

/// Holds the segments of `refs` that are mapped and maps those that are not, asking the
/// daemon for their fds (read-write only for this client's own arenas): the returned mappings
/// keep them all alive until the caller's views hold them. `answered`: the connection the refs
/// came from.
async fn pin_segments<'r, D: Driver>(
    d: &D,
    answered: &Answered,
    refs: impl IntoIterator<Item = &'r ObjectRef>,
) -> Result<Vec<Arc<MappedSegment>>, Error> {
    let (mut pins, missing) = answered.0.segments_of(refs);
    for segment in missing {
        pins.push(d.map_segment(answered, segment).await?);
    }
    Ok(pins)
}

/// A view of the object a reply of connection `answered` located (mapping its segment first
/// if need be); the reference is released if that fails.
pub(crate) async fn view_of<D: Driver>(
    d: &D,
    r: ObjectRef,
    answered: Answered,
) -> Result<ObjectView, Error> {
    let sink = d.sink(answered.1);
    let id = r.id;
    let _pins = pin_segments(d, &answered, [&r])
        .await
        .inspect_err(|_| sink.release(id))?;
    answered
        .0
        .view(r, sink.clone())
        .inspect_err(|_| sink.release(id))
}

/// The views a GET or GET_NEWER answers with.
async fn views_of<D: Driver>(d: &D, req: &Request<'_>) -> Result<Vec<Option<ObjectView>>, Error> {
    let (reply, answered) = d.call_in_session(req).await?;
    let objects = reply.objects()?;
    let sink = d.sink(answered.1);
    // Kept until the views hold the segments they point into.
    let _pins = match pin_segments(d, &answered, objects.iter().flatten()).await {
        Ok(pins) => pins,
        Err(e) => {
            objects.iter().flatten().for_each(|r| sink.release(r.id));
            return Err(e);
        }
    };
    answered.0.views(objects, sink)
}

pub(crate) async fn create<D: Driver>(
    d: &D,
    name: &str,
    size: u64,
    metadata: &[u8],
    options: PutOptions,
) -> Result<ObjectBuffer, Error> {
    Ok(created(d, name, size, metadata, options).await?.0)
}

/// [`create`], with the connection generation that created it (only that connection may seal
/// it).
async fn created<D: Driver>(
    d: &D,
    name: &str,
    size: u64,
    metadata: &[u8],
    options: PutOptions,
) -> Result<(ObjectBuffer, u64), Error> {
    let req = requests::create(name, size, metadata, options)?;
    let (reply, answered) = d.call_in_session(&req).await?;
    let r = reply.object()?;
    let id = r.id;
    let sink = d.sink(answered.1);
    core::check_created(&r, size).inspect_err(|_| sink.release(id))?;
    let _pins = pin_segments(d, &answered, [&r])
        .await
        .inspect_err(|_| sink.release(id))?;
    let buffer = (answered.0.buffer(r, sink.clone())).inspect_err(|_| sink.release(id))?;
    Ok((buffer, answered.1))
}

pub(crate) async fn seal<D: Driver>(d: &D, name: &str) -> Result<u64, Error> {
    call(d, &requests::seal(name)?).await?.version()
}

/// GET over the socket: the store answers for every name (the names a get's shared directory
/// did not serve, or a caller's that looked there itself).
pub(crate) async fn get_from_store<D: Driver>(
    d: &D,
    names: &[&str],
    timeout: Option<Duration>,
) -> Result<Vec<Option<ObjectView>>, Error> {
    views_of(d, &requests::get(names, timeout)?).await
}

/// The get route: names published in the shared directory are got with no message (a hold in
/// this connection's table); the rest, if any, in one GET.
pub(crate) async fn get<D: Driver>(
    d: &D,
    names: &[&str],
    timeout: Option<Duration>,
) -> Result<Vec<Option<ObjectView>>, Error> {
    let part = DirectoryPart::look(names, d.directory());
    let rest = part.rest();
    let got = match rest.is_empty() {
        true => Vec::new(),
        false => get_from_store(d, &rest, timeout).await?,
    };
    Ok(part.fill(got))
}

/// One name, the shared directory first: [`get`] without the lists (every single get), in two
/// halves, so that the blocking client makes no future for a get the directory serves. This
/// half: `name` through the directory, with no message.
pub(crate) fn held_one<D: Driver>(d: &D, name: &str) -> Option<ObjectView> {
    d.directory()(name)
}

/// The second half: GET of one name the directory did not serve.
pub(crate) async fn get_one_from_store<D: Driver>(
    d: &D,
    name: &str,
    timeout: Option<Duration>,
) -> Result<ObjectView, Error> {
    let found = get_from_store(d, &[name], timeout).await?.pop().flatten();
    found.ok_or_else(|| Error::NotFound(name.to_string()))
}

/// GET_NEWER of `name`: the store answers with a version above `newer_than`, waiting up to
/// `timeout` for one to be sealed (`NotFound` when none is).
pub(crate) async fn get_newer_from_store<D: Driver>(
    d: &D,
    name: &str,
    newer_than: u64,
    timeout: Option<Duration>,
) -> Result<ObjectView, Error> {
    let req = requests::get_newer(name, newer_than, timeout)?;
    (views_of(d, &req).await?.pop().flatten()).ok_or_else(|| Error::NotFound(name.to_string()))
}

/// The shared directory first (a held version above `newer_than` is the answer, an older one
/// is let go at once), then GET_NEWER, which waits for the next version to be sealed.
pub(crate) async fn get_newer<D: Driver>(
    d: &D,
    name: &str,
    newer_than: u64,
    timeout: Option<Duration>,
) -> Result<ObjectView, Error> {
    // (The lookup holds no mappings past it: a reconnect may replace them while GET_NEWER
    // waits.)
    let held = d.directory()(name);
    match held::newer(held, newer_than) {
        Some(v) => Ok(v),
        None => get_newer_from_store(d, name, newer_than, timeout).await,
    }
}

pub(crate) async fn list<D: Driver>(d: &D) -> Result<Vec<ObjectInfo>, Error> {
    let mut all = Vec::new();
    let mut start = 0;
    while start != LIST_END {
        let (page, next) = call(d, &requests::list(start)).await?.list()?;
        all.extend(page);
        start = next;
    }
    Ok(all)
}

pub(crate) async fn stats<D: Driver>(d: &D) -> Result<StoreStats, Error> {
    Ok(stats_and_connections(d).await?.0)
}

/// One STATS of every field this build knows, and the daemon's connection count. A daemon
/// from before spilling refuses the field count as MALFORMED: it is asked for the first
/// fields only (the others read 0).
pub(crate) async fn stats_and_connections<D: Driver>(d: &D) -> Result<(StoreStats, u64), Error> {
    match call(d, &Request::STATS).await {
        Err(e) if crate::core::older_daemon_refused(&e) => {
            call(d, &Request::STATS_FIRST).await?.stats()
        }
        r => r?.stats(),
    }
}

/// How a fetch from another engine goes ([`crate::Client::fetch_from`]); the defaults are the
/// engine's (streams by size, up to its `--transfer` default; 60 s; no base).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FetchOptions {
    /// Parallel TCP streams at most (0: the engine's choice).
    pub streams: u16,
    /// How long the whole transfer may take (`None`: the engine's default, 60 s).
    pub timeout: Option<Duration>,
    /// An older version of the same name held by this store, whose unchanged byte ranges are
    /// copied locally instead of fetched.
    pub base: Option<FetchBase>,
}

/// The local part of a fetch: `ranges` (`(offset, len)`, the same in both versions) are
/// copied from this store's `version` of the name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FetchBase {
    pub version: u64,
    pub ranges: Vec<(u64, u64)>,
}

/// What TRANSFER_INFO tells: where the engine serves transfers and what it counted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TransferInfo {
    /// `ip:port` of the transfer port; `None` when the engine serves none.
    pub address: Option<String>,
    /// (name, value) of each counter: streams served, refusals by reason, fetches, bytes.
    pub counters: Vec<(String, u64)>,
}

impl TransferInfo {
    /// The counter `name` (0 if the engine has none of that name).
    pub fn counter(&self, name: &str) -> u64 {
        self.counters
            .iter()
            .find(|(n, _)| n == name)
            .map_or(0, |(_, v)| *v)
    }
}

/// A timeout on the wire: 0 is the engine's default.
fn transfer_timeout_ms(timeout: Option<Duration>) -> i64 {
    timeout.map_or(0, |t| {
        i64::try_from(t.as_millis()).unwrap_or(i64::MAX).max(1)
    })
}

/// FETCH: `name` at `version` copied from the engine at `source` into this client's store,
/// as a view (see `Client::fetch_from`).
pub(crate) async fn fetch_from<D: Driver>(
    d: &D,
    source: &str,
    name: &str,
    version: u64,
    options: &FetchOptions,
) -> Result<ObjectView, Error> {
    let req = Request::Fetch(vovp_proto::Fetch {
        name: name.into(),
        version,
        source: source.into(),
        streams: options.streams,
        timeout_ms: transfer_timeout_ms(options.timeout),
        base: options.base.as_ref().map(|b| vovp_proto::FetchBase {
            version: b.version,
            ranges: b.ranges.as_slice().into(),
        }),
    });
    let (reply, answered) = d.call_in_session(&req).await?;
    view_of(d, reply.object()?, answered).await
}

/// GATHER: rows `ids` of `name` at `version` on `source`, as the new ephemeral object `into`
/// (see `Client::gather_from`).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn gather_from<D: Driver>(
    d: &D,
    source: &str,
    name: &str,
    version: u64,
    row_bytes: u64,
    ids: &[u64],
    into: &str,
    timeout: Option<Duration>,
) -> Result<ObjectView, Error> {
    let req = Request::Gather(vovp_proto::Gather {
        name: name.into(),
        version,
        source: source.into(),
        row_bytes,
        timeout_ms: transfer_timeout_ms(timeout),
        into: into.into(),
        ids: ids.into(),
    });
    let (reply, answered) = d.call_in_session(&req).await?;
    view_of(d, reply.object()?, answered).await
}

pub(crate) async fn transfer_info<D: Driver>(d: &D) -> Result<TransferInfo, Error> {
    match call(d, &Request::TransferInfo).await? {
        Reply::TransferInfo { address, counters } => Ok(TransferInfo {
            address: Some(address).filter(|a| !a.is_empty()),
            counters,
        }),
        other => Err(core::unexpected(&other)),
    }
}

/// The ways a put of `size` bytes may take on `d`'s connection now.
pub(crate) fn put_paths<D: Driver>(d: &D, size: usize) -> PutPaths {
    let maps = d.core().current.maps();
    let announce = maps.shared.as_ref().is_some_and(|s| s.can_announce());
    core::put_paths(size, maps.max_inline, announce, d.pipelines(), || {
        d.lend().largest(maps.capacity)
    })
}

/// The put route: [`vovp_types::put::route`] decides, the route is tried, and a route that did
/// not work now is taken out of the paths and the decision made again (see
/// `vovp_types::put`). Drivers run it through [`Driver::put`]: the async one awaits this, the
/// blocking one runs [`put_blocking`].
#[cfg(feature = "async")]
pub(crate) async fn put<D: Driver>(d: &D, put: PutArgs<'_>) -> Result<Put, Error> {
    match put_start(d, &put) {
        Started::Done(outcome) => outcome,
        Started::Waits(paths) => put_from(d, put, paths).await,
    }
}

/// The blocking driver's `put`: the routes that need no future first, so that the common
/// small put (pipelined, into the small lend) makes none; a future, run by [`ready`], only for
/// a put that waits. (A future is moved several times on its way: the put route's is most of
/// a kilobyte.)
pub(crate) fn put_blocking<D: Driver>(d: &D, put: PutArgs<'_>) -> Result<Put, Error> {
    match put_start(d, &put) {
        Started::Done(outcome) => outcome,
        Started::Waits(paths) => ready(put_from(d, put, paths)),
    }
}

/// Where a put stands after [`put_start`].
enum Started {
    Done(Result<Put, Error>),
    /// A route that waits for the store's answer comes next, on these paths.
    Waits(PutPaths),
}

/// The put route's first steps, which need no future: decides, and tries the routes that
/// return before the store's answer, until one concludes or a route that waits is picked.
fn put_start<D: Driver>(d: &D, put: &PutArgs<'_>) -> Started {
    let mut paths = put_paths(d, put.data.len());
    loop {
        let route = match put::route(put.data.len(), put.metadata.len(), &put.options, &paths) {
            Ok(route) if !route.is_pipelined() => return Started::Waits(paths),
            Ok(route) => route,
            Err(e) => return Started::Done(Err(e)),
        };
        match d.put_later(route, put) {
            Some(outcome) => return Started::Done(outcome),
            None => paths = paths.without(route),
        }
    }
}

/// The put route from `paths` on (the first route that waits, its fallbacks after it).
async fn put_from<D: Driver>(d: &D, put: PutArgs<'_>, mut paths: PutPaths) -> Result<Put, Error> {
    loop {
        let route = put::route(put.data.len(), put.metadata.len(), &put.options, &paths)?;
        let tried = match route {
            Route::Inline => Some(put_inline(d, &put).await),
            // Boxed: their futures are several times a small put's, and these puts copy at
            // least 64 KiB anyway.
            Route::Lend => Box::pin(put_lent(d, &put)).await,
            Route::CreateCopySeal => Some(Box::pin(create_copy_seal(d, &put)).await),
            Route::InlinePipelined | Route::LendPipelined | Route::SmallLend => {
                d.put_later(route, &put)
            }
        };
        match tried {
            Some(outcome) => return outcome,
            None => paths = paths.without(route),
        }
    }
}

/// What a waiting put's reply makes: the kept view, or the new object's id.
async fn stored<D: Driver>(
    d: &D,
    put: &PutArgs<'_>,
    (reply, answered): (Reply, Answered),
) -> Result<Put, Error> {
    let r = reply.object()?;
    if put.options.keep_reference {
        return Ok(Put::Kept(view_of(d, r, answered).await?));
    }
    Ok(Put::Stored(r.id))
}

/// PUT with the bytes in the frame, its reply awaited.
async fn put_inline<D: Driver>(d: &D, put: &PutArgs<'_>) -> Result<Put, Error> {
    let options = put.options.with(put.options.keep_reference, false);
    let req = requests::put(put.name, &options, put.metadata, put.data)?;
    let answer = d.call_in_session(&req).await?;
    stored(d, put, answer).await
}

/// CREATE, the copy into the mapping (in parallel above 1 MB), SEAL.
async fn create_copy_seal<D: Driver>(d: &D, put: &PutArgs<'_>) -> Result<Put, Error> {
    let size = put.data.len() as u64;
    let (mut buf, generation) = created(d, put.name, size, put.metadata, put.options).await?;
    vovp_shm::copy::parallel_copy(buf.as_mut_slice(), put.data);
    // Sealed only on the connection that created it (a daemon gone away took it along).
    d.core().check_generation(generation, put.name)?;
    let version = seal(d, put.name).await?;
    let view = buf.sealed(version);
    Ok(match put.options.keep_reference {
        true => Put::Kept(view),
        false => Put::Stored(view.id()),
    })
}

/// Why [`reserve_lent`] gave no range.
pub(crate) enum Unlent {
    /// Not through the lend now: put another way.
    No,
    /// The lend is full and puts still write into it ([`Reservation::Busy`]).
    Busy,
}

/// A range of this client's lend for a put of `size` data and `metadata_len` metadata bytes
/// (asking for a new lend when the current one is full), else why not.
pub(crate) async fn reserve_lent<D: Driver>(
    d: &D,
    size: usize,
    metadata_len: usize,
) -> Result<Reserved, Unlent> {
    let need = lent::block_len(size, metadata_len).ok_or(Unlent::No)?;
    let generation = d.core().current.generation();
    match d.lend().reserve(need, generation) {
        Reservation::Got(r) => Ok(r),
        Reservation::Busy => Err(Unlent::Busy),
        Reservation::No => Err(Unlent::No),
        Reservation::Lend(asked) => {
            let lent = take_lend(d, asked.at_least).await;
            asked.install(lent).ok_or(Unlent::No)
        }
    }
}

/// LEND: a new lend of at least `at_least` bytes, its segment mapped writable, and the
/// connection it belongs to.
async fn take_lend<D: Driver>(d: &D, at_least: u64) -> Result<Lent, Error> {
    let req = Request::Lend { at_least, flags: 0 };
    let (reply, answered) = d.call_in_session(&req).await?;
    let lend = reply.lent()?;
    let segment = match answered.0.segment(lend.segment) {
        Some(s) => s,
        None => d.map_segment(&answered, lend.segment).await?,
    };
    lent::accept(lend, segment, &answered)
}

/// A put through the lend: the bytes are written into this client's lend and one PUBLISH
/// makes them a sealed object. `None`: not through the lend now (busy, refused, or the store
/// no longer has it); the caller puts another way.
async fn put_lent<D: Driver>(d: &D, put: &PutArgs<'_>) -> Option<Result<Put, Error>> {
    let mut reserved = reserve_lent(d, put.data.len(), put.metadata.len())
        .await
        .ok()?;
    let options = put.options.with(put.options.keep_reference, false);
    let published = async {
        let req = reserved.write(put.name, put.data, put.metadata, &options)?;
        let answer = d.call_in_session(&req).await?;
        lent::check_answered(&reserved, &answer.1)?;
        stored(d, put, answer).await
    };
    let result = published.await;
    // NOT_FOUND from PUBLISH is about the lend (never the name): the store no longer has it,
    // so put another way (the bytes are copied again, once).
    if matches!(result, Err(Error::NotFound(_))) {
        reserved.lend_gone();
        return None;
    }
    Some(result)
}

/// Maps the outcome of a pipelined route to what [`put`] expects of [`Driver::put_later`].
pub(crate) fn pending(outcome: Option<Result<PipelinedView, Error>>) -> Option<Result<Put, Error>> {
    outcome.map(|r| r.map(Put::Pending))
}

pub(crate) async fn abort<D: Driver>(d: &D, name: &str) -> Result<(), Error> {
    call(d, &requests::abort(name)?).await?.empty()
}

pub(crate) async fn contains<D: Driver>(d: &D, name: &str) -> Result<bool, Error> {
    call(d, &requests::contains(name)?).await?.boolean()
}

pub(crate) async fn delete<D: Driver>(d: &D, name: &str) -> Result<(), Error> {
    call(d, &requests::delete(name)?).await?.empty()
}

pub(crate) async fn evict<D: Driver>(d: &D, bytes: u64) -> Result<u64, Error> {
    call(d, &Request::Evict { bytes }).await?.count()
}

/// The one put, with its four arguments.
pub(crate) async fn put_with<D: Driver>(
    d: &D,
    name: &str,
    data: &[u8],
    metadata: &[u8],
    options: PutOptions,
) -> Result<Put, Error> {
    let args = PutArgs {
        name,
        data,
        metadata,
        options,
    };
    d.put(args).await
}

/// A put that waits and keeps no reference: the new object's id.
pub(crate) async fn put_id<D: Driver>(
    d: &D,
    name: &str,
    data: &[u8],
    metadata: &[u8],
    options: PutOptions,
) -> Result<u64, Error> {
    match put_with(d, name, data, metadata, options.with(false, false)).await? {
        Put::Stored(id) => Ok(id.get()),
        other => Err(unexpected_put(other)),
    }
}

/// A put that waits and keeps a reference: the store's copy.
pub(crate) async fn put_and_view<D: Driver>(
    d: &D,
    name: &str,
    data: &[u8],
    metadata: &[u8],
    options: PutOptions,
) -> Result<ObjectView, Error> {
    match put_with(d, name, data, metadata, options.with(true, false)).await? {
        Put::Kept(view) => Ok(view),
        other => Err(unexpected_put(other)),
    }
}

/// A put answered with another outcome than its options ask for: the route's bug, reported.
fn unexpected_put(outcome: Put) -> Error {
    Error::Internal(format!("a put answered with {outcome:?}"))
}

/// `Store::put`: keeps no reference, and may return before the store's answer where the
/// driver can.
pub(crate) async fn put_unkept<D: Driver>(
    d: &D,
    name: &str,
    data: &[u8],
    metadata: &[u8],
    options: PutOptions,
) -> Result<(), Error> {
    let options = options.with(false, true);
    put_with(d, name, data, metadata, options).await.map(drop)
}

/// Methods that run an operation of this module on the client's driver (`$client::driver()`):
/// each `fn name(args) -> T = op;` of the list becomes `fn name(&self, args) -> Result<T, Error>`
/// (`async` where `$asyncness` is `[async]`), which makes the future `$op` of
/// `ops::op(self.driver(), args)` and returns `$run` (blocking: [`ready`]; async: awaited).
/// The per-method arm takes `$asyncness` as one bracketed token, so that it is not repeated
/// inside the list's repetition.
macro_rules! driver_methods {
    ($asyncness:tt |$op:ident| $run:expr;
     $($(#[$attr:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),*) -> $out:ty = $opfn:ident;)*) => {
        $($crate::ops::driver_methods!(@one $asyncness |$op| $run;
            $(#[$attr])* $vis fn $name($($arg: $ty),*) -> $out = $opfn);)*
    };
    (@one [$($asyncness:ident)?] |$op:ident| $run:expr;
     $(#[$attr:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),*) -> $out:ty = $opfn:ident) => {
        $(#[$attr])*
        $vis $($asyncness)? fn $name(&self, $($arg: $ty),*) -> Result<$out, Error> {
            let $op = $crate::ops::$opfn(self.driver(), $($arg),*);
            $run
        }
    };
}
pub(crate) use driver_methods;

/// The `Store` of the blocking client and the `AsyncStore` of the async one, from one list
/// ([`driver_methods`]). `$extra`: methods of one client only.
macro_rules! store_on_driver {
    ($trait:ident for $client:ty, $($asyncness:ident)?, |$op:ident| $run:expr, { $($extra:item)* }) => {
        impl $trait for $client {
            $crate::ops::driver_methods! { [$($asyncness)?] |$op| $run;
                fn create(name: &str, size: u64, metadata: &[u8], options: vovp_types::CreateOptions)
                    -> vovp_types::ObjectBuffer = create;
                fn seal(name: &str) -> u64 = seal;
                fn abort(name: &str) -> () = abort;
                /// Keeps no reference; returns before the store's answer where the client may
                /// (the blocking client, see `ClientOptions::no_pipelined_puts`).
                fn put(name: &str, data: &[u8], metadata: &[u8], options: vovp_types::CreateOptions)
                    -> () = put_unkept;
                /// Names published in the shared directory are got with no message (a hold in
                /// this connection's table); the rest, if any, in one GET.
                fn get(names: &[&str], timeout: Option<std::time::Duration>)
                    -> Vec<Option<vovp_types::ObjectView>> = get;
                /// The shared directory first (a held version above `newer_than` is the answer,
                /// an older one is let go at once), then GET_NEWER, which waits for the next
                /// version to be sealed.
                fn get_newer(name: &str, newer_than: u64, timeout: Option<std::time::Duration>)
                    -> vovp_types::ObjectView = get_newer;
                fn contains(name: &str) -> bool = contains;
                fn delete(name: &str) -> () = delete;
                fn list() -> Vec<vovp_types::ObjectInfo> = list;
                fn evict(bytes: u64) -> u64 = evict;
                fn stats() -> vovp_types::StoreStats = stats;
            }

            $($extra)*
        }
    };
}
pub(crate) use store_on_driver;

/// The puts both clients have besides `Store::put`, from one list ([`driver_methods`]).
macro_rules! puts_on_driver {
    ($client:ty, $($asyncness:ident)?, |$op:ident| $run:expr) => {
        impl $client {
            $crate::ops::driver_methods! { [$($asyncness)?] |$op| $run;
                /// The one put: `data` with `metadata` as object `name`, the way
                /// [`vovp_types::put::route`] picks for its size and `options` on this
                /// connection (see [`crate::Put`] for what comes back: `options.keep_reference`
                /// and `options.pipelined` decide; an `AsyncClient`'s put always waits for the
                /// store's answer). The other puts are this with those two set: `Store::put`
                /// (none kept, may return before the answer), `put_id` (none kept, waits),
                /// `put_and_view` (kept, waits), the blocking client's `put_view_later` (kept,
                /// returns before the answer).
                pub fn put_with(name: &str, data: &[u8], metadata: &[u8], options: vovp_types::PutOptions)
                    -> $crate::Put = put_with;
                /// `Store::put` that waits for the store's answer and returns the new object's
                /// id.
                pub fn put_id(name: &str, data: &[u8], metadata: &[u8], options: vovp_types::CreateOptions)
                    -> u64 = put_id;
                /// Puts and keeps a reference: the view is the store's copy (zero-copy
                /// afterwards).
                pub fn put_and_view(name: &str, data: &[u8], metadata: &[u8], options: vovp_types::CreateOptions)
                    -> vovp_types::ObjectView = put_and_view;
            }
        }
    };
}
pub(crate) use puts_on_driver;

/// The engine-to-engine transfer calls both clients have, from one list ([`driver_methods`]).
macro_rules! transfers_on_driver {
    ($client:ty, $($asyncness:ident)?, |$op:ident| $run:expr) => {
        impl $client {
            $crate::ops::driver_methods! { [$($asyncness)?] |$op| $run;
                /// Copies `name` at `version` from the engine whose transfer port is `source`
                /// (`ip:port`, its `TRANSFER_INFO` address) into this client's store, sealed
                /// there as exactly that version, and returns it (a view, as a get's). The
                /// engines move the bytes between them (this process sees none); concurrent
                /// fetches of one name and version on one engine share one transfer, and a
                /// version this store has already is returned without one. Errors:
                /// [`Error::Transfer`] (refused, the holder gone or stalled, unreachable),
                /// [`Error::StaleVersion`] (a newer version is here), [`Error::Config`] (this
                /// engine has no transfer key), [`Error::OutOfMemory`]. Nothing of a failed
                /// fetch is visible.
                pub fn fetch_from(source: &str, name: &str, version: u64, options: &$crate::FetchOptions)
                    -> vovp_types::ObjectView = fetch_from;
                /// Rows of `name` at `version` held by the engine at `source`: row `i` is bytes
                /// `i * row_bytes ..` of it; the rows come back in the order of `ids` (repeats
                /// allowed) as a new ephemeral object named `into` (gone when its last view
                /// is), `ids.len() * row_bytes` bytes. Errors as `fetch_from`'s; a row past the
                /// end is [`Error::Transfer`].
                #[allow(clippy::too_many_arguments)]
                pub fn gather_from(source: &str, name: &str, version: u64, row_bytes: u64, ids: &[u64],
                    into: &str, timeout: Option<std::time::Duration>) -> vovp_types::ObjectView = gather_from;
                /// The engine's transfer port and counters (TRANSFER_INFO).
                pub fn transfer_info() -> $crate::TransferInfo = transfer_info;
            }

            /// The engine's transfer port (`ip:port`), `None` when it serves none (no
            /// `--transfer`).
            pub $($asyncness)? fn transfer_address(&self) -> Result<Option<String>, Error> {
                let $op = $crate::ops::transfer_info(self.driver());
                Ok($run?.address)
            }
        }
    };
}
pub(crate) use transfers_on_driver;
