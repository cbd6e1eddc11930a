//! Requests (client to daemon). Each variant's encoding and decoding are the same arm of two
//! matches in the same order, fields in PROTOCOL.md's order.

use std::borrow::Cow;

use vovp_types::Device;

use crate::wire::{FrameWriter, Reader};
use crate::{
    DecodeError, Opcode, LIST_PAGE_ENTRIES, MAX_GET_NAMES, MAX_LIST_PAGE_ENTRIES, MAX_PUBLISH_MANY,
    PUT_VERSION,
};

/// Writes CREATE's, PUT's or PUBLISH's `flags`, and after them the explicit `version` when
/// there is one: the [`PUT_VERSION`] bit says so (set here from `version`, whatever `flags`
/// says), so a request without a version is byte for byte what it was before versions could
/// be given.
fn versioned_flags<'w, 'b>(
    w: &'w mut FrameWriter<'b>,
    flags: u32,
    version: Option<u64>,
) -> &'w mut FrameWriter<'b> {
    match version {
        Some(v) => w.u32(flags | PUT_VERSION).u64(v),
        None => w.u32(flags & !PUT_VERSION),
    }
}

/// [`versioned_flags`] read back: the flags without [`PUT_VERSION`], and the version.
fn read_versioned_flags(r: &mut Reader<'_>) -> Result<(u32, Option<u64>), DecodeError> {
    let flags = r.u32()?;
    let version = match flags & PUT_VERSION {
        0 => None,
        _ => Some(r.u64()?),
    };
    Ok((flags & !PUT_VERSION, version))
}

