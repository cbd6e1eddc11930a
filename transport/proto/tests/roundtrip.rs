//! Property: every message encodes to a frame whose header parses back and whose payload
//! decodes to the same message: every request, the reply of every opcode (and error replies
//! of every status), and notifications.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use proptest::prelude::*;
use vovp_proto::*;
use vovp_types::{
    Device, DeviceBlock, Location, Notification, NotificationKind, ObjectId, ObjectInfo,
    ObjectName, ObjectRef, StoreStats,
};

fn name() -> impl Strategy<Value = String> {
    // Unicode included; object names are 1..=256 bytes.
    "\\PC{1,40}".prop_filter("at most 256 bytes", |s| s.len() <= 256)
}

fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..max)
}

fn device() -> impl Strategy<Value = Device> {
    prop_oneof![Just(Device::Cpu), any::<u32>().prop_map(Device::Cuda)]
}

fn location(size: u64) -> impl Strategy<Value = Location> {
    prop_oneof![
        (any::<u32>(), any::<u64>())
            .prop_map(|(segment, offset)| Location::Host { segment, offset }),
        (
            any::<u32>(),
            any::<u32>(),
            any::<u64>(),
            prop::collection::vec(any::<u8>(), 64)
        )
            .prop_map(move |(device, pool, offset, handle)| {
                let mut ipc_handle = [0u8; 64];
                ipc_handle.copy_from_slice(&handle);
                Location::Cuda(DeviceBlock {
                    device,
                    pool,
                    ipc_handle,
                    offset,
                    size,
                })
            }),
    ]
}

/// An objref answering for `name`.
fn object(name: String) -> impl Strategy<Value = ObjectRef> {
    (any::<u64>(), any::<u64>(), bytes(64), any::<u64>()).prop_flat_map(
        move |(id, size, metadata, version)| {
            let name = name.clone();
            location(size).prop_map(move |location| ObjectRef {
                id: ObjectId::from_raw(id),
                name: ObjectName::new(&name).expect("valid name"),
                version,
                size,
                metadata: Arc::from(metadata.clone()),
                location,
            })
        },
    )
}

/// A request's flags (never [`PUT_VERSION`]: that bit is the `version` field's) and
/// explicit version.
fn flags_and_version() -> impl Strategy<Value = (u32, Option<u64>)> {
    (any::<u32>(), prop::option::of(any::<u64>()))
        .prop_map(|(flags, version)| (flags & !PUT_VERSION, version))
}

/// One object of a PUBLISH or PUBLISH_MANY.
fn publish_item() -> impl Strategy<Value = PublishItem<'static>> {
    (
        any::<u64>(),
        name(),
        flags_and_version(),
        bytes(64),
        any::<u64>(),
    )
        .prop_map(
            |(offset, name, (flags, version), metadata, size)| PublishItem {
                offset,
                name: Cow::Owned(name),
                flags,
                version,
                metadata: metadata.into(),
                size,
            },
        )
}

/// FETCH and GATHER.
fn transfer_request() -> impl Strategy<Value = Request<'static>> {
    let owned = |s: String| Cow::Owned(s);
    let base = (
        any::<u64>(),
        prop::collection::vec(any::<(u64, u64)>(), 0..6),
    )
        .prop_map(|(version, ranges)| FetchBase {
            version,
            ranges: ranges.into(),
        });
    prop_oneof![
        (
            name(),
            any::<u64>(),
            "\\PC{0,30}",
            any::<u16>(),
            any::<i64>(),
            prop::option::of(base)
        )
            .prop_map(move |(n, version, source, streams, timeout_ms, base)| {
                Request::Fetch(Fetch {
                    name: owned(n),
                    version,
                    source: owned(source),
                    streams,
                    timeout_ms,
                    base,
                })
            }),
        (
            (name(), any::<u64>(), "\\PC{0,30}"),
            any::<u64>(),
            any::<i64>(),
            name(),
            prop::collection::vec(any::<u64>(), 0..16)
        )
            .prop_map(
                move |((n, version, source), row_bytes, timeout_ms, into, ids)| {
                    Request::Gather(Gather {
                        name: owned(n),
                        version,
                        source: owned(source),
                        row_bytes,
                        timeout_ms,
                        into: owned(into),
                        ids: ids.into(),
                    })
                }
            ),
        Just(Request::TransferInfo),
    ]
}

