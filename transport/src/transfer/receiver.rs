//! The receiver's side: FETCH and GATHER. A transfer runs as one task on a transfer thread:
//! it mints the ticket, opens stream 0 to learn the object (size, version, metadata), creates
//! the local object (a replacement sealed as the holder's version), then receives the ranges
//! over up to `streams` streams at once, each on its own transfer thread, straight into the
//! object's memory, copies what a base version has locally, and seals only once every byte
//! arrived. Any failure aborts the object: a reader never sees part of a transfer.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_uring::net::TcpStream;
use vovp::{Error, Location, ObjectRef, PutOptions, Segment, Session};
use vovp_proto::transfer::{Ask, Go, Header, Open, Ticket, TransferKey, NONCE_LEN};

use super::holder::now_unix_ms;
use super::io::{read_exact_into, read_message, write_all_from, ObjectBytes};
use super::pool::Pool;
use super::{Counter, Counters};

/// A stream is worth opening per this many bytes (up to the transfer's stream count).
const BYTES_PER_STREAM: u64 = 16 << 20;
/// Streams' ranges are cut at multiples of this (whole pages).
const CUT: u64 = 64 << 10;

/// What receiving needs (one per engine).
#[derive(Debug)]
pub(crate) struct Receiver {
    pub(crate) engine: vovp::EngineHandle,
    pub(crate) key: TransferKey,
    pub(crate) pool: Arc<Pool>,
    pub(crate) counters: Arc<Counters>,
    /// A holder that sends nothing for this long has failed.
    pub(crate) idle: Duration,
    /// How long a ticket is valid.
    pub(crate) ticket_life: Duration,
    /// Streams when the request does not say.
    pub(crate) default_streams: u16,
}

/// One FETCH, as the transfer task takes it.
#[derive(Debug, Clone)]
pub(crate) struct FetchJob {
    pub(crate) name: String,
    pub(crate) version: u64,
    pub(crate) source: SocketAddr,
    pub(crate) streams: u16,
    pub(crate) timeout: Duration,
    /// A local version and the ranges copied from it.
    pub(crate) base: Option<(u64, Vec<(u64, u64)>)>,
}

/// One GATHER.
#[derive(Debug, Clone)]
pub(crate) struct GatherJob {
    pub(crate) name: String,
    pub(crate) version: u64,
    pub(crate) source: SocketAddr,
    pub(crate) row_bytes: u64,
    pub(crate) ids: Vec<u64>,
    pub(crate) into: String,
    pub(crate) timeout: Duration,
}

/// A finished transfer: the version sealed, and the session that holds the object until the
/// clients that asked took their references.
#[derive(Debug, Clone)]
pub(crate) struct Received {
    pub(crate) version: u64,
    pub(crate) _holding: Session,
}

fn failed(what: impl std::fmt::Display) -> Error {
    Error::Transfer(what.to_string())
}

/// A transfer's signed ticket: every stream of it opens with an OPEN of this ticket.
struct Opener {
    ticket: Ticket,
    mac: [u8; 32],
}

impl Opener {
    /// The OPEN message of stream number `stream`.
    fn open(&self, stream: u16) -> Vec<u8> {
        Open {
            ticket: self.ticket.clone(),
            mac: self.mac,
            stream,
        }
        .encode()
    }
}

/// Where one stream's bytes go: pieces of the object (offset in it, length).
type Pieces = Vec<(u64, u64)>;

/// The object being written: its segment and where in it.
#[derive(Clone)]
struct Destination {
    segment: Arc<Segment>,
    offset: u64,
}

impl Destination {
    fn bytes(&self, at: u64, len: u64) -> Result<ObjectBytes, Error> {
        ObjectBytes::new(&self.segment, self.offset + at, len)
            .ok_or_else(|| Error::Internal("object outside its segment".into()))
    }
}

