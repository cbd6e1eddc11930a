//! Replies (daemon to client). A reply's body depends on the request it answers, so it is
//! decoded by that request's opcode; each variant's encoding and decoding are side by side.

use std::borrow::Cow;
use std::time::{Duration, UNIX_EPOCH};

use vovp_types::{Lend, ObjectId, ObjectInfo, ObjectRef, StoreStats};

use crate::wire::{object_name, FrameWriter, Reader};
use crate::{DecodeError, Opcode, Request, Status, REPLY_BIT, STATUS_OK, VERSION};

/// A reply. The daemon's runtime-only outcomes (a subscription's receiver, "no reply", the fd
/// a HELLO or SEGMENT reply carries) are not here: they are the daemon's, and fds travel
/// beside the bytes (SCM_RIGHTS).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// ABORT, RELEASE, DELETE, SUBSCRIBE.
    Empty,
    /// SEAL: the version the object became.
    Version(u64),
    /// `segments`: (id, size) of each fd riding on the reply, in order.
    Hello {
        capacity: u64,
        max_inline: u32,
        segments: Vec<(u32, u64)>,
    },
    /// CREATE, PUT, PUBLISH.
    Object(ObjectRef),
    /// LEND: where the lent range is.
    Lent(Lend),
    /// PUBLISH_MANY: one result per object, in the request's order.
    Published(Vec<Result<ObjectRef, Failure>>),
    /// GET, GET_NEWER: one entry per name asked, `None` where not found.
    Objects(Vec<Option<ObjectRef>>),
    /// CONTAINS.
    Bool(bool),
    /// EVICT: bytes freed.
    Count(u64),
    /// One LIST page and the cursor of the next ([`crate::LIST_END`] after the last).
    List { entries: Vec<ObjectInfo>, next: u64 },
    /// STATS: the first `fields` of [`STATS_FIELDS`] travel (what the request asked for, at
    /// most every one this build knows); decoded, `fields` is how many came.
    Stats {
        stats: StoreStats,
        connections: u64,
        fields: u32,
    },
    /// A segment to map: its size, and whether this client may write it (the fd, read-write
    /// or read-only to match, rides on the reply).
    Segment { size: u64, writable: bool },
    /// SHARED's: whether the store publishes; when it does, two fds ride on the reply (the
    /// directory, read-only; the connection's hold table, read-write).
    Shared { published: bool },
    /// METRICS: the Prometheus text exposition (format 0.0.4), as `GET /metrics` serves it.
    Metrics(String),
    /// TRANSFER_INFO: the address the engine serves transfers at (`ip:port`, empty if none)
    /// and its transfer counters (name, value), refusals by reason among them.
    TransferInfo {
        address: String,
        counters: Vec<(String, u64)>,
    },
    /// Any request's error reply.
    Failure(Failure),
}

/// An error reply: its status, a human-readable message, and for the statuses that have them
/// ([`Status::has_figures`]) two figures: `figures` is `Some` exactly then.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub status: Status,
    pub message: String,
    /// OUT_OF_MEMORY's (requested, available) bytes; STALE_VERSION's (current, requested)
    /// versions.
    pub figures: Option<(u64, u64)>,
}

