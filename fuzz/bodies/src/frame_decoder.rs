//! Arbitrary bytes as a stream of frames, as the daemon (requests) and the client (replies) read
//! them: split with `Header::parse`, decode each payload. Nothing may panic, and what decodes
//! must satisfy the protocol's limits and re-encode to itself.

use crate::seeds::request_payload;
use vovp_proto::*;

/// The target's body: panics on a finding.
pub fn run(data: &[u8]) {
    let mut rest = data;
    loop {
        let h = match Header::parse(rest) {
            // Fewer than 16 bytes: the daemon waits for more.
            Ok(None) => {
                assert!(rest.len() < HEADER_LEN);
                break;
            }
            // Fatal for the connection (bad length or version): nothing after it is read.
            Err(e) => {
                assert!(e.is_fatal(), "{e}");
                break;
            }
            Ok(Some(h)) => h,
        };
        assert_eq!(h.version, VERSION);
        assert!(h.payload_len <= MAX_PAYLOAD);
        if rest.len() < h.frame_len() {
            break; // An incomplete frame: the daemon waits for the rest.
        }
        let (frame, tail) = rest.split_at(h.frame_len());
        rest = tail;
        let payload = &frame[HEADER_LEN..];
        // The header re-encodes to the bytes it was parsed from.
        let mut again = Vec::new();
        let mut w = FrameWriter::begin(&mut again, h.opcode, h.flags, h.request_id);
        w.raw(payload);
        w.finish();
        assert_eq!(again, frame);

        if h.opcode & REPLY_BIT != 0 {
            check_reply(h.opcode & !REPLY_BIT, payload);
        } else if h.opcode == Opcode::Notify.code() {
            check_notification(payload);
        } else {
            check_request(h.opcode, payload);
        }
    }
}

fn is_request_opcode(opcode: u8) -> bool {
    Opcode::from_code(opcode).is_some_and(Opcode::is_request)
}

fn check_request(opcode: u8, payload: &[u8]) {
    let req = match Request::decode(opcode, payload) {
        Ok(req) => req,
        Err(e) => {
            let code = e.status();
            assert!(!e.is_fatal(), "{e}");
            assert!(
                matches!(
                    code,
                    Status::Malformed
                        | Status::InvalidName
                        | Status::TooLarge
                        | Status::UnknownOpcode
                ),
                "status {code:?}: {e}"
            );
            assert_eq!(code == Status::UnknownOpcode, !is_request_opcode(opcode));
            // The daemon's error reply is a frame the client reads back as that error.
            let mut buf = Vec::new();
            Reply::error(code, e.to_string()).encode(opcode, 1, &mut buf);
            let h = Header::parse(&buf).unwrap().unwrap();
            assert_eq!(h.frame_len(), buf.len());
            match Reply::decode(opcode, &buf[HEADER_LEN..], &["x"]) {
                Ok(Reply::Failure(f)) => assert_eq!((f.status, f.message), (code, e.to_string())),
                other => panic!("{other:?}"),
            }
            return;
        }
    };
    assert!(is_request_opcode(opcode));
    assert_eq!(req.opcode().code(), opcode);
    match &req {
        Request::Get { names, .. } => assert!(names.len() <= MAX_GET_NAMES),
        Request::List { limit, .. } => assert!((1..=MAX_LIST_PAGE_ENTRIES).contains(limit)),
        Request::Put { data, .. } => assert!(data.len() <= payload.len()),
        _ => {}
    }
    // Round trip: the canonical encoding decodes to the same request, and is the very payload
    // whenever the payload was canonical (so the decoder read every field and nothing else).
    let canonical = request_payload(&req);
    assert_eq!(Request::decode(opcode, &canonical).as_ref(), Ok(&req));
    let has_canonical_form = match &req {
        // The device id of a CPU object is ignored; LIST's limit is defaulted and clamped.
        Request::Create { .. } | Request::List { .. } => false,
        // STATS of the first 16 fields is an empty payload (what daemons from before spilling
        // take), and `u32 16` reads the same.
        Request::Stats { fields } => *fields as usize != STATS_FIELDS_FIRST,
        _ => true,
    };
    if has_canonical_form {
        assert_eq!(canonical, payload, "{req:?}");
    }
    // Kept past its input buffer, it is the same request.
    assert_eq!(req.clone().into_owned(), req);
}

/// The names a reply answers: one for CREATE/PUT; as many as the reply says for GET (so the
/// fuzzer reaches the object decoding), bounded by the payload.
fn reply_names(opcode: u8, payload: &[u8]) -> Vec<String> {
    let n = match payload {
        [0, a, b, c, d, ..] if opcode == Opcode::Get.code() => {
            (u32::from_le_bytes([*a, *b, *c, *d]) as usize).min(payload.len())
        }
        _ => 1,
    };
    (0..n).map(|i| format!("n{i}")).collect()
}

fn check_reply(opcode: u8, payload: &[u8]) {
    let names = reply_names(opcode, payload);
    let Ok(reply) = Reply::decode(opcode, payload, &names) else {
        return;
    };
    match &reply {
        Reply::Object(r) => assert_eq!(r.name.as_str(), names[0]),
        Reply::Objects(v) => {
            assert_eq!(v.len(), names.len());
            for (o, n) in v.iter().zip(&names) {
                if let Some(o) = o {
                    assert_eq!(o.name.as_str(), n);
                }
            }
        }
        Reply::Failure(f) => assert_eq!(f.figures.is_some(), f.status.has_figures()),
        _ => {}
    }
    // What the client decoded, encoded as the daemon does, decodes to the same thing.
    let mut buf = Vec::new();
    reply.encode(opcode, 1, &mut buf);
    let again = Reply::decode(opcode, &buf[HEADER_LEN..], &names)
        .unwrap_or_else(|e| panic!("re-encoded {reply:?} does not decode: {e}"));
    assert_eq!(again, reply);
}

fn check_notification(payload: &[u8]) {
    let Ok(n) = decode_notification(payload) else {
        return;
    };
    let mut buf = Vec::new();
    encode_notification(&n, &mut buf);
    assert_eq!(&buf[HEADER_LEN..], payload);
}
