//! PROTOCOL.md against this crate: every opcode and status the page documents exists here
//! under the same name and value and decodes, every one defined here is documented, and the
//! STATS field order is the page's.

use std::collections::BTreeMap;

use vovp_proto::*;
use vovp_types::{Device, Notification, NotificationKind, ObjectName};

fn page() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../PROTOCOL.md");
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

/// The table rows of the section starting at `heading`: the cells of each `| .. | .. |` line.
fn rows(page: &str, heading: &str) -> Vec<Vec<String>> {
    let start = page
        .find(heading)
        .unwrap_or_else(|| panic!("PROTOCOL.md has no {heading:?}"));
    page[start..]
        .lines()
        .skip(1)
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            l.trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_owned())
                .collect()
        })
        .filter(|cells: &Vec<String>| {
            !cells[0].starts_with("---") && cells[0] != "op" && cells[0] != "status"
        })
        .collect()
}

/// A valid request of each opcode.
fn sample(op: Opcode) -> Request<'static> {
    match op {
        Opcode::Hello => Request::Hello { pid: 1 },
        Opcode::Create => Request::Create {
            name: "a".into(),
            size: 8,
            flags: CREATE_EPHEMERAL | CREATE_REPLACE,
            version: Some(7),
            device: Device::Cpu,
            metadata: b"m".to_vec().into(),
        },
        Opcode::Seal => Request::Seal { name: "a".into() },
        Opcode::Abort => Request::Abort { name: "a".into() },
        Opcode::Put => Request::Put {
            name: "a".into(),
            flags: PUT_KEEP_REFERENCE,
            version: None,
            metadata: b"".to_vec().into(),
            data: vec![1, 2, 3].into(),
        },
        Opcode::Get => Request::Get {
            timeout_ms: -1,
            names: vec!["a".into(), "b".into()],
        },
        Opcode::GetNewer => Request::GetNewer {
            timeout_ms: 100,
            names: vec!["a".into(), "b".into()],
            newer_than: vec![3, 0],
        },
        Opcode::Release => Request::Release {
            ids: vec![1, 2].into(),
        },
        Opcode::Contains => Request::Contains { name: "a".into() },
        Opcode::Delete => Request::Delete { name: "a".into() },
        Opcode::List => Request::List {
            start: 0,
            limit: 10,
        },
        Opcode::Evict => Request::Evict { bytes: 100 },
        Opcode::Stats => Request::STATS,
        Opcode::Metrics => Request::Metrics,
        Opcode::Shared => Request::Shared,
        Opcode::Subscribe => Request::Subscribe,
        Opcode::Segment => Request::Segment { id: 3 },
        Opcode::Lend => Request::Lend {
            at_least: 4096,
            flags: 0,
        },
        Opcode::Publish => Request::Publish {
            lend: 1,
            offset: 128,
            name: "a".into(),
            flags: CREATE_EPHEMERAL,
            version: Some(3),
            metadata: b"m".to_vec().into(),
            size: 100,
        },
        Opcode::PublishMany => Request::PublishMany {
            lend: 1,
            items: vec![
                PublishItem {
                    offset: 128,
                    name: "a".into(),
                    flags: PUT_KEEP_REFERENCE,
                    version: Some(2),
                    metadata: b"m".to_vec().into(),
                    size: 100,
                },
                PublishItem {
                    offset: 256,
                    name: "b".into(),
                    flags: 0,
                    version: None,
                    metadata: b"".to_vec().into(),
                    size: 8,
                },
            ],
        },
        Opcode::TransferInfo => Request::TransferInfo,
        Opcode::Fetch => Request::Fetch(Fetch {
            name: "a".into(),
            version: 4,
            source: "10.0.0.2:7000".into(),
            streams: 4,
            timeout_ms: 30_000,
            base: Some(FetchBase {
                version: 3,
                ranges: vec![(0, 64), (128, 64)].into(),
            }),
        }),
        Opcode::Gather => Request::Gather(Gather {
            name: "a".into(),
            version: 4,
            source: "10.0.0.2:7000".into(),
            row_bytes: 16,
            timeout_ms: 0,
            into: "rows".into(),
            ids: vec![3, 1, 3].into(),
        }),
        Opcode::Notify => unreachable!("not a request"),
    }
}