/// One request. Fields borrow where they can: the client encodes its caller's names and bytes
/// without copying them, and the daemon decodes straight out of its input buffer (then
/// [`Request::into_owned`] to keep one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request<'a> {
    Hello {
        pid: u32,
    },
    Create {
        name: Cow<'a, str>,
        size: u64,
        flags: u32,
        /// The explicit version to seal as ([`vovp_types::PutOptions::version`]); on the
        /// wire, the [`PUT_VERSION`] flag and a `u64` after the flags.
        version: Option<u64>,
        device: Device,
        metadata: Cow<'a, [u8]>,
    },
    Seal {
        name: Cow<'a, str>,
    },
    Abort {
        name: Cow<'a, str>,
    },
    /// An inline put: the data rides in the frame.
    Put {
        name: Cow<'a, str>,
        flags: u32,
        /// As CREATE's `version`.
        version: Option<u64>,
        metadata: Cow<'a, [u8]>,
        data: Cow<'a, [u8]>,
    },
    /// `timeout_ms`: -1 waits forever, 0 not at all.
    Get {
        timeout_ms: i64,
        names: Vec<Cow<'a, str>>,
    },
    /// GET of versions newer than those given: `names[i]` is found once its version is
    /// greater than `newer_than[i]` (0: any sealed version, as GET). Same lengths.
    GetNewer {
        timeout_ms: i64,
        names: Vec<Cow<'a, str>>,
        newer_than: Vec<u64>,
    },
    Release {
        ids: Cow<'a, [u64]>,
    },
    Contains {
        name: Cow<'a, str>,
    },
    Delete {
        name: Cow<'a, str>,
    },
    /// One page of the object list, from cursor `start` (0: the beginning). Decoded, `limit`
    /// is what the daemon serves: 0 (and an empty payload) is [`LIST_PAGE_ENTRIES`], and it is
    /// at most [`MAX_LIST_PAGE_ENTRIES`].
    List {
        start: u64,
        limit: u32,
    },
    Evict {
        bytes: u64,
    },
    /// The store's counters: the first `fields` of [`crate::STATS_FIELDS`] (at least
    /// [`crate::STATS_FIELDS_FIRST`], at most every one the daemon knows). On the wire an empty
    /// payload asks for the first [`crate::STATS_FIELDS_FIRST`] (what clients before spilling
    /// sent and read), so every client gets no field it cannot read.
    Stats {
        fields: u32,
    },
    Subscribe,
    /// The fd of a segment this client does not have mapped yet.
    Segment {
        id: u32,
    },
    /// The shared directory (read-only fd) and this connection's hold table (read-write fd),
    /// for gets without a message.
    Shared,
    /// A part of this client's own arena to create objects in without a message; the
    /// previous lend of the same kind, if any, takes no more objects. `flags`: [`LEND_SMALL`]
    /// for the small-object lend (apart from the big one).
    ///
    /// [`LEND_SMALL`]: crate::LEND_SMALL
    Lend {
        at_least: u64,
        flags: u32,
    },
    /// Seals the bytes this client wrote at `offset` of its lend `lend` as object `name`
    /// (create + seal in one message, no data in the frame). `flags` as PUT's.
    Publish {
        lend: u64,
        offset: u64,
        name: Cow<'a, str>,
        flags: u32,
        /// As CREATE's `version`.
        version: Option<u64>,
        metadata: Cow<'a, [u8]>,
        size: u64,
    },
    /// PUBLISH of several objects from one lend in one message, each as its own PUBLISH would
    /// be, in order; the reply has one result per object (one failing fails no other).
    PublishMany {
        lend: u64,
        items: Vec<PublishItem<'a>>,
    },
    /// The daemon's metrics, as the Prometheus text its `--metrics` endpoint serves (what
    /// `vovp top` shows: request rates and latencies are not in STATS).
    Metrics,
    /// The address this engine serves transfers at (`--transfer`), empty when it serves none.
    TransferInfo,
    /// Copy `name` at `version` from the engine whose transfer port is `source` into this
    /// store, sealed as exactly that version (see [`Fetch`]).
    Fetch(Fetch<'a>),
    /// Rows of `name` at `version`, held by the engine at `source`, gathered into a new
    /// ephemeral object `into` (see [`Gather`]).
    Gather(Gather<'a>),
}

/// FETCH's fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetch<'a> {
    pub name: Cow<'a, str>,
    /// The version wanted (at least 1): what the object is sealed as here.
    pub version: u64,
    /// The holder engine's transfer address, `ip:port`.
    pub source: Cow<'a, str>,
    /// Parallel TCP streams at most (0: the engine's choice by size).
    pub streams: u16,
    /// How long the whole transfer may take; 0 or negative: the engine's default.
    pub timeout_ms: i64,
    /// A version of `name` this store holds, whose `ranges` are copied locally instead of
    /// fetched (the ranges that did not change; the rest comes from `source`).
    pub base: Option<FetchBase<'a>>,
}

/// The local part of a [`Fetch`]: what is copied from an older version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchBase<'a> {
    pub version: u64,
    /// `(offset, len)` byte ranges, the same offsets in the old and the new object.
    pub ranges: Cow<'a, [(u64, u64)]>,
}

/// GATHER's fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gather<'a> {
    pub name: Cow<'a, str>,
    pub version: u64,
    pub source: Cow<'a, str>,
    /// Bytes of one row: row `i` is bytes `i * row_bytes ..` of the object.
    pub row_bytes: u64,
    pub timeout_ms: i64,
    /// The name of the result: an ephemeral object of `ids.len() * row_bytes` bytes.
    pub into: Cow<'a, str>,
    /// Rows in the order wanted (repeats allowed).
    pub ids: Cow<'a, [u64]>,
}

/// Most ranges a FETCH's base may name (defined with every other limit, in `vovp-types`).
pub use vovp_types::transfer::MAX_FETCH_RANGES;

impl Fetch<'_> {
    fn into_owned(self) -> Fetch<'static> {
        Fetch {
            name: Cow::Owned(self.name.into_owned()),
            version: self.version,
            source: Cow::Owned(self.source.into_owned()),
            streams: self.streams,
            timeout_ms: self.timeout_ms,
            base: self.base.map(|b| FetchBase {
                version: b.version,
                ranges: Cow::Owned(b.ranges.into_owned()),
            }),
        }
    }
}