/// STATS's fields in wire order, with the accessor of each: written once for the encoder, the
/// decoder and the PROTOCOL.md check. Fields are only ever appended: a reply carries the first
/// `n` the request asked for, and a decoder reads the ones it knows and skips the rest.
type StatsField = (&'static str, fn(&mut (StoreStats, u64)) -> &mut u64);
/// The fields every STATS reply has (all of them before spilling): what an empty request asks.
pub const STATS_FIELDS_FIRST: usize = 16;
pub const STATS_FIELDS: [StatsField; 24] = [
    ("capacity", |s| &mut s.0.capacity),
    ("used_bytes", |s| &mut s.0.used_bytes),
    ("objects", |s| &mut s.0.objects),
    ("sealed", |s| &mut s.0.sealed),
    ("unsealed", |s| &mut s.0.unsealed),
    ("pending_delete", |s| &mut s.0.pending_delete),
    ("references", |s| &mut s.0.references),
    ("holders", |s| &mut s.0.holders),
    ("creates", |s| &mut s.0.creates),
    ("evicted_objects", |s| &mut s.0.evicted_objects),
    ("evicted_bytes", |s| &mut s.0.evicted_bytes),
    ("connections", |s| &mut s.1),
    ("shared_holds", |s| &mut s.0.shared_holds),
    ("waiting_gets", |s| &mut s.0.waiting_gets),
    ("put_barriers", |s| &mut s.0.put_barriers),
    ("half_closed", |s| &mut s.0.half_closed),
    ("spilled_objects", |s| &mut s.0.spilled_objects),
    ("spilled_bytes", |s| &mut s.0.spilled_bytes),
    ("spills", |s| &mut s.0.spills),
    ("spill_bytes", |s| &mut s.0.spill_bytes),
    ("restores", |s| &mut s.0.restores),
    ("restore_bytes", |s| &mut s.0.restore_bytes),
    ("spill_failures", |s| &mut s.0.spill_failures),
    ("restore_failures", |s| &mut s.0.restore_failures),
];

impl Reply {
    /// An error reply without sizes (any status but OUT_OF_MEMORY: see [`Failure`]).
    pub fn error(status: Status, message: impl Into<String>) -> Self {
        Reply::Failure(Failure {
            status,
            message: message.into(),
            figures: None,
        })
    }

    /// Appends the reply frame to request `opcode` (a byte: error replies also answer opcodes
    /// that are unknown) and `request_id`.
    pub fn encode(&self, opcode: u8, request_id: u64, buf: &mut Vec<u8>) {
        let mut w = FrameWriter::begin(buf, opcode | REPLY_BIT, 0, request_id);
        match self {
            Reply::Failure(f) => {
                encode_failure(f, &mut w);
            }
            ok => {
                w.u8(STATUS_OK);
                ok.encode_body(&mut w);
            }
        }
        w.finish();
    }

    fn encode_body(&self, w: &mut FrameWriter<'_>) {
        match self {
            Reply::Empty | Reply::Failure(_) => {}
            Reply::Hello {
                capacity,
                max_inline,
                segments,
            } => {
                w.u16(VERSION.into()).u64(*capacity).u32(*max_inline);
                w.count(segments.len());
                for (id, size) in segments {
                    w.u32(*id).u64(*size);
                }
            }
            Reply::Object(r) => {
                w.object(r);
            }
            Reply::Published(v) => {
                w.count(v.len());
                for result in v {
                    match result {
                        Ok(r) => w.u8(STATUS_OK).object(r),
                        Err(f) => encode_failure(f, w),
                    };
                }
            }
            Reply::Objects(v) => {
                w.count(v.len());
                for o in v {
                    match o {
                        None => w.u8(0),
                        Some(r) => w.u8(1).object(r),
                    };
                }
            }
            Reply::Bool(b) => {
                w.u8(*b as u8);
            }
            Reply::Count(n) | Reply::Version(n) => {
                w.u64(*n);
            }
            Reply::List { entries, next } => {
                w.count(entries.len());
                for i in entries {
                    // Before the epoch cannot happen for a time the daemon took; 0 if it did.
                    let ms = i
                        .last_access
                        .duration_since(UNIX_EPOCH)
                        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
                    w.str(i.name.as_str())
                        .u64(i.id.get())
                        .u64(i.size)
                        .device(i.device);
                    w.u8(list_state(i)).u8(i.ephemeral as u8).u32(i.refcount);
                    w.u64(ms).bytes(&i.metadata).u64(i.version);
                }
                w.u64(*next);
            }
            Reply::Stats {
                stats,
                connections,
                fields,
            } => {
                let mut s = (stats.clone(), *connections);
                let n = (*fields as usize).clamp(STATS_FIELDS_FIRST, STATS_FIELDS.len());
                for (_, field) in &STATS_FIELDS[..n] {
                    w.u64(*field(&mut s));
                }
            }
            Reply::Segment { size, writable } => {
                w.u64(*size).u8(*writable as u8);
            }
            Reply::Shared { published } => {
                w.u8(*published as u8);
            }
            Reply::Metrics(text) => {
                w.bytes(text.as_bytes());
            }
            Reply::TransferInfo { address, counters } => {
                w.str(address).count(counters.len());
                for (name, value) in counters {
                    w.str(name).u64(*value);
                }
            }
            Reply::Lent(l) => {
                w.u64(l.id).u32(l.segment).u64(l.offset).u64(l.size);
                w.u64(l.max_object);
            }
        }
    }

    /// Decodes the payload of the reply to request `opcode`. `names` are the names the request
    /// asked for (an `objref` does not repeat its name): CREATE's or PUT's one, GET's list.
    /// An error status decodes to [`Reply::Failure`], whatever the opcode.
    pub fn decode<S: AsRef<str>>(
        opcode: u8,
        payload: &[u8],
        names: &[S],
    ) -> Result<Reply, DecodeError> {
        let mut r = Reader::new(payload);
        let status = r.u8()?;
        if status != STATUS_OK {
            let failure = decode_failure(status, &mut r)?;
            r.finish()?;
            return Ok(Reply::Failure(failure));
        }
        let op = Opcode::from_code(opcode).ok_or(DecodeError::UnknownOpcode(opcode))?;
        let one_name = || {
            names
                .first()
                .map(AsRef::as_ref)
                .ok_or(DecodeError::NameCount { asked: 0, got: 1 })
        };
        let reply = match op {
            Opcode::Abort | Opcode::Release | Opcode::Delete | Opcode::Subscribe => Reply::Empty,
            Opcode::Seal => Reply::Version(r.u64()?),
            Opcode::Hello => decode_hello(&mut r)?,
            Opcode::Create | Opcode::Put | Opcode::Publish | Opcode::Fetch | Opcode::Gather => {
                Reply::Object(r.object(one_name()?)?)
            }
            Opcode::TransferInfo => {
                let address = r.str()?.to_owned();
                let n = r.count(10)?;
                let counters = (0..n)
                    .map(|_| Ok((r.str()?.to_owned(), r.u64()?)))
                    .collect::<Result<_, DecodeError>>()?;
                Reply::TransferInfo { address, counters }
            }
            Opcode::Lend => Reply::Lent(Lend {
                id: r.u64()?,
                segment: r.u32()?,
                offset: r.u64()?,
                size: r.u64()?,
                max_object: r.u64()?,
            }),
            Opcode::Get | Opcode::GetNewer => decode_objects(&mut r, names)?,
            Opcode::PublishMany => decode_published(&mut r, names)?,
            Opcode::Contains => Reply::Bool(r.u8()? != 0),
            Opcode::Evict => Reply::Count(r.u64()?),
            Opcode::List => decode_list(&mut r)?,
            Opcode::Stats => {
                let mut s = (StoreStats::default(), 0);
                let mut fields = 0u32;
                for (i, (_, field)) in STATS_FIELDS.iter().enumerate() {
                    // The first ones always come; later ones only from a daemon that has them.
                    if i >= STATS_FIELDS_FIRST && r.rest_len() < 8 {
                        break;
                    }
                    *field(&mut s) = r.u64()?;
                    fields += 1;
                }
                // Fields appended by a newer daemon: whole u64s, skipped.
                let newer = r.rest();
                if !newer.len().is_multiple_of(8) {
                    return Err(DecodeError::Trailing(newer.len()));
                }
                Reply::Stats {
                    stats: s.0,
                    connections: s.1,
                    fields,
                }
            }
            Opcode::Segment => Reply::Segment {
                size: r.u64()?,
                writable: r.u8()? != 0,
            },
            Opcode::Shared => Reply::Shared {
                published: r.u8()? != 0,
            },
            Opcode::Metrics => Reply::Metrics(
                std::str::from_utf8(r.bytes()?)
                    .map_err(|_| DecodeError::NotUtf8)?
                    .to_owned(),
            ),
            Opcode::Notify => return Err(DecodeError::NotARequest(opcode)),
        };
        r.finish()?;
        Ok(reply)
    }
}

/// An error reply's status and body (also one object's result in PUBLISH_MANY's reply).
fn encode_failure<'w, 'b>(f: &Failure, w: &'w mut FrameWriter<'b>) -> &'w mut FrameWriter<'b> {
    w.u8(f.status.code()).str(&f.message);
    if let Some((first, second)) = f.figures {
        w.u64(first).u64(second);
    }
    w
}

/// An error reply's body after its status byte: the message, and OUT_OF_MEMORY's figures.
fn decode_failure(status: u8, r: &mut Reader<'_>) -> Result<Failure, DecodeError> {
    let status = Status::from_code(status).ok_or(DecodeError::UnknownStatus(status))?;
    let message = r.str()?.to_owned();
    let figures = match status.has_figures() {
        true => Some((r.u64()?, r.u64()?)),
        false => None,
    };
    Ok(Failure {
        status,
        message,
        figures,
    })
}

/// HELLO's reply: the protocol version (refused unless ours), capacity, inline limit, segments.
fn decode_hello(r: &mut Reader<'_>) -> Result<Reply, DecodeError> {
    let version = r.u16()?;
    if version != u16::from(VERSION) {
        return Err(DecodeError::UnsupportedVersion(version));
    }
    let capacity = r.u64()?;
    let max_inline = r.u32()?;
    let n = r.count(12)?;
    let segments = (0..n)
        .map(|_| Ok((r.u32()?, r.u64()?)))
        .collect::<Result<_, DecodeError>>()?;
    Ok(Reply::Hello {
        capacity,
        max_inline,
        segments,
    })
}

/// A reply's `u32 n` entries, one per name the request named, each decoded by `entry` (the
/// reader and that name), in order.
fn per_name<S: AsRef<str>, T>(
    r: &mut Reader<'_>,
    names: &[S],
    mut entry: impl FnMut(&mut Reader<'_>, &str) -> Result<T, DecodeError>,
) -> Result<Vec<T>, DecodeError> {
    let n = r.count(1)?;
    if n != names.len() {
        return Err(DecodeError::NameCount {
            asked: names.len(),
            got: n,
        });
    }
    names.iter().map(|name| entry(r, name.as_ref())).collect()
}

/// GET's reply: one present flag (and object) per name asked, in order.
fn decode_objects<S: AsRef<str>>(r: &mut Reader<'_>, names: &[S]) -> Result<Reply, DecodeError> {
    let objects = per_name(r, names, |r, name| match r.u8()? {
        0 => Ok(None),
        _ => r.object(name).map(Some),
    })?;
    Ok(Reply::Objects(objects))
}

/// PUBLISH_MANY's reply: one result per object published, in order (an objref, or a failure
/// as an error reply's body).
fn decode_published<S: AsRef<str>>(r: &mut Reader<'_>, names: &[S]) -> Result<Reply, DecodeError> {
    let results = per_name(r, names, |r, name| match r.u8()? {
        STATUS_OK => r.object(name).map(Ok),
        status => decode_failure(status, r).map(Err),
    })?;
    Ok(Reply::Published(results))
}

/// LIST's `state` byte: bit 0 sealed, bit 1 spilled (on disk only). A decoder from before
/// spilling reads any non-zero byte as sealed, which a spilled object is.
const LIST_SEALED: u8 = 1;
const LIST_SPILLED: u8 = 2;

fn list_state(i: &ObjectInfo) -> u8 {
    (u8::from(i.sealed) * LIST_SEALED) | (u8::from(i.spilled) * LIST_SPILLED)
}

/// LIST's reply: a page of entries and where the next page starts.
fn decode_list(r: &mut Reader<'_>) -> Result<Reply, DecodeError> {
    let n = r.count(1)?;
    let mut entries = Vec::with_capacity(n);
    for _ in 0..n {
        let name = object_name(r.str()?)?;
        let id = ObjectId::from_raw(r.u64()?);
        let size = r.u64()?;
        let device = r.device()?;
        let state = r.u8()?;
        entries.push(ObjectInfo {
            name,
            id,
            size,
            device,
            sealed: state & LIST_SEALED != 0,
            spilled: state & LIST_SPILLED != 0,
            ephemeral: r.u8()? != 0,
            refcount: r.u32()?,
            last_access: UNIX_EPOCH + Duration::from_millis(r.u64()?),
            metadata: r.bytes()?.into(),
            version: r.u64()?,
        });
    }
    Ok(Reply::List {
        entries,
        next: r.u64()?,
    })
}

impl Reply {
    /// Decodes the payload of the reply to `request` (which names its objects).
    pub fn decode_for(request: &Request<'_>, payload: &[u8]) -> Result<Reply, DecodeError> {
        if let Request::PublishMany { items, .. } = request {
            let names: Vec<&str> = items.iter().map(|i| i.name.as_ref()).collect();
            return Reply::decode(request.opcode().code(), payload, &names);
        }
        let names: &[Cow<'_, str>] = match request {
            Request::Create { name, .. }
            | Request::Put { name, .. }
            | Request::Publish { name, .. } => std::slice::from_ref(name),
            Request::Get { names, .. } | Request::GetNewer { names, .. } => names,
            Request::Fetch(f) => std::slice::from_ref(&f.name),
            Request::Gather(g) => std::slice::from_ref(&g.into),
            _ => &[],
        };
        Reply::decode(request.opcode().code(), payload, names)
    }
}

impl Failure {
    /// The error reply for a store error.
    pub fn from_error(e: &vovp_types::Error) -> Failure {
        use vovp_types::Error as E;
        let status = match e {
            E::NotFound(_) => Status::NotFound,
            E::AlreadyExists(_) => Status::AlreadyExists,
            E::OutOfMemory {
                requested,
                available,
            } => {
                return Failure {
                    status: Status::OutOfMemory,
                    message: e.to_string(),
                    figures: Some((*requested, *available)),
                }
            }
            E::StaleVersion {
                current, requested, ..
            } => {
                return Failure {
                    status: Status::StaleVersion,
                    message: e.to_string(),
                    figures: Some((*current, *requested)),
                }
            }
            E::TooManyObjects { .. } => Status::TooManyObjects,
            E::NotSealed(_) => Status::NotSealed,
            E::AlreadySealed(_) => Status::AlreadySealed,
            E::NotCreator(_) => Status::NotCreator,
            E::InvalidName(_) => Status::InvalidName,
            E::MetadataTooLarge { .. } => Status::MetadataTooLarge,
            E::NotHeld(_) => Status::NotHeld,
            E::GpuUnavailable(_) => Status::GpuUnavailable,
            E::Gpu(_) => Status::GpuError,
            E::ShuttingDown => Status::ShuttingDown,
            E::TooLarge(_) => Status::TooLarge,
            E::Transfer(_) => Status::TransferFailed,
            E::Protocol(_) | E::Tensor(_) | E::Config(_) => Status::Malformed,
            E::Memory(_) | E::Connection(_) | E::Internal(_) => Status::Internal,
            E::SpillDamaged(_) => Status::SpillDamaged,
            // `Error` is non-exhaustive: a variant added without a status of its own travels
            // as an internal error, with its message, until PROTOCOL.md gives it one.
            _ => Status::Internal,
        };
        Failure {
            status,
            message: e.to_string(),
            figures: None,
        }
    }
}

/// The client side's view of an error reply.
impl From<Failure> for vovp_types::Error {
    fn from(f: Failure) -> Self {
        use vovp_types::Error as E;
        let Failure {
            status,
            message,
            figures,
        } = f;
        // Messages from the daemon are full sentences; keep them, the variant carries the
        // meaning. Fields the wire does not carry (a NOT_HELD id, METADATA_TOO_LARGE's length)
        // are in the message only.
        match status {
            Status::NotFound => E::NotFound(message),
            Status::AlreadyExists => E::AlreadyExists(message),
            Status::OutOfMemory => match figures {
                Some((requested, available)) => E::OutOfMemory {
                    requested,
                    available,
                },
                None => E::Protocol(format!("OUT_OF_MEMORY reply without its sizes: {message}")),
            },
            Status::TooManyObjects => E::TooManyObjects {
                limit: vovp_types::MAX_OBJECTS,
            },
            Status::NotSealed => E::NotSealed(message),
            Status::AlreadySealed => E::AlreadySealed(message),
            Status::NotCreator => E::NotCreator(message),
            Status::InvalidName => E::InvalidName(message),
            Status::MetadataTooLarge => E::MetadataTooLarge {
                len: 0,
                max: vovp_types::MAX_METADATA_LEN,
            },
            Status::NotHeld => E::NotHeld(0),
            Status::GpuUnavailable => E::GpuUnavailable(message),
            Status::GpuError => E::Gpu(message),
            Status::ShuttingDown => E::ShuttingDown,
            Status::TooLarge => E::TooLarge(message),
            Status::Internal => E::Internal(message),
            Status::TooManyConnections => E::Connection(message),
            Status::StaleVersion => match figures {
                // The message is the daemon's full sentence; the name is in it, not a field.
                Some((current, requested)) => E::StaleVersion {
                    name: message,
                    current,
                    requested,
                },
                None => E::Protocol(format!(
                    "STALE_VERSION reply without its versions: {message}"
                )),
            },
            Status::TransferFailed => E::Transfer(message),
            // The daemon's message is the error's Display: keep what it wraps.
            Status::SpillDamaged => {
                E::SpillDamaged(match message.strip_prefix("spilled object lost: ") {
                    Some(m) => m.to_owned(),
                    None => message,
                })
            }
            Status::Malformed
            | Status::UnsupportedVersion
            | Status::UnknownOpcode
            | Status::ProtocolState => E::Protocol(format!("{}: {message}", status.name())),
        }
    }
}
