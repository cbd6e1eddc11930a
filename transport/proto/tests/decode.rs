//! Decoding edge cases: bad headers, truncated and forged payloads, the GET and LIST bounds.

use vovp_proto::*;

fn frame(opcode: u8, payload: &[u8]) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut w = FrameWriter::begin(&mut buf, opcode, 0, 42);
    w.raw(payload);
    w.finish();
    buf
}

#[test]
fn headers_reject_bad_lengths_and_versions() {
    let buf = frame(Opcode::Stats.code(), &[]);
    let h = Header::parse(&buf).unwrap().unwrap();
    assert_eq!(
        (h.opcode, h.request_id, h.payload_len),
        (Opcode::Stats.code(), 42, 0)
    );
    assert!(Header::parse(&buf[..10]).unwrap().is_none());
    let mut bad = buf.clone();
    bad[4] = 9;
    let e = Header::parse(&bad).unwrap_err();
    assert_eq!(e, DecodeError::UnsupportedVersion(9));
    assert!(e.is_fatal());
    assert_eq!(e.status(), Status::UnsupportedVersion);
    let mut huge = buf.clone();
    huge[..4].copy_from_slice(&u32::MAX.to_le_bytes());
    let e = Header::parse(&huge).unwrap_err();
    assert!(matches!(e, DecodeError::FrameTooLarge(_)) && e.is_fatal());
    assert_eq!(e.status(), Status::TooLarge);
    let mut tiny = buf;
    tiny[..4].copy_from_slice(&3u32.to_le_bytes());
    assert_eq!(
        Header::parse(&tiny).unwrap_err(),
        DecodeError::LengthBelowHeader(3)
    );
}