impl Gather<'_> {
    fn into_owned(self) -> Gather<'static> {
        Gather {
            name: Cow::Owned(self.name.into_owned()),
            version: self.version,
            source: Cow::Owned(self.source.into_owned()),
            row_bytes: self.row_bytes,
            timeout_ms: self.timeout_ms,
            into: Cow::Owned(self.into.into_owned()),
            ids: Cow::Owned(self.ids.into_owned()),
        }
    }
}

/// One object of a [`Request::PublishMany`]: PUBLISH's fields but the lend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishItem<'a> {
    pub offset: u64,
    pub name: Cow<'a, str>,
    pub flags: u32,
    /// As CREATE's `version`.
    pub version: Option<u64>,
    pub metadata: Cow<'a, [u8]>,
    pub size: u64,
}

/// The fewest bytes a [`PublishItem`] takes on the wire (offset, a one-byte name, flags,
/// empty metadata, size): what a count of them is checked against.
const PUBLISH_ITEM_MIN: usize = 8 + 3 + 4 + 4 + 8;

impl PublishItem<'_> {
    fn into_owned(self) -> PublishItem<'static> {
        PublishItem {
            offset: self.offset,
            name: Cow::Owned(self.name.into_owned()),
            flags: self.flags,
            version: self.version,
            metadata: Cow::Owned(self.metadata.into_owned()),
            size: self.size,
        }
    }
}

