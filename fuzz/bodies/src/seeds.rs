//! Helpers shared by the targets and the seed-corpus generator (`examples/gen_corpus.rs`):
//! a request's payload alone, raw frames, and the seed frames.

use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use vovp::{
    Device, DeviceBlock, Location, ObjectId, ObjectInfo, ObjectName, ObjectRef, StoreStats,
    MAX_NAME_LEN,
};
use vovp_proto::*;

/// The payload of `req` alone (no header).
pub fn request_payload(req: &Request<'_>) -> Vec<u8> {
    let mut buf = Vec::new();
    req.encode(0, 0, &mut buf);
    buf.split_off(HEADER_LEN)
}

/// A frame with a raw payload (for forged and malformed ones).
pub fn raw_frame(opcode: u8, flags: u16, request_id: u64, payload: &[u8]) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut w = FrameWriter::begin(&mut buf, opcode, flags, request_id);
    w.raw(payload);
    w.finish();
    buf
}

fn name(s: &str) -> ObjectName {
    ObjectName::new(s).expect("valid seed name")
}

fn host_object(n: &str, id: u64, size: u64, metadata: &[u8]) -> ObjectRef {
    ObjectRef {
        id: ObjectId::from_raw(id),
        name: name(n),
        size,
        metadata: Arc::from(metadata),
        location: Location::Host {
            segment: 0,
            offset: 64 * id,
        },
        version: id,
    }
}

/// Seed inputs for `client_session`: every call in turn, with shared reads and lends on and
/// off, against answers that are all well-formed (with sizes of 0, 1 and 2 pages, fds as
/// announced or half), all junk, or a mix.
pub fn client_session_seeds() -> Vec<(String, Vec<u8>)> {
    let calls: Vec<u8> = (0..8)
        .chain([0x10, 0x12, 0x15, 0x20, 0x22, 0x8F, 0x1F])
        .collect();
    let answers: [(&str, Vec<u8>); 5] = [
        ("zeros", vec![0; 256]),
        ("one-page", [0u8, 1, 1].repeat(96)),
        ("two-pages-whole-fds", [0u8, 2, 1, 1].repeat(64)),
        ("junk", (0..=255).collect()),
        ("mixed", (0..256u32).map(|i| (i * 37 % 251) as u8).collect()),
    ];
    let mut seeds = Vec::new();
    for flags in 0..4u8 {
        for (name, answer) in &answers {
            let mut input = vec![flags];
            input.extend_from_slice(&calls);
            // The body splits the input after its first half + 1 bytes.
            let pad = (answer.len() + 1).saturating_sub(input.len());
            input.extend(std::iter::repeat_n(4u8, pad));
            input.extend_from_slice(answer);
            seeds.push((format!("flags{flags}-{name}"), input));
        }
    }
    seeds
}

/// Seed inputs for `daemon_frames`: each valid request after a HELLO, the pipelined session,
/// and a few edge cases, each written in 1-byte, 33-byte and whole chunks (the first byte).
pub fn daemon_frames_seeds() -> Vec<(String, Vec<u8>)> {
    let mut hello = Vec::new();
    Request::Hello { pid: 1 }.encode(0, 1, &mut hello);
    let mut seeds = Vec::new();
    for (name, frames) in frame_decoder_seeds() {
        let greeted = name.starts_with("req-") && name != "req-hello";
        if !(greeted || name.starts_with("session") || name.starts_with("edge")) {
            continue; // replies: a daemon never reads them
        }
        for cut in [0u8, 8, 255] {
            let mut input = vec![cut];
            if greeted {
                input.extend_from_slice(&hello);
            }
            input.extend_from_slice(&frames);
            seeds.push((format!("{name}-cut{cut}"), input));
        }
    }
    seeds
}