#[test]
fn truncated_and_forged_payloads_are_malformed() {
    let e = Request::decode(Opcode::Seal.code(), &[5, 0, b'a']).unwrap_err();
    assert!(
        matches!(
            e,
            DecodeError::Truncated {
                need: 5,
                have: 1,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(e.status(), Status::Malformed);
    assert!(!e.is_fatal());
    // A count of 4 billion names in 8 bytes.
    let mut p = 0i64.to_le_bytes().to_vec();
    p.extend_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(
        Request::decode(Opcode::Get.code(), &p).unwrap_err(),
        DecodeError::ForgedCount(u32::MAX)
    );
    let e = Request::decode(0x77, &[]).unwrap_err();
    assert_eq!(
        (e.clone(), e.status()),
        (DecodeError::UnknownOpcode(0x77), Status::UnknownOpcode)
    );
    // NOTIFY is an opcode, but never a request.
    let e = Request::decode(Opcode::Notify.code(), &[]).unwrap_err();
    assert_eq!(e.status(), Status::UnknownOpcode);
    assert_eq!(
        Request::decode(Opcode::Subscribe.code(), &[1]).unwrap_err(),
        DecodeError::Trailing(1)
    );
    // STATS takes an optional field count, and nothing after it.
    assert!(matches!(
        Request::decode(Opcode::Stats.code(), &[1]).unwrap_err(),
        DecodeError::Truncated { .. }
    ));
    assert_eq!(
        Request::decode(Opcode::Stats.code(), &[24, 0, 0, 0, 1]).unwrap_err(),
        DecodeError::Trailing(1)
    );
    // A name that is not UTF-8 is INVALID_NAME, any other string MALFORMED.
    let e = Request::decode(Opcode::Seal.code(), &[2, 0, 0xc3, 0x28]).unwrap_err();
    assert_eq!(e.status(), Status::InvalidName);
    // PUT's data must be what it announces.
    let mut put = Vec::new();
    Request::Put {
        name: "p".into(),
        flags: 0,
        version: None,
        metadata: (&[][..]).into(),
        data: (&[1u8; 8][..]).into(),
    }
    .encode(0, 1, &mut put);
    put.push(0);
    assert_eq!(
        Request::decode(Opcode::Put.code(), &put[HEADER_LEN..]).unwrap_err(),
        DecodeError::PutSize {
            announced: 8,
            carried: 9
        }
    );
}

/// Regression (D3): a GET of millions of 1-byte names is refused before anything is built.
#[test]
fn get_names_are_bounded() {
    let n = MAX_GET_NAMES + 1;
    let mut p = 0i64.to_le_bytes().to_vec();
    p.extend_from_slice(&(n as u32).to_le_bytes());
    for _ in 0..n {
        p.extend_from_slice(&[1, 0, b'x']);
    }
    let e = Request::decode(Opcode::Get.code(), &p).unwrap_err();
    assert_eq!(e.status(), Status::TooLarge, "{e}");
    assert!(e.to_string().contains("16384"), "{e}");
    p.truncate(12);
    p[8..12].copy_from_slice(&(MAX_GET_NAMES as u32).to_le_bytes());
    for _ in 0..MAX_GET_NAMES {
        p.extend_from_slice(&[1, 0, b'x']);
    }
    assert!(
        matches!(Request::decode(Opcode::Get.code(), &p), Ok(Request::Get { names, .. }) if names.len() == MAX_GET_NAMES)
    );
}

#[test]
fn list_requests_page() {
    assert_eq!(
        Request::decode(Opcode::List.code(), &[]).unwrap(),
        Request::List {
            start: 0,
            limit: LIST_PAGE_ENTRIES
        }
    );
    let mut p = 77u64.to_le_bytes().to_vec();
    p.extend_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(
        Request::decode(Opcode::List.code(), &p).unwrap(),
        Request::List {
            start: 77,
            limit: MAX_LIST_PAGE_ENTRIES
        }
    );
    p[8..].copy_from_slice(&0u32.to_le_bytes());
    assert_eq!(
        Request::decode(Opcode::List.code(), &p).unwrap(),
        Request::List {
            start: 77,
            limit: LIST_PAGE_ENTRIES
        }
    );
}

#[test]
fn replies_check_what_the_request_asked() {
    // A GET reply must answer every name asked, no more, no fewer.
    let mut buf = Vec::new();
    Reply::Objects(vec![None, None]).encode(Opcode::Get.code(), 1, &mut buf);
    assert_eq!(
        Reply::decode(Opcode::Get.code(), &buf[HEADER_LEN..], &["a"]).unwrap_err(),
        DecodeError::NameCount { asked: 1, got: 2 }
    );
    // An error status decodes whatever the opcode (even one this build does not know).
    let mut buf = Vec::new();
    Reply::error(Status::UnknownOpcode, "unknown opcode 0x77").encode(0x77, 1, &mut buf);
    assert!(matches!(
        Reply::decode::<&str>(0x77, &buf[HEADER_LEN..], &[]),
        Ok(Reply::Failure(Failure {
            status: Status::UnknownOpcode,
            ..
        }))
    ));
    // OUT_OF_MEMORY carries its sizes; without them the reply is truncated.
    let mut buf = Vec::new();
    Reply::error(Status::OutOfMemory, "no room").encode(Opcode::Create.code(), 1, &mut buf);
    assert!(matches!(
        Reply::decode(Opcode::Create.code(), &buf[HEADER_LEN..], &["x"]),
        Err(DecodeError::Truncated { .. })
    ));
    // A status this protocol does not define.
    assert_eq!(
        Reply::decode::<&str>(Opcode::Seal.code(), &[200, 0, 0], &[]).unwrap_err(),
        DecodeError::UnknownStatus(200)
    );
    // HELLO's reply states the protocol version.
    let mut buf = Vec::new();
    Reply::Hello {
        capacity: 1,
        max_inline: 2,
        segments: vec![],
    }
    .encode(Opcode::Hello.code(), 0, &mut buf);
    buf[HEADER_LEN + 1] = 1;
    assert_eq!(
        Reply::decode::<&str>(Opcode::Hello.code(), &buf[HEADER_LEN..], &[]).unwrap_err(),
        DecodeError::UnsupportedVersion(1)
    );
}

#[test]
fn store_errors_survive_the_wire() {
    let cases = [
        vovp_types::Error::NotFound("x".into()),
        vovp_types::Error::OutOfMemory {
            requested: 10,
            available: 3,
        },
        vovp_types::Error::NotCreator("x".into()),
        vovp_types::Error::TooLarge("big".into()),
        vovp_types::Error::ShuttingDown,
    ];
    for e in cases {
        let mut buf = Vec::new();
        Reply::Failure(Failure::from_error(&e)).encode(Opcode::Create.code(), 1, &mut buf);
        let Reply::Failure(f) =
            Reply::decode(Opcode::Create.code(), &buf[HEADER_LEN..], &["x"]).unwrap()
        else {
            panic!("not a failure");
        };
        let back = vovp_types::Error::from(f);
        assert_eq!(
            std::mem::discriminant(&back),
            std::mem::discriminant(&e),
            "{e} came back as {back}"
        );
        if let vovp_types::Error::OutOfMemory {
            requested,
            available,
        } = back
        {
            assert_eq!((requested, available), (10, 3));
        }
    }
}

/// STATS grows by appending fields: an empty request (every client before spilling) gets the
/// first 16, a reply decodes with as many as came (a daemon before spilling sends 16), and
/// fields a newer daemon appends are skipped.
#[test]
fn stats_fields_are_appended_compatibly() {
    assert_eq!(
        Request::decode(Opcode::Stats.code(), &[]).unwrap(),
        Request::STATS_FIRST
    );
    let mut empty = Vec::new();
    Request::STATS_FIRST.encode(1, 0, &mut empty);
    assert_eq!(empty.len(), HEADER_LEN, "an empty payload, as before");
    let reply = |fields: usize, extra: usize| {
        let mut p = vec![STATUS_OK];
        for i in 0..fields + extra {
            p.extend_from_slice(&(i as u64 + 1).to_le_bytes());
        }
        Reply::decode::<&str>(Opcode::Stats.code(), &p, &[])
    };
    let Reply::Stats { stats, fields, .. } = reply(16, 0).unwrap() else {
        panic!("stats")
    };
    assert_eq!((fields, stats.capacity, stats.half_closed), (16, 1, 16));
    assert_eq!(stats.spills, 0);
    let Reply::Stats { stats, fields, .. } = reply(STATS_FIELDS.len(), 3).unwrap() else {
        panic!("stats")
    };
    assert_eq!(fields as usize, STATS_FIELDS.len());
    assert_eq!(stats.restore_failures, STATS_FIELDS.len() as u64);
    assert!(reply(15, 0).is_err(), "the first 16 always come");
    // What the daemon sends is what was asked for.
    let mut out = Vec::new();
    Reply::Stats {
        stats: vovp_types::StoreStats::default(),
        connections: 0,
        fields: 16,
    }
    .encode(Opcode::Stats.code(), 1, &mut out);
    assert_eq!(out.len(), HEADER_LEN + 1 + 16 * 8);
}

/// Fuzz find (frame_decoder): a FETCH whose `has_base` byte was 3 decoded as "a base", so its
/// canonical encoding (1) differed from the payload. Only 0 and 1 are FETCH's tags.
#[test]
fn a_fetch_base_tag_other_than_0_or_1_is_malformed() {
    let fetch = |tag: u8| {
        let mut p = Vec::new();
        p.extend_from_slice(&1u16.to_le_bytes());
        p.push(b's');
        p.extend_from_slice(&7u64.to_le_bytes()); // version
        p.extend_from_slice(&0u16.to_le_bytes()); // source ""
        p.extend_from_slice(&0u16.to_le_bytes()); // streams
        p.extend_from_slice(&0i64.to_le_bytes()); // timeout_ms
        p.push(tag);
        if tag != 0 {
            p.extend_from_slice(&1u64.to_le_bytes()); // base version
            p.extend_from_slice(&0u32.to_le_bytes()); // no ranges
        }
        Request::decode(Opcode::Fetch.code(), &p).map(Request::into_owned)
    };
    assert!(matches!(fetch(0), Ok(Request::Fetch(f)) if f.base.is_none()));
    assert!(matches!(fetch(1), Ok(Request::Fetch(f)) if f.base.is_some()));
    let err = fetch(3).unwrap_err();
    assert_eq!(err, DecodeError::FetchBaseTag(3));
    assert_eq!(err.status(), Status::Malformed);
}