#[test]
fn every_documented_opcode_decodes_and_every_opcode_is_documented() {
    let page = page();
    let documented: BTreeMap<u8, String> = rows(&page, "## Requests")
        .into_iter()
        .map(|cells| {
            let code = cells[0]
                .strip_prefix("0x")
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .unwrap_or_else(|| panic!("opcode cell {:?}", cells[0]));
            (code, cells[1].clone())
        })
        .collect();
    assert_eq!(documented.len(), Opcode::ALL.len(), "{documented:?}");
    for (&code, name) in &documented {
        let op = Opcode::from_code(code).unwrap_or_else(|| {
            panic!("PROTOCOL.md documents opcode {code:#04x} ({name}), unknown here")
        });
        assert_eq!(op.name(), name, "opcode {code:#04x}");
        if op == Opcode::Notify {
            // Server to client only: a client sending it gets UNKNOWN_OPCODE; it decodes as a
            // notification.
            assert_eq!(
                Request::decode(code, &[]).unwrap_err().status(),
                Status::UnknownOpcode
            );
            let note = Notification {
                kind: NotificationKind::Sealed,
                name: ObjectName::new("a").unwrap(),
                size: 1,
                metadata: b"".to_vec().into(),
                version: 2,
            };
            let mut buf = Vec::new();
            encode_notification(&note, &mut buf);
            assert_eq!(decode_notification(&buf[HEADER_LEN..]).unwrap(), note);
            continue;
        }
        let req = sample(op);
        let mut buf = Vec::new();
        req.encode(0, 1, &mut buf);
        assert_eq!(buf[5], code);
        assert_eq!(
            Request::decode(code, &buf[HEADER_LEN..]).unwrap(),
            req,
            "{name}"
        );
    }
    for op in Opcode::ALL {
        assert_eq!(
            documented.get(&op.code()).map(String::as_str),
            Some(op.name()),
            "{op:?} is not in PROTOCOL.md's request table"
        );
    }
}

#[test]
fn every_documented_status_exists_and_every_status_is_documented() {
    let page = page();
    let documented: BTreeMap<u8, String> = rows(&page, "### Replies")
        .into_iter()
        .map(|cells| {
            let code = cells[0]
                .parse()
                .unwrap_or_else(|_| panic!("status cell {:?}", cells[0]));
            (code, cells[1].clone())
        })
        .collect();
    assert_eq!(documented.len(), Status::ALL.len(), "{documented:?}");
    for (&code, name) in &documented {
        let status = Status::from_code(code).unwrap_or_else(|| {
            panic!("PROTOCOL.md documents status {code} ({name}), unknown here")
        });
        assert_eq!(status.name(), name, "status {code}");
        // An error reply with it decodes, to it.
        let mut buf = Vec::new();
        let figures = status.has_figures().then_some((5, 6));
        Reply::Failure(Failure {
            status,
            message: name.clone(),
            figures,
        })
        .encode(Opcode::Seal.code(), 1, &mut buf);
        match Reply::decode::<&str>(Opcode::Seal.code(), &buf[HEADER_LEN..], &[]).unwrap() {
            Reply::Failure(f) => assert_eq!((f.status, f.figures), (status, figures)),
            other => panic!("{other:?}"),
        }
    }
    for s in Status::ALL {
        assert_eq!(
            documented.get(&s.code()).map(String::as_str),
            Some(s.name()),
            "{s:?} is not in PROTOCOL.md's status table"
        );
    }
}

#[test]
fn stats_fields_are_in_the_documented_order() {
    let page = page();
    let stats = rows(&page, "## Requests")
        .into_iter()
        .find(|cells| cells[1] == "STATS")
        .expect("a STATS row");
    let reply = &stats[3];
    let (count, fields) = reply
        .split_once(':')
        .unwrap_or_else(|| panic!("STATS reply cell {reply:?}"));
    assert!(
        count.starts_with(&format!("{} ", STATS_FIELDS.len())),
        "{count}"
    );
    let documented: Vec<&str> = fields.split(',').map(str::trim).collect();
    let ours: Vec<&str> = STATS_FIELDS.iter().map(|(n, _)| *n).collect();
    assert_eq!(documented, ours);
}