impl Receiver {
    /// A ticket for `name` at `version` over at most `streams` streams, signed.
    fn ticket(&self, name: &str, version: u64, streams: u16) -> Result<Opener, Error> {
        let mut nonce = [0u8; NONCE_LEN];
        getrandom::fill(&mut nonce).map_err(|e| Error::Internal(format!("no randomness: {e}")))?;
        let life = u64::try_from(self.ticket_life.as_millis()).unwrap_or(u64::MAX);
        let ticket = Ticket {
            name: name.to_owned(),
            version,
            expires_unix_ms: now_unix_ms().saturating_add(life),
            nonce,
            streams,
        };
        let mac = ticket.mac(&self.key);
        Ok(Opener { ticket, mac })
    }

    /// Starts a transfer of `name` at `version` from `source`: its ticket, and stream 0 opened
    /// with the holder's HEADER (checked by the caller).
    async fn connect(
        &self,
        name: &str,
        version: u64,
        streams: u16,
        source: SocketAddr,
        deadline: Instant,
    ) -> Result<(Opener, TcpStream, Header), Error> {
        let opener = self.ticket(name, version, streams)?;
        let (first, header) = open_stream(source, opener.open(0), self.idle, deadline).await?;
        Ok((opener, first, header))
    }

    fn streams(&self, asked: u16) -> u16 {
        match asked {
            0 => self.default_streams.max(1),
            n => n,
        }
    }

    /// FETCH: see the module doc. Runs on a transfer thread.
    pub(crate) async fn fetch(self: Arc<Self>, job: FetchJob) -> Result<Received, Error> {
        let deadline = Instant::now() + job.timeout;
        let most = self.streams(job.streams);
        let (opener, first, header) = self
            .connect(&job.name, job.version, most, job.source, deadline)
            .await?;
        let (size, metadata) = expect_version(&header, job.version)?;
        let copied = match &job.base {
            Some((_, ranges)) => check_ranges(ranges, size)?,
            None => Vec::new(),
        };
        let wanted = complement(&copied, size);
        let wanted_bytes: u64 = wanted.iter().map(|r| r.1).sum();
        let streams = streams_for(wanted_bytes, most);
        let parts = split(&wanted, streams);
        let session = self.engine.session().as_session().clone();
        let options = PutOptions {
            replace: true,
            version: Some(job.version),
            ..PutOptions::default()
        };
        let object = session.create(&job.name, size, &metadata, options).await?;
        let received = async {
            let dst = destination(&session, &object).await?;
            let base = async {
                match &job.base {
                    Some((version, _)) if !copied.is_empty() => {
                        copy_base(&session, &job.name, *version, &copied, &dst).await
                    }
                    _ => Ok(0),
                }
            };
            let streams = self.receive_all(
                job.source,
                &header,
                first,
                &opener,
                parts.into_iter().map(Ask::Ranges).collect(),
                &dst,
                deadline,
            );
            let (base, got) = tokio::join!(base, streams);
            let (base, got) = (base?, got?);
            self.counters.add(Counter::BytesCopiedFromBase, base);
            Ok::<u64, Error>(got)
        }
        .await;
        self.finish(&session, &object, received).await
    }

    /// GATHER: rows `ids` of the holder's object into a new ephemeral object `into`.
    pub(crate) async fn gather(self: Arc<Self>, job: GatherJob) -> Result<Received, Error> {
        let deadline = Instant::now() + job.timeout;
        let total = job
            .row_bytes
            .checked_mul(job.ids.len() as u64)
            .ok_or_else(|| failed("the rows' size overflows"))?;
        let most = self.streams(0);
        let (opener, first, header) = self
            .connect(&job.name, job.version, most, job.source, deadline)
            .await?;
        expect_version(&header, job.version)?;
        let streams = usize::from(streams_for(total, most));
        let per = job.ids.len().div_ceil(streams).max(1);
        let asks: Vec<Ask> = match job.ids.is_empty() {
            true => vec![Ask::Rows {
                row_bytes: job.row_bytes,
                ids: Vec::new(),
            }],
            false => job
                .ids
                .chunks(per)
                .map(|ids| Ask::Rows {
                    row_bytes: job.row_bytes,
                    ids: ids.to_vec(),
                })
                .collect(),
        };
        let session = self.engine.session().as_session().clone();
        let options = PutOptions {
            ephemeral: true,
            ..PutOptions::default()
        };
        let object = session.create(&job.into, total, &[], options).await?;
        let received = async {
            let dst = destination(&session, &object).await?;
            self.receive_all(job.source, &header, first, &opener, asks, &dst, deadline)
                .await
        }
        .await;
        self.finish(&session, &object, received).await
    }