/// Seed inputs for `frame_decoder`: (file name, bytes). Valid requests of every opcode, valid
/// replies of every kind, a pipelined session, and the edge cases a hostile peer sends.
pub fn frame_decoder_seeds() -> Vec<(String, Vec<u8>)> {
    let mut seeds: Vec<(String, Vec<u8>)> = Vec::new();
    let mut req = |file: &str, r: Request| {
        let mut buf = Vec::new();
        r.encode(0, 7, &mut buf);
        seeds.push((format!("req-{file}"), buf));
    };
    req("hello", Request::Hello { pid: 4242 });
    req(
        "create-cpu",
        Request::Create {
            name: "tensor/a".into(),
            size: 4096,
            flags: 0,
            version: None,
            device: Device::Cpu,
            metadata: b"dtype=f32".to_vec().into(),
        },
    );
    req(
        "create-cuda-ephemeral",
        Request::Create {
            name: "gpu".into(),
            size: 1 << 20,
            flags: CREATE_EPHEMERAL,
            version: None,
            device: Device::Cuda(1),
            metadata: Vec::new().into(),
        },
    );
    req(
        "create-huge",
        Request::Create {
            name: "huge".into(),
            size: u64::MAX,
            flags: 0,
            version: None,
            device: Device::Cpu,
            metadata: Vec::new().into(),
        },
    );
    req("seal", Request::Seal { name: "a".into() });
    req(
        "get-newer",
        Request::GetNewer {
            timeout_ms: 50,
            names: vec!["a".into(), "b".into()],
            newer_than: vec![0, 4],
        },
    );
    req("abort", Request::Abort { name: "a".into() });
    req(
        "put",
        Request::Put {
            name: "p".into(),
            flags: 0,
            version: None,
            metadata: b"m".to_vec().into(),
            data: (0..64).collect(),
        },
    );
    req(
        "put-keep-ephemeral",
        Request::Put {
            name: "ü-名".into(),
            flags: PUT_KEEP_REFERENCE | CREATE_EPHEMERAL,
            version: None,
            metadata: Vec::new().into(),
            data: Vec::new().into(),
        },
    );
    req(
        "get-none",
        Request::Get {
            timeout_ms: 0,
            names: Vec::new(),
        },
    );
    req(
        "get-three-wait",
        Request::Get {
            timeout_ms: 100,
            names: vec!["a".into(), "b".into(), "a".into()],
        },
    );
    req(
        "get-forever",
        Request::Get {
            timeout_ms: -1,
            names: vec!["x".into()],
        },
    );
    req(
        "release",
        Request::Release {
            ids: vec![1, 2, 3].into(),
        },
    );
    req(
        "release-none",
        Request::Release {
            ids: Vec::new().into(),
        },
    );
    req("contains", Request::Contains { name: "a".into() });
    req("delete", Request::Delete { name: "a".into() });
    req(
        "list-page",
        Request::List {
            start: 10,
            limit: 100,
        },
    );
    req("evict", Request::Evict { bytes: 1 << 20 });
    req("stats", Request::STATS_FIRST);
    req("subscribe", Request::Subscribe);
    req(
        "lend",
        Request::Lend {
            at_least: 1 << 16,
            flags: 0,
        },
    );
    req(
        "lend-small",
        Request::Lend {
            at_least: 128,
            flags: vovp_proto::LEND_SMALL,
        },
    );
    // A small put_tensor's: kept and pipelined, into the small lend.
    req(
        "publish-pipelined",
        Request::Publish {
            lend: 2,
            offset: 128,
            name: "small/a".into(),
            flags: vovp_proto::PUT_KEEP_REFERENCE | vovp_proto::PUT_PIPELINED,
            version: None,
            metadata: b"meta".to_vec().into(),
            size: 64,
        },
    );
    // A put_tensors batch's: several kept, pipelined puts in one message.
    req(
        "publish-many",
        Request::PublishMany {
            lend: 2,
            items: (0..3u64)
                .map(|i| vovp_proto::PublishItem {
                    offset: 128 * (i + 1),
                    name: format!("small/many-{i}").into(),
                    flags: vovp_proto::PUT_KEEP_REFERENCE | vovp_proto::PUT_PIPELINED,
                    version: None,
                    metadata: b"meta".to_vec().into(),
                    size: 64,
                })
                .collect(),
        },
    );
    req(
        "publish",
        Request::Publish {
            lend: 1,
            offset: 4096,
            name: "lent/a".into(),
            flags: 2,
            version: None,
            metadata: b"meta".to_vec().into(),
            size: 1 << 16,
        },
    );
    let long_name = "n".repeat(MAX_NAME_LEN + 1);
    req(
        "contains-long-name",
        Request::Contains {
            name: long_name.into(),
        },
    );

    // A pipelined session, the way a client sends it.
    let mut session = Vec::new();
    let mut id = 0;
    for r in [
        Request::Hello { pid: 1 },
        Request::Put {
            name: "s".into(),
            flags: 0,
            version: None,
            metadata: Vec::new().into(),
            data: vec![9; 16].into(),
        },
        Request::Get {
            timeout_ms: 0,
            names: vec!["s".into()],
        },
        Request::Release {
            ids: vec![1].into(),
        },
        Request::Delete { name: "s".into() },
        Request::STATS_FIRST,
    ] {
        id += 1;
        let flags = if matches!(r, Request::Release { .. }) {
            FLAG_NO_REPLY
        } else {
            0
        };
        r.encode(flags, id, &mut session);
    }
    seeds.push(("session-pipelined".into(), session.clone()));

    // Edge cases.
    let stats = raw_frame(Opcode::Stats.code(), 0, 1, &[]);
    let mut edge = |file: &str, bytes: Vec<u8>| seeds.push((format!("edge-{file}"), bytes));
    edge("empty", Vec::new());
    edge("header-truncated", stats[..10].to_vec());
    edge("session-truncated", session[..session.len() - 5].to_vec());
    let with_len = |len: u32| {
        let mut f = stats.clone();
        f[..4].copy_from_slice(&len.to_le_bytes());
        f
    };
    edge("length-below-header", with_len(11));
    edge("length-huge", with_len(u32::MAX));
    edge("length-max-allowed", with_len(12 + MAX_PAYLOAD as u32));
    edge("length-one-over-max", with_len(13 + MAX_PAYLOAD as u32));
    for v in [0u8, 2, 0xff] {
        let mut f = stats.clone();
        f[4] = v;
        edge(&format!("version-{v}"), f);
    }
    for opcode in [0x00u8, Opcode::Notify.code(), 0x7f] {
        edge(
            &format!("opcode-{opcode:#04x}"),
            raw_frame(opcode, 0, 1, &[]),
        );
    }
    let mut forged_get = 0i64.to_le_bytes().to_vec();
    forged_get.extend_from_slice(&u32::MAX.to_le_bytes());
    edge(
        "get-forged-count",
        raw_frame(Opcode::Get.code(), 0, 1, &forged_get),
    );
    // One name more than a GET may ask for, each of them real (1 byte).
    let mut too_many = 0i64.to_le_bytes().to_vec();
    too_many.extend_from_slice(&(MAX_GET_NAMES as u32 + 1).to_le_bytes());
    for _ in 0..=MAX_GET_NAMES {
        too_many.extend_from_slice(&[1, 0, b'x']);
    }
    edge(
        "get-too-many-names",
        raw_frame(Opcode::Get.code(), 0, 1, &too_many),
    );
    edge(
        "release-forged-count",
        raw_frame(
            Opcode::Release.code(),
            0,
            1,
            &[0xff, 0xff, 0xff, 0x7f, 1, 2, 3, 4],
        ),
    );
    edge(
        "release-no-reply",
        raw_frame(Opcode::Release.code(), FLAG_NO_REPLY, 1, &[0, 0, 0, 0]),
    );
    edge(
        "stats-no-reply",
        raw_frame(Opcode::Stats.code(), FLAG_NO_REPLY, 1, &[]),
    );
    let mut put = request_payload(&Request::Put {
        name: "p".into(),
        flags: 0,
        version: None,
        metadata: Vec::new().into(),
        data: vec![1; 8].into(),
    });
    put.push(0);
    edge(
        "put-size-mismatch",
        raw_frame(Opcode::Put.code(), 0, 1, &put),
    );
    edge(
        "seal-name-not-utf8",
        raw_frame(Opcode::Seal.code(), 0, 1, &[2, 0, 0xc3, 0x28]),
    );
    edge(
        "seal-name-empty",
        raw_frame(Opcode::Seal.code(), 0, 1, &[0, 0]),
    );
    edge(
        "seal-name-truncated",
        raw_frame(Opcode::Seal.code(), 0, 1, &[5, 0, b'a']),
    );
    edge(
        "stats-trailing",
        raw_frame(Opcode::Stats.code(), 0, 1, &[1]),
    );
    edge(
        "list-empty-payload",
        raw_frame(Opcode::List.code(), 0, 1, &[]),
    );
    let mut list_max = 0u64.to_le_bytes().to_vec();
    list_max.extend_from_slice(&u32::MAX.to_le_bytes());
    edge(
        "list-limit-max",
        raw_frame(Opcode::List.code(), 0, 1, &list_max),
    );
    // A CREATE of 8 host bytes without metadata, to forge one field of: its payload ends
    // with the device type (1 byte), the device index (4) and the metadata length (4).
    let small_create = request_payload(&Request::Create {
        name: "c".into(),
        size: 8,
        flags: 0,
        version: None,
        device: Device::Cpu,
        metadata: Vec::new().into(),
    });
    let mut create = small_create.clone();
    let device_type = create.len() - 9;
    create[device_type] = 3;
    edge(
        "create-bad-device",
        raw_frame(Opcode::Create.code(), 0, 1, &create),
    );
    let mut meta_forged = small_create;
    let at = meta_forged.len() - 4;
    meta_forged[at..].copy_from_slice(&u32::MAX.to_le_bytes());
    edge(
        "create-metadata-forged-length",
        raw_frame(Opcode::Create.code(), 0, 1, &meta_forged),
    );

    // Replies, as the daemon encodes them (the target decodes them as the client does).
    let mut reply = |file: &str, opcode: u8, r: Reply| {
        let mut buf = Vec::new();
        r.encode(opcode, 7, &mut buf);
        seeds.push((format!("reply-{file}"), buf));
    };
    reply(
        "create",
        Opcode::Create.code(),
        Reply::Object(host_object("x", 1, 100, b"md")),
    );
    reply(
        "put-cuda",
        Opcode::Put.code(),
        Reply::Object(ObjectRef {
            id: ObjectId::from_raw(2),
            name: name("x"),
            size: 512,
            metadata: Arc::from(&b""[..]),
            location: Location::Cuda(DeviceBlock {
                device: 0,
                pool: 3,
                ipc_handle: [0xab; 64],
                offset: 4096,
                size: 512,
            }),
            version: 7,
        }),
    );
    reply(
        "get",
        Opcode::Get.code(),
        Reply::Objects(vec![
            Some(host_object("x", 1, 10, b"")),
            None,
            Some(host_object("x", 3, 0, b"meta")),
        ]),
    );
    reply("contains", Opcode::Contains.code(), Reply::Bool(true));
    reply("evict", Opcode::Evict.code(), Reply::Count(12345));
    let info = |n: &str, id: u64, device: Device| ObjectInfo {
        id: ObjectId::from_raw(id),
        name: name(n),
        size: 64 * id,
        device,
        sealed: id.is_multiple_of(2),
        ephemeral: id.is_multiple_of(3),
        refcount: id as u32,
        last_access: UNIX_EPOCH + Duration::from_millis(1_700_000_000_000 + id),
        metadata: Arc::from(&b"m"[..]),
        version: id + 1,
        spilled: false,
    };
    reply(
        "list",
        Opcode::List.code(),
        Reply::List {
            entries: vec![
                info("a", 1, Device::Cpu),
                info("b", 2, Device::Cuda(0)),
                info("c", 3, Device::Cpu),
            ],
            next: LIST_END,
        },
    );
    reply(
        "stats",
        Opcode::Stats.code(),
        Reply::Stats {
            stats: StoreStats {
                capacity: 1 << 20,
                used_bytes: 4096,
                objects: 3,
                sealed: 2,
                unsealed: 1,
                references: 4,
                holders: 2,
                creates: 9,
                ..StoreStats::default()
            },
            connections: 2,
            fields: vovp_proto::STATS_FIELDS_FIRST as u32,
        },
    );
    reply("seal", Opcode::Seal.code(), Reply::Version(3));
    reply(
        "not-found",
        Opcode::Get.code(),
        Reply::error(Status::NotFound, "object \"x\" not found"),
    );
    reply(
        "out-of-memory",
        Opcode::Create.code(),
        Reply::Failure(Failure::from_error(&vovp::Error::OutOfMemory {
            requested: 1 << 30,
            available: 4096,
        })),
    );
    seeds
}
