//! Arbitrary bytes as a stream of frames, as the daemon (requests) and the client (replies) read
//! them: split with `Header::parse`, decode each payload. Nothing may panic, and what decodes
//! must satisfy the protocol's limits and re-encode to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vovp_fuzz::{encode_request, request_payload};
use vovp_transport::client::decode_reply_for_fuzzing;
use vovp_transport::protocol::*;

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    loop {
        let h = match Header::parse(rest) {
            // Fewer than 16 bytes: the daemon waits for more.
            Ok(None) => {
                assert!(rest.len() < HEADER_LEN);
                break;
            }
            // Fatal for the connection (bad length or version): nothing after it is read.
            Err(_) => break,
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
        } else {
            check_request(h.opcode, payload);
        }
    }
});

fn is_request_opcode(opcode: u8) -> bool {
    (op::HELLO..=op::SUBSCRIBE).contains(&opcode) || opcode == op::SEGMENT
}

fn check_request(opcode: u8, payload: &[u8]) {
    let req = match Request::decode(opcode, payload) {
        Ok(req) => req,
        Err((code, message)) => {
            assert!(
                matches!(
                    code,
                    status::MALFORMED
                        | status::INVALID_NAME
                        | status::TOO_LARGE
                        | status::UNKNOWN_OPCODE
                ),
                "status {code}: {message}"
            );
            assert_eq!(code == status::UNKNOWN_OPCODE, !is_request_opcode(opcode));
            // The daemon's error reply is a frame the client reads back as that error.
            let mut buf = Vec::new();
            Response::error(code, message).encode(opcode, 1, &mut buf);
            let h = Header::parse(&buf).unwrap().unwrap();
            assert_eq!(h.frame_len(), buf.len());
            assert!(decode_reply_for_fuzzing(opcode, &buf[HEADER_LEN..], &["x"]).is_err());
            return;
        }
    };
    assert!(is_request_opcode(opcode));
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
        _ => true,
    };
    if has_canonical_form {
        assert_eq!(canonical, payload, "{req:?}");
    }
    let mut frame = Vec::new();
    encode_request(&req, 0, 1, &mut frame);
    assert_eq!(&frame[HEADER_LEN..], canonical);
}

/// The names a reply answers: one for CREATE/PUT; as many as the reply says for GET (so the
/// fuzzer reaches the object decoding), bounded by the payload.
fn reply_names(opcode: u8, payload: &[u8]) -> Vec<String> {
    let n = match (opcode, payload) {
        (op::GET, [status::OK, a, b, c, d, ..]) => {
            (u32::from_le_bytes([*a, *b, *c, *d]) as usize).min(payload.len())
        }
        _ => 1,
    };
    (0..n).map(|i| format!("n{i}")).collect()
}

fn check_reply(opcode: u8, payload: &[u8]) {
    let names = reply_names(opcode, payload);
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let Ok(resp) = decode_reply_for_fuzzing(opcode, payload, &names) else {
        return;
    };
    match &resp {
        Response::Object(r) => assert_eq!(r.name.as_str(), names[0]),
        Response::Objects(v) => {
            assert_eq!(v.len(), names.len());
            for (o, n) in v.iter().zip(&names) {
                if let Some(o) = o {
                    assert_eq!(o.name.as_str(), *n);
                }
            }
        }
        _ => {}
    }
    // What the client decoded, encoded as the daemon does, decodes to the same thing.
    let mut buf = Vec::new();
    resp.encode(opcode, 1, &mut buf);
    let again = decode_reply_for_fuzzing(opcode, &buf[HEADER_LEN..], &names)
        .unwrap_or_else(|e| panic!("re-encoded {resp:?} does not decode: {e}"));
    assert_eq!(format!("{again:?}"), format!("{resp:?}"));
}