    /// Seals `object` when every byte arrived, else aborts it.
    async fn finish(
        &self,
        session: &Session,
        object: &ObjectRef,
        received: Result<u64, Error>,
    ) -> Result<Received, Error> {
        match received {
            Ok(bytes) => {
                let version = session.seal_object(object).await?;
                self.counters.add(Counter::BytesReceived, bytes);
                Ok(Received {
                    version,
                    _holding: session.clone(),
                })
            }
            Err(e) => {
                // Nothing is in flight on the object any more (every stream has returned).
                let _ = session.abort(object.name.as_str()).await;
                Err(e)
            }
        }
    }

    /// Receives every ask's bytes into `dst`, one stream each (the first on `first`, the
    /// others on streams opened now, on other transfer threads), laid out one after another
    /// in ask order. Returns once every stream has ended; the bytes received.
    #[allow(clippy::too_many_arguments)]
    async fn receive_all(
        &self,
        source: SocketAddr,
        header: &Header,
        first: TcpStream,
        opener: &Opener,
        asks: Vec<Ask>,
        dst: &Destination,
        deadline: Instant,
    ) -> Result<u64, Error> {
        let mut asks = asks.into_iter();
        let Some(first_ask) = asks.next() else {
            return Ok(0);
        };
        let layout = |ask: &Ask, at: &mut u64| -> Pieces {
            match ask {
                Ask::Ranges(ranges) => ranges.clone(),
                Ask::Rows { .. } => {
                    let start = *at;
                    *at += ask.bytes();
                    vec![(start, ask.bytes())]
                }
            }
        };
        let mut at = 0;
        let first_pieces = layout(&first_ask, &mut at);
        let mut others = Vec::new();
        for (i, ask) in asks.enumerate() {
            let pieces = layout(&ask, &mut at);
            let stream_no = u16::try_from(i + 1).map_err(|_| failed("too many streams"))?;
            let (open, header, dst) = (opener.open(stream_no), header.clone(), dst.clone());
            let idle = self.idle;
            others.push(self.pool.run(move || async move {
                let (stream, theirs) = open_stream(source, open, idle, deadline).await?;
                if theirs != header {
                    return Err(failed(format!(
                        "{source} announced another object on a second stream (replaced meanwhile?)"
                    )));
                }
                receive(&stream, ask, &pieces, &dst, idle, deadline).await
            }));
        }
        let mine = receive(&first, first_ask, &first_pieces, dst, self.idle, deadline);
        let mut total = 0;
        let mut failure = None;
        match mine.await {
            Ok(n) => total += n,
            Err(e) => failure = Some(e),
        }
        for other in others {
            match other.await {
                Ok(Ok(n)) => total += n,
                Ok(Err(e)) => failure = failure.or(Some(e)),
                Err(_) => failure = failure.or(Some(failed("a transfer thread stopped"))),
            }
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(total),
        }
    }
}

/// Connects to `source` and sends `open`; the stream and the holder's HEADER.
async fn open_stream(
    source: SocketAddr,
    open: Vec<u8>,
    idle: Duration,
    deadline: Instant,
) -> Result<(TcpStream, Header), Error> {
    let stream = tokio::time::timeout_at(deadline, TcpStream::connect(source))
        .await
        .map_err(|_| failed(format!("connecting to {source} timed out")))?
        .map_err(|e| failed(format!("connecting to {source}: {e}")))?;
    let _ = stream.set_nodelay(true);
    let at = |e: std::io::Error| failed(format!("{source}: {e}"));
    write_all_from(&stream, open, idle).await.map_err(at)?;
    let header = read_message(&stream, deadline.min(Instant::now() + idle))
        .await
        .map_err(at)?;
    let header = Header::decode(&header).map_err(|e| failed(format!("{source}: {e}")))?;
    if let Header::Refused(why) = &header {
        return Err(failed(format!("{source} refused: {why}")));
    }
    Ok((stream, header))
}