impl Request<'_> {
    pub fn opcode(&self) -> Opcode {
        match self {
            Request::Hello { .. } => Opcode::Hello,
            Request::Create { .. } => Opcode::Create,
            Request::Seal { .. } => Opcode::Seal,
            Request::Abort { .. } => Opcode::Abort,
            Request::Put { .. } => Opcode::Put,
            Request::Get { .. } => Opcode::Get,
            Request::GetNewer { .. } => Opcode::GetNewer,
            Request::Release { .. } => Opcode::Release,
            Request::Contains { .. } => Opcode::Contains,
            Request::Delete { .. } => Opcode::Delete,
            Request::List { .. } => Opcode::List,
            Request::Evict { .. } => Opcode::Evict,
            Request::Stats { .. } => Opcode::Stats,
            Request::Subscribe => Opcode::Subscribe,
            Request::Segment { .. } => Opcode::Segment,
            Request::Shared => Opcode::Shared,
            Request::Lend { .. } => Opcode::Lend,
            Request::Publish { .. } => Opcode::Publish,
            Request::PublishMany { .. } => Opcode::PublishMany,
            Request::Metrics => Opcode::Metrics,
            Request::TransferInfo => Opcode::TransferInfo,
            Request::Fetch(_) => Opcode::Fetch,
            Request::Gather(_) => Opcode::Gather,
        }
    }

    /// Appends this request as one frame.
    pub fn encode(&self, flags: u16, request_id: u64, buf: &mut Vec<u8>) {
        let mut w = FrameWriter::begin(buf, self.opcode().code(), flags, request_id);
        match self {
            Request::Hello { pid } => {
                w.u32(*pid);
            }
            Request::Create {
                name,
                size,
                flags,
                version,
                device,
                metadata,
            } => {
                w.str(name).u64(*size);
                versioned_flags(&mut w, *flags, *version).device(*device);
                w.bytes(metadata);
            }
            Request::Seal { name }
            | Request::Abort { name }
            | Request::Contains { name }
            | Request::Delete { name } => {
                w.str(name);
            }
            Request::Put {
                name,
                flags,
                version,
                metadata,
                data,
            } => {
                w.str(name);
                versioned_flags(&mut w, *flags, *version).bytes(metadata);
                w.u64(data.len() as u64).raw(data);
            }
            Request::Get { timeout_ms, names } => {
                w.i64(*timeout_ms).count(names.len());
                for n in names {
                    w.str(n);
                }
            }
            Request::GetNewer {
                timeout_ms,
                names,
                newer_than,
            } => {
                w.i64(*timeout_ms).count(names.len());
                for (n, v) in names.iter().zip(newer_than) {
                    w.str(n).u64(*v);
                }
            }
            Request::Release { ids } => {
                w.count(ids.len());
                for id in ids.iter() {
                    w.u64(*id);
                }
            }
            Request::List { start, limit } => {
                w.u64(*start).u32(*limit);
            }
            Request::Evict { bytes } => {
                w.u64(*bytes);
            }
            Request::Stats { fields } => {
                if *fields as usize != crate::STATS_FIELDS_FIRST {
                    w.u32(*fields);
                }
            }
            Request::Segment { id } => {
                w.u32(*id);
            }
            Request::Lend { at_least, flags } => {
                w.u64(*at_least).u32(*flags);
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
                w.u64(*lend).u64(*offset).str(name);
                versioned_flags(&mut w, *flags, *version);
                w.bytes(metadata).u64(*size);
            }
            Request::PublishMany { lend, items } => {
                w.u64(*lend).count(items.len());
                for i in items {
                    w.u64(i.offset).str(&i.name);
                    versioned_flags(&mut w, i.flags, i.version);
                    w.bytes(&i.metadata).u64(i.size);
                }
            }
            Request::Fetch(f) => {
                w.str(&f.name).u64(f.version).str(&f.source).u16(f.streams);
                w.i64(f.timeout_ms);
                match &f.base {
                    None => {
                        w.u8(0);
                    }
                    Some(b) => {
                        w.u8(1).u64(b.version).count(b.ranges.len());
                        for (offset, len) in b.ranges.iter() {
                            w.u64(*offset).u64(*len);
                        }
                    }
                }
            }
            Request::Gather(g) => {
                w.str(&g.name)
                    .u64(g.version)
                    .str(&g.source)
                    .u64(g.row_bytes);
                w.i64(g.timeout_ms).str(&g.into).count(g.ids.len());
                for id in g.ids.iter() {
                    w.u64(*id);
                }
            }
            Request::Subscribe | Request::Shared | Request::Metrics | Request::TransferInfo => {}
        }
        w.finish();
    }

    /// Takes ownership of every field (to keep the request past its input buffer).
    pub fn into_owned(self) -> Request<'static> {
        let own = |s: Cow<'_, str>| Cow::Owned(s.into_owned());
        let own_bytes = |b: Cow<'_, [u8]>| Cow::Owned(b.into_owned());
        match self {
            Request::Hello { pid } => Request::Hello { pid },
            Request::Create {
                name,
                size,
                flags,
                version,
                device,
                metadata,
            } => Request::Create {
                name: own(name),
                size,
                flags,
                version,
                device,
                metadata: own_bytes(metadata),
            },
            Request::Seal { name } => Request::Seal { name: own(name) },
            Request::Abort { name } => Request::Abort { name: own(name) },
            Request::Put {
                name,
                flags,
                version,
                metadata,
                data,
            } => Request::Put {
                name: own(name),
                flags,
                version,
                metadata: own_bytes(metadata),
                data: own_bytes(data),
            },
            Request::Get { timeout_ms, names } => Request::Get {
                timeout_ms,
                names: names.into_iter().map(own).collect(),
            },
            Request::GetNewer {
                timeout_ms,
                names,
                newer_than,
            } => Request::GetNewer {
                timeout_ms,
                names: names.into_iter().map(own).collect(),
                newer_than,
            },
            Request::Release { ids } => Request::Release {
                ids: Cow::Owned(ids.into_owned()),
            },
            Request::Contains { name } => Request::Contains { name: own(name) },
            Request::Delete { name } => Request::Delete { name: own(name) },
            Request::List { start, limit } => Request::List { start, limit },
            Request::Evict { bytes } => Request::Evict { bytes },
            Request::Stats { fields } => Request::Stats { fields },
            Request::Subscribe => Request::Subscribe,
            Request::Segment { id } => Request::Segment { id },
            Request::Shared => Request::Shared,
            Request::Metrics => Request::Metrics,
            Request::TransferInfo => Request::TransferInfo,
            Request::Fetch(f) => Request::Fetch(f.into_owned()),
            Request::Gather(g) => Request::Gather(g.into_owned()),
            Request::Lend { at_least, flags } => Request::Lend { at_least, flags },
            Request::Publish {
                lend,
                offset,
                name,
                flags,
                version,
                metadata,
                size,
            } => Request::Publish {
                lend,
                offset,
                name: own(name),
                flags,
                version,
                metadata: own_bytes(metadata),
                size,
            },
            Request::PublishMany { lend, items } => Request::PublishMany {
                lend,
                items: items.into_iter().map(PublishItem::into_owned).collect(),
            },
        }
    }
}