fn request() -> impl Strategy<Value = Request<'static>> {
    let owned = |s: String| Cow::Owned(s);
    prop_oneof![
        transfer_request(),
        any::<u32>().prop_map(|pid| Request::Hello { pid }),
        (
            name(),
            any::<u64>(),
            flags_and_version(),
            device(),
            bytes(64)
        )
            .prop_map(move |(n, size, (flags, version), device, metadata)| {
                Request::Create {
                    name: owned(n),
                    size,
                    flags,
                    version,
                    device,
                    metadata: metadata.into(),
                }
            }),
        name().prop_map(move |n| Request::Seal { name: owned(n) }),
        name().prop_map(move |n| Request::Abort { name: owned(n) }),
        (name(), flags_and_version(), bytes(64), bytes(512)).prop_map(
            move |(n, (flags, version), m, d)| Request::Put {
                name: owned(n),
                flags,
                version,
                metadata: m.into(),
                data: d.into(),
            }
        ),
        (any::<i64>(), prop::collection::vec(name(), 0..8)).prop_map(move |(timeout_ms, names)| {
            Request::Get {
                timeout_ms,
                names: names.into_iter().map(owned).collect(),
            }
        }),
        (
            any::<i64>(),
            prop::collection::vec((name(), any::<u64>()), 0..8)
        )
            .prop_map(move |(timeout_ms, asked)| {
                let (names, newer_than): (Vec<String>, Vec<u64>) = asked.into_iter().unzip();
                Request::GetNewer {
                    timeout_ms,
                    names: names.into_iter().map(owned).collect(),
                    newer_than,
                }
            }),
        prop::collection::vec(any::<u64>(), 0..16)
            .prop_map(|ids| Request::Release { ids: ids.into() }),
        name().prop_map(move |n| Request::Contains { name: owned(n) }),
        name().prop_map(move |n| Request::Delete { name: owned(n) }),
        (any::<u64>(), 1..=MAX_LIST_PAGE_ENTRIES)
            .prop_map(|(start, limit)| Request::List { start, limit }),
        any::<u64>().prop_map(|bytes| Request::Evict { bytes }),
        (STATS_FIELDS_FIRST as u32..=STATS_FIELDS.len() as u32)
            .prop_map(|fields| Request::Stats { fields }),
        Just(Request::Subscribe),
        any::<u32>().prop_map(|id| Request::Segment { id }),
        Just(Request::Shared),
        (any::<u64>(), any::<u32>())
            .prop_map(|(at_least, flags)| Request::Lend { at_least, flags }),
        (any::<u64>(), publish_item()).prop_map(|(lend, item)| Request::Publish {
            lend,
            offset: item.offset,
            name: item.name,
            flags: item.flags,
            version: item.version,
            metadata: item.metadata,
            size: item.size,
        }),
        (any::<u64>(), prop::collection::vec(publish_item(), 0..6))
            .prop_map(|(lend, items)| Request::PublishMany { lend, items }),
    ]
}

fn info() -> impl Strategy<Value = ObjectInfo> {
    (
        name(),
        any::<u64>(),
        any::<u64>(),
        device(),
        any::<(bool, bool, u32)>(),
        0u64..(1 << 50),
        (bytes(64), any::<u64>(), any::<bool>()),
    )
        .prop_map(
            |(
                n,
                id,
                size,
                device,
                (sealed, ephemeral, refcount),
                ms,
                (metadata, version, spilled),
            )| {
                ObjectInfo {
                    spilled,
                    version,
                    id: ObjectId::from_raw(id),
                    name: ObjectName::new(&n).expect("valid name"),
                    size,
                    device,
                    sealed,
                    ephemeral,
                    refcount,
                    last_access: UNIX_EPOCH + Duration::from_millis(ms),
                    metadata: metadata.into(),
                }
            },
        )
}

fn failure() -> impl Strategy<Value = Reply> {
    (
        prop::sample::select(Status::ALL),
        "\\PC{0,80}",
        any::<(u64, u64)>(),
    )
        .prop_map(|(status, message, sizes)| {
            Reply::Failure(Failure {
                status,
                message,
                figures: status.has_figures().then_some(sizes),
            })
        })
}