/// One stream after its HEADER: sends `ask`, reads GO, then the bytes into `pieces` of `dst`.
async fn receive(
    stream: &TcpStream,
    ask: Ask,
    pieces: &[(u64, u64)],
    dst: &Destination,
    idle: Duration,
    deadline: Instant,
) -> Result<u64, Error> {
    let total = ask.bytes();
    let io = |e: std::io::Error| failed(e);
    write_all_from(stream, ask.encode(), idle)
        .await
        .map_err(io)?;
    let go = read_message(stream, deadline.min(Instant::now() + idle))
        .await
        .map_err(io)?;
    match Go::decode(&go).map_err(failed)? {
        Go::Bytes(n) if n == total => {}
        Go::Bytes(n) => return Err(failed(format!("the holder offers {n} bytes, not {total}"))),
        Go::Refused(why) => return Err(failed(format!("the holder refused: {why}"))),
    }
    for &(at, len) in pieces {
        if len > 0 {
            read_exact_into(stream, dst.bytes(at, len)?, idle, deadline)
                .await
                .map_err(io)?;
        }
    }
    Ok(total)
}

/// The header's size and metadata, if it is of `version`.
fn expect_version(header: &Header, version: u64) -> Result<(u64, Vec<u8>), Error> {
    match header {
        Header::Object {
            size,
            version: v,
            metadata,
        } if *v == version => Ok((*size, metadata.clone())),
        Header::Object { version: v, .. } => Err(failed(format!(
            "the holder serves version {v}, not {version}"
        ))),
        Header::Refused(why) => Err(failed(why)),
    }
}

/// Where `object` (just created by `session`) is in this process.
async fn destination(session: &Session, object: &ObjectRef) -> Result<Destination, Error> {
    match object.location {
        Location::Host { segment, offset } => Ok(Destination {
            segment: session.segment(segment).await?.segment,
            offset,
        }),
        Location::Cuda(_) => Err(Error::Internal("a transfer into CUDA memory".into())),
    }
}

/// Copies `ranges` of `name` at `version` (held here) into `dst`, in parallel on the copy
/// threads. The bytes copied.
async fn copy_base(
    session: &Session,
    name: &str,
    version: u64,
    ranges: &[(u64, u64)],
    dst: &Destination,
) -> Result<u64, Error> {
    let base = session.get(&[name], None).await?.pop().flatten();
    let base = match base {
        Some(b) if b.version == version => b,
        other => {
            let present = other.map_or("none".into(), |b| b.version.to_string());
            return Err(Error::NotFound(format!(
                "{name}@{version} as the base of a fetch (present here: {present})"
            )));
        }
    };
    let id = base.id;
    let copied = async {
        let Location::Host { segment, offset } = base.location else {
            return Err(Error::Internal("a CUDA base".into()));
        };
        if ranges.iter().any(|&(at, len)| at + len > base.size) {
            return Err(Error::Protocol(format!(
                "a base range is past {name}@{version}'s {} bytes",
                base.size
            )));
        }
        let src = Destination {
            segment: session.segment(segment).await?.segment,
            offset,
        };
        let (dst, ranges) = (dst.clone(), ranges.to_vec());
        tokio::task::spawn_blocking(move || copy_ranges(&src, &dst, &ranges))
            .await
            .map_err(|e| Error::Internal(format!("the base copy: {e}")))?
    }
    .await;
    session.release(vec![id]).await?;
    copied
}

fn copy_ranges(src: &Destination, dst: &Destination, ranges: &[(u64, u64)]) -> Result<u64, Error> {
    let mut n = 0;
    for &(at, len) in ranges {
        let from = src
            .segment
            .ptr(src.offset + at, len)
            .ok_or_else(|| Error::Internal("base outside its segment".into()))?;
        let to = dst
            .segment
            .ptr(dst.offset + at, len)
            .ok_or_else(|| Error::Internal("object outside its segment".into()))?;
        let len = usize::try_from(len).map_err(|_| Error::Internal("range too large".into()))?;
        // SAFETY: both ranges were checked inside their objects: `from` a sealed object this
        // session holds, `to` the unsealed object it created, which no stream writes here
        // (streams receive the complement of these ranges).
        let (from, to) = unsafe {
            (
                std::slice::from_raw_parts(from, len),
                std::slice::from_raw_parts_mut(to, len),
            )
        };
        vovp::parallel_copy(to, from);
        n += len as u64;
    }
    Ok(n)
}