impl<'a> Request<'a> {
    /// STATS of every field this build knows ([`crate::STATS_FIELDS`]).
    #[allow(clippy::cast_possible_truncation)] // a few dozen
    pub const STATS: Request<'static> = Request::Stats {
        fields: crate::STATS_FIELDS.len() as u32,
    };
    /// STATS of the fields every daemon has (an empty payload: what a daemon from before
    /// spilling understands).
    #[allow(clippy::cast_possible_truncation)]
    pub const STATS_FIRST: Request<'static> = Request::Stats {
        fields: crate::STATS_FIELDS_FIRST as u32,
    };

    /// Decodes the payload of a request frame with opcode `opcode`, borrowing from it.
    pub fn decode(opcode: u8, payload: &'a [u8]) -> Result<Request<'a>, DecodeError> {
        let op = Opcode::from_code(opcode).ok_or(DecodeError::UnknownOpcode(opcode))?;
        let mut r = Reader::new(payload);
        let name = |r: &mut Reader<'a>| r.name().map(Cow::Borrowed);
        let req = match op {
            Opcode::Hello => Request::Hello { pid: r.u32()? },
            Opcode::Create => {
                let name = name(&mut r)?;
                let size = r.u64()?;
                let (flags, version) = read_versioned_flags(&mut r)?;
                Request::Create {
                    name,
                    size,
                    flags,
                    version,
                    device: r.device()?,
                    metadata: Cow::Borrowed(r.bytes()?),
                }
            }
            Opcode::Seal => Request::Seal {
                name: name(&mut r)?,
            },
            Opcode::Abort => Request::Abort {
                name: name(&mut r)?,
            },
            Opcode::Put => {
                let name = name(&mut r)?;
                let (flags, version) = read_versioned_flags(&mut r)?;
                let metadata = Cow::Borrowed(r.bytes()?);
                let announced = r.u64()?;
                let data = r.rest();
                if data.len() as u64 != announced {
                    return Err(DecodeError::PutSize {
                        announced,
                        carried: data.len(),
                    });
                }
                Request::Put {
                    name,
                    flags,
                    version,
                    metadata,
                    data: Cow::Borrowed(data),
                }
            }
            Opcode::Get => {
                let timeout_ms = r.i64()?;
                let n = r.count(2)?;
                if n > MAX_GET_NAMES {
                    return Err(DecodeError::TooManyNames(n));
                }
                let names = (0..n).map(|_| name(&mut r)).collect::<Result<_, _>>()?;
                Request::Get { timeout_ms, names }
            }
            Opcode::GetNewer => {
                let timeout_ms = r.i64()?;
                let n = r.count(11)?;
                if n > MAX_GET_NAMES {
                    return Err(DecodeError::TooManyNames(n));
                }
                let mut names = Vec::with_capacity(n);
                let mut newer_than = Vec::with_capacity(n);
                for _ in 0..n {
                    names.push(name(&mut r)?);
                    newer_than.push(r.u64()?);
                }
                Request::GetNewer {
                    timeout_ms,
                    names,
                    newer_than,
                }
            }
            Opcode::Release => {
                let n = r.count(8)?;
                let ids = (0..n).map(|_| r.u64()).collect::<Result<Vec<_>, _>>()?;
                Request::Release {
                    ids: Cow::Owned(ids),
                }
            }
            Opcode::Contains => Request::Contains {
                name: name(&mut r)?,
            },
            Opcode::Delete => Request::Delete {
                name: name(&mut r)?,
            },
            // An empty payload (protocol 1's first form) is the first page.
            Opcode::List if payload.is_empty() => Request::List {
                start: 0,
                limit: LIST_PAGE_ENTRIES,
            },
            Opcode::List => {
                let start = r.u64()?;
                let limit = match r.u32()? {
                    0 => LIST_PAGE_ENTRIES,
                    n => n.min(MAX_LIST_PAGE_ENTRIES),
                };
                Request::List { start, limit }
            }
            Opcode::Evict => Request::Evict { bytes: r.u64()? },
            #[allow(clippy::cast_possible_truncation)] // a few dozen
            Opcode::Stats if payload.is_empty() => Request::Stats {
                fields: crate::STATS_FIELDS_FIRST as u32,
            },
            Opcode::Stats => Request::Stats { fields: r.u32()? },
            Opcode::Subscribe => Request::Subscribe,
            Opcode::Segment => Request::Segment { id: r.u32()? },
            Opcode::Shared => Request::Shared,
            Opcode::Metrics => Request::Metrics,
            Opcode::TransferInfo => Request::TransferInfo,
            Opcode::Fetch => {
                let name = name(&mut r)?;
                let version = r.u64()?;
                let source = Cow::Borrowed(r.str()?);
                let (streams, timeout_ms) = (r.u16()?, r.i64()?);
                let base = match r.u8()? {
                    0 => None,
                    tag @ 2.. => return Err(DecodeError::FetchBaseTag(tag)),
                    1 => {
                        let version = r.u64()?;
                        let n = r.count(16)?;
                        if n > MAX_FETCH_RANGES {
                            return Err(DecodeError::TooManyRanges(n));
                        }
                        let ranges =
                            (0..n)
                                .map(|_| Ok((r.u64()?, r.u64()?)))
                                .collect::<Result<Vec<_>, DecodeError>>()?;
                        Some(FetchBase {
                            version,
                            ranges: Cow::Owned(ranges),
                        })
                    }
                };
                Request::Fetch(Fetch {
                    name,
                    version,
                    source,
                    streams,
                    timeout_ms,
                    base,
                })
            }
            Opcode::Gather => {
                let object = name(&mut r)?;
                let version = r.u64()?;
                let source = Cow::Borrowed(r.str()?);
                let (row_bytes, timeout_ms) = (r.u64()?, r.i64()?);
                let into = name(&mut r)?;
                let n = r.count(8)?;
                let ids = (0..n).map(|_| r.u64()).collect::<Result<Vec<_>, _>>()?;
                Request::Gather(Gather {
                    name: object,
                    version,
                    source,
                    row_bytes,
                    timeout_ms,
                    into,
                    ids: Cow::Owned(ids),
                })
            }
            Opcode::Lend => Request::Lend {
                at_least: r.u64()?,
                flags: r.u32()?,
            },
            Opcode::Publish => {
                let (lend, offset, name) = (r.u64()?, r.u64()?, name(&mut r)?);
                let (flags, version) = read_versioned_flags(&mut r)?;
                Request::Publish {
                    lend,
                    offset,
                    name,
                    flags,
                    version,
                    metadata: Cow::Borrowed(r.bytes()?),
                    size: r.u64()?,
                }
            }
            Opcode::PublishMany => {
                let lend = r.u64()?;
                let n = r.count(PUBLISH_ITEM_MIN)?;
                if n > MAX_PUBLISH_MANY {
                    return Err(DecodeError::TooManyObjects(n));
                }
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    let (offset, name) = (r.u64()?, name(&mut r)?);
                    let (flags, version) = read_versioned_flags(&mut r)?;
                    items.push(PublishItem {
                        offset,
                        name,
                        flags,
                        version,
                        metadata: Cow::Borrowed(r.bytes()?),
                        size: r.u64()?,
                    });
                }
                Request::PublishMany { lend, items }
            }
            Opcode::Notify => return Err(DecodeError::NotARequest(opcode)),
        };
        r.finish()?;
        Ok(req)
    }
}
