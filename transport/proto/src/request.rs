//! Requests (client to daemon). Each variant's encoding and decoding are the same arm of two
//! matches in the same order, fields in PROTOCOL.md's order.

use std::borrow::Cow;

use vovp_types::Device;

use crate::wire::{FrameWriter, Reader};
use crate::{
    DecodeError, Opcode, LIST_PAGE_ENTRIES, MAX_GET_NAMES, MAX_LIST_PAGE_ENTRIES, MAX_PUBLISH_MANY,
};

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
}

/// One object of a [`Request::PublishMany`]: PUBLISH's fields but the lend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishItem<'a> {
    pub offset: u64,
    pub name: Cow<'a, str>,
    pub flags: u32,
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
                device,
                metadata,
            } => {
                w.str(name).u64(*size).u32(*flags).device(*device);
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
                metadata,
                data,
            } => {
                w.str(name).u32(*flags).bytes(metadata);
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
                metadata,
                size,
            } => {
                w.u64(*lend).u64(*offset).str(name).u32(*flags);
                w.bytes(metadata).u64(*size);
            }
            Request::PublishMany { lend, items } => {
                w.u64(*lend).count(items.len());
                for i in items {
                    w.u64(i.offset).str(&i.name).u32(i.flags);
                    w.bytes(&i.metadata).u64(i.size);
                }
            }
            Request::Subscribe | Request::Shared | Request::Metrics => {}
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
                device,
                metadata,
            } => Request::Create {
                name: own(name),
                size,
                flags,
                device,
                metadata: own_bytes(metadata),
            },
            Request::Seal { name } => Request::Seal { name: own(name) },
            Request::Abort { name } => Request::Abort { name: own(name) },
            Request::Put {
                name,
                flags,
                metadata,
                data,
            } => Request::Put {
                name: own(name),
                flags,
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
            Request::Lend { at_least, flags } => Request::Lend { at_least, flags },
            Request::Publish {
                lend,
                offset,
                name,
                flags,
                metadata,
                size,
            } => Request::Publish {
                lend,
                offset,
                name: own(name),
                flags,
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
            Opcode::Create => Request::Create {
                name: name(&mut r)?,
                size: r.u64()?,
                flags: r.u32()?,
                device: r.device()?,
                metadata: Cow::Borrowed(r.bytes()?),
            },
            Opcode::Seal => Request::Seal {
                name: name(&mut r)?,
            },
            Opcode::Abort => Request::Abort {
                name: name(&mut r)?,
            },
            Opcode::Put => {
                let name = name(&mut r)?;
                let flags = r.u32()?;
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
            Opcode::Lend => Request::Lend {
                at_least: r.u64()?,
                flags: r.u32()?,
            },
            Opcode::Publish => Request::Publish {
                lend: r.u64()?,
                offset: r.u64()?,
                name: name(&mut r)?,
                flags: r.u32()?,
                metadata: Cow::Borrowed(r.bytes()?),
                size: r.u64()?,
            },
            Opcode::PublishMany => {
                let lend = r.u64()?;
                let n = r.count(PUBLISH_ITEM_MIN)?;
                if n > MAX_PUBLISH_MANY {
                    return Err(DecodeError::TooManyObjects(n));
                }
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(PublishItem {
                        offset: r.u64()?,
                        name: name(&mut r)?,
                        flags: r.u32()?,
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