/// The base ranges sorted, checked inside an object of `size` bytes and not overlapping.
fn check_ranges(ranges: &[(u64, u64)], size: u64) -> Result<Vec<(u64, u64)>, Error> {
    let mut sorted: Vec<(u64, u64)> = ranges.iter().copied().filter(|r| r.1 > 0).collect();
    sorted.sort_unstable();
    let mut end = 0;
    for &(at, len) in &sorted {
        let past = at.checked_add(len).filter(|&e| e <= size).ok_or_else(|| {
            Error::Protocol(format!(
                "base range {at}+{len} is past the object's {size} bytes"
            ))
        })?;
        if at < end {
            return Err(Error::Protocol(format!(
                "base range {at}+{len} overlaps another"
            )));
        }
        end = past;
    }
    Ok(sorted)
}

/// The ranges of `0..size` that sorted, disjoint `copied` does not cover.
fn complement(copied: &[(u64, u64)], size: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut at = 0;
    for &(start, len) in copied {
        if start > at {
            out.push((at, start - at));
        }
        at = start + len;
    }
    if at < size {
        out.push((at, size - at));
    }
    out
}

/// How many streams `bytes` deserve, at most `most`.
fn streams_for(bytes: u64, most: u16) -> u16 {
    let wanted = bytes.div_ceil(BYTES_PER_STREAM).max(1);
    u16::try_from(wanted).unwrap_or(u16::MAX).min(most.max(1))
}

/// `ranges` cut into `parts` lists of about equal bytes, in order (cuts at [`CUT`] multiples).
fn split(ranges: &[(u64, u64)], parts: u16) -> Vec<Vec<(u64, u64)>> {
    let total: u64 = ranges.iter().map(|r| r.1).sum();
    let share = total
        .div_ceil(u64::from(parts.max(1)))
        .next_multiple_of(CUT);
    let mut out = vec![Vec::new()];
    let mut room = share;
    for &(mut at, mut len) in ranges {
        while len > 0 {
            if room == 0 {
                out.push(Vec::new());
                room = share;
            }
            let take = len.min(room);
            if let Some(last) = out.last_mut() {
                last.push((at, take));
            }
            at += take;
            len -= take;
            room -= take;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_split_into_streams_cover_everything_once() {
        let mib = 1 << 20;
        assert_eq!(streams_for(0, 4), 1);
        assert_eq!(streams_for(mib, 4), 1);
        assert_eq!(streams_for(256 * mib, 4), 4);
        assert_eq!(streams_for(256 * mib, 0), 1);
        let parts = split(&[(0, 100 * mib)], 4);
        assert_eq!(parts.len(), 4);
        assert_eq!(parts[0], vec![(0, 25 * mib)]);
        let parts = split(&[(0, 10), (100, 30 * mib)], 3);
        let flat: Vec<(u64, u64)> = parts.concat();
        assert_eq!(flat.iter().map(|r| r.1).sum::<u64>(), 10 + 30 * mib);
        assert_eq!(flat[0], (0, 10));
        assert!(parts.len() <= 3);
        assert_eq!(split(&[], 4), vec![Vec::<(u64, u64)>::new()]);
    }

    #[test]
    fn base_ranges_and_their_complement() {
        let copied = check_ranges(&[(64, 64), (0, 32), (200, 0)], 256).unwrap();
        assert_eq!(copied, vec![(0, 32), (64, 64)]);
        assert_eq!(complement(&copied, 256), vec![(32, 32), (128, 128)]);
        assert_eq!(complement(&[], 10), vec![(0, 10)]);
        assert_eq!(complement(&[(0, 10)], 10), vec![]);
        assert!(check_ranges(&[(0, 64), (32, 64)], 256).is_err());
        assert!(check_ranges(&[(250, 64)], 256).is_err());
        assert!(check_ranges(&[(u64::MAX, 2)], 256).is_err());
    }
}