/// A reply, the opcode of the request it answers, and the names that request asked for.
fn reply() -> impl Strategy<Value = (Reply, Opcode, Vec<String>)> {
    const EMPTY_OPS: [Opcode; 4] = [
        Opcode::Abort,
        Opcode::Release,
        Opcode::Delete,
        Opcode::Subscribe,
    ];
    prop_oneof![
        prop::sample::select(&EMPTY_OPS[..]).prop_map(|op| (Reply::Empty, op, vec![])),
        (
            any::<u64>(),
            any::<u32>(),
            prop::collection::vec(any::<(u32, u64)>(), 0..4)
        )
            .prop_map(|(capacity, max_inline, segments)| (
                Reply::Hello {
                    capacity,
                    max_inline,
                    segments
                },
                Opcode::Hello,
                vec![]
            )),
        (
            name(),
            prop::sample::select(
                &[
                    Opcode::Create,
                    Opcode::Put,
                    Opcode::Publish,
                    Opcode::Fetch,
                    Opcode::Gather
                ][..]
            )
        )
            .prop_flat_map(|(n, op)| object(n.clone()).prop_map(move |r| (
                Reply::Object(r),
                op,
                vec![n.clone()]
            ))),
        prop::collection::vec((name(), any::<bool>()), 0..6).prop_flat_map(|asked| {
            let names: Vec<String> = asked.iter().map(|(n, _)| n.clone()).collect();
            let found: Vec<_> = asked
                .into_iter()
                .map(|(n, found)| {
                    if found {
                        object(n).prop_map(Some).boxed()
                    } else {
                        Just(None).boxed()
                    }
                })
                .collect();
            (
                found,
                prop::sample::select(&[Opcode::Get, Opcode::GetNewer][..]),
            )
                .prop_map(move |(v, op)| (Reply::Objects(v), op, names.clone()))
        }),
        prop::collection::vec((name(), any::<bool>(), failure()), 0..6).prop_flat_map(|asked| {
            let names: Vec<String> = asked.iter().map(|(n, _, _)| n.clone()).collect();
            let results: Vec<_> = asked
                .into_iter()
                .map(|(n, ok, f)| match (ok, f) {
                    (true, _) => object(n).prop_map(Ok).boxed(),
                    (false, Reply::Failure(f)) => Just(Err(f)).boxed(),
                    (false, other) => unreachable!("failure() made {other:?}"),
                })
                .collect();
            results.prop_map(move |v| (Reply::Published(v), Opcode::PublishMany, names.clone()))
        }),
        any::<u64>().prop_map(|v| (Reply::Version(v), Opcode::Seal, vec![])),
        any::<bool>().prop_map(|b| (Reply::Bool(b), Opcode::Contains, vec![])),
        ".*".prop_map(|text| (Reply::Metrics(text), Opcode::Metrics, vec![])),
        (
            "\\PC{0,40}",
            prop::collection::vec(("[a-z_]{1,20}", any::<u64>()), 0..6)
        )
            .prop_map(|(address, counters)| (
                Reply::TransferInfo { address, counters },
                Opcode::TransferInfo,
                vec![]
            )),
        any::<u64>().prop_map(|n| (Reply::Count(n), Opcode::Evict, vec![])),
        (prop::collection::vec(info(), 0..4), any::<u64>()).prop_map(|(entries, next)| (
            Reply::List { entries, next },
            Opcode::List,
            vec![]
        )),
        (
            prop::collection::vec(any::<u64>(), STATS_FIELDS.len()),
            STATS_FIELDS_FIRST..=STATS_FIELDS.len()
        )
            .prop_map(|(f, n)| {
                // The first `n` fields travel; the others stay 0 on both sides.
                let mut s = (StoreStats::default(), 0);
                for ((_, field), v) in STATS_FIELDS[..n].iter().zip(&f) {
                    *field(&mut s) = *v;
                }
                (
                    Reply::Stats {
                        stats: s.0,
                        connections: s.1,
                        fields: n as u32,
                    },
                    Opcode::Stats,
                    vec![],
                )
            }),
        (any::<u64>(), any::<bool>()).prop_map(|(size, writable)| (
            Reply::Segment { size, writable },
            Opcode::Segment,
            vec![]
        )),
        any::<bool>().prop_map(|published| (Reply::Shared { published }, Opcode::Shared, vec![])),
        prop::collection::vec(any::<u64>(), 5).prop_map(|f| (
            Reply::Lent(vovp_types::Lend {
                id: f[0],
                segment: f[1] as u32,
                offset: f[2],
                size: f[3],
                max_object: f[4],
            }),
            Opcode::Lend,
            vec![]
        )),
        (failure(), prop::sample::select(Opcode::ALL)).prop_map(|(f, op)| (f, op, vec![])),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn requests_round_trip(req in request(), flags in any::<u16>(), id in any::<u64>()) {
        let mut buf = Vec::new();
        req.encode(flags, id, &mut buf);
        let h = Header::parse(&buf).unwrap().unwrap();
        prop_assert_eq!(h.frame_len(), buf.len());
        prop_assert_eq!((h.version, h.opcode, h.flags, h.request_id), (VERSION, req.opcode().code(), flags, id));
        let back = Request::decode(h.opcode, &buf[HEADER_LEN..]).unwrap();
        prop_assert_eq!(&back, &req);
        // Kept past the buffer, it is still the same request.
        prop_assert_eq!(back.into_owned(), req);
    }

    #[test]
    fn replies_round_trip((reply, op, names) in reply(), id in any::<u64>()) {
        let mut buf = Vec::new();
        reply.encode(op.code(), id, &mut buf);
        let h = Header::parse(&buf).unwrap().unwrap();
        prop_assert_eq!(h.frame_len(), buf.len());
        prop_assert_eq!((h.opcode, h.request_id), (op.code() | REPLY_BIT, id));
        let back = Reply::decode(h.opcode & !REPLY_BIT, &buf[HEADER_LEN..], &names).unwrap();
        prop_assert_eq!(back, reply);
    }

    #[test]
    fn notifications_round_trip(
        kind in prop::sample::select(&[NotificationKind::Sealed, NotificationKind::Deleted, NotificationKind::Evicted, NotificationKind::Replaced][..]),
        n in name(),
        size in any::<u64>(),
        metadata in bytes(64),
        version in any::<u64>(),
    ) {
        let note = Notification { kind, name: ObjectName::new(&n).unwrap(), size, metadata: metadata.into(), version };
        let mut buf = Vec::new();
        encode_notification(&note, &mut buf);
        let h = Header::parse(&buf).unwrap().unwrap();
        prop_assert_eq!((h.opcode, h.request_id, h.frame_len()), (Opcode::Notify.code(), 0, buf.len()));
        prop_assert_eq!(decode_notification(&buf[HEADER_LEN..]).unwrap(), note);
    }

    /// A reply decoded by the request it answers (the client's way) is the same reply.
    #[test]
    fn replies_decode_for_their_request(n in name(), size in any::<u64>()) {
        let req = Request::Create { name: n.as_str().into(), size, flags: 0, version: None, device: Device::Cpu, metadata: Cow::Borrowed(&[]) };
        let r = ObjectRef { id: ObjectId::from_raw(1), name: ObjectName::new(&n).unwrap(), size, metadata: Arc::from(&b""[..]), location: Location::Host { segment: 3, offset: 64 }, version: 5 };
        let mut buf = Vec::new();
        Reply::Object(r.clone()).encode(Opcode::Create.code(), 9, &mut buf);
        prop_assert_eq!(Reply::decode_for(&req, &buf[HEADER_LEN..]).unwrap(), Reply::Object(r));
    }

    /// The put options survive the wire: one mapping each way, every flag its own bit.
    #[test]
    fn put_options_round_trip_through_their_flags(
        ephemeral in any::<bool>(),
        replace in any::<bool>(),
        keep_reference in any::<bool>(),
        pipelined in any::<bool>(),
    ) {
        let options = vovp_types::PutOptions { ephemeral, device: None, replace, keep_reference, pipelined, version: None };
        let flags = put_flags(&options);
        prop_assert_eq!(put_options(flags, None), options);
        prop_assert_eq!(flags.count_ones(), [ephemeral, replace, keep_reference, pipelined].iter().filter(|b| **b).count() as u32);
        // A CREATE sends the create flags only.
        prop_assert_eq!(create_flags(&options), flags & (CREATE_EPHEMERAL | CREATE_REPLACE));
    }
}
