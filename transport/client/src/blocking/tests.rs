//! The blocking client's puts against a daemon played by the test ([`Daemon`]): which
//! requests go out for which put, in which order and with which flags, what is counted in
//! the hold table, and how owed replies come back.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use vovp_proto::{Failure, Header, Opcode, Reply, Request, FLAG_NO_REPLY, HEADER_LEN, LEND_SMALL};
use vovp_types::{CreateOptions, Error, Lend, Location, ObjectId, ObjectName, ObjectRef, Store};

use super::{Client, ClientInner, Conn};
use crate::core::Core;
use crate::lent::ClientLend;
use crate::test_support::{mappings, own_segment, Table};

/// Where the test's daemon lends (this client's arena, mapped already: no SEGMENT).
const ARENA: u32 = 1;
const ARENA_LEN: u64 = 8 << 20;

/// The daemon's side: every request the client sent (request id, flags, request), and its
/// thread, which answers each as `answer` says (`None`: no reply).
struct Daemon {
    seen: Arc<Mutex<Vec<(u64, u16, Request<'static>)>>>,
    /// Ends when the client's end of the socket closes.
    _thread: JoinHandle<()>,
}

type Answer = dyn Fn(&Request<'_>) -> Option<Reply> + Send;

impl Daemon {
    fn start(mut stream: UnixStream, answer: Box<Answer>) -> Self {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let thread = std::thread::spawn(move || loop {
            let mut header = [0u8; HEADER_LEN];
            if stream.read_exact(&mut header).is_err() {
                return;
            }
            let h = Header::parse(&header).unwrap().unwrap();
            let mut payload = vec![0u8; h.payload_len];
            stream.read_exact(&mut payload).unwrap();
            let req = Request::decode(h.opcode, &payload).unwrap().into_owned();
            let reply = answer(&req);
            log.lock().unwrap().push((h.request_id, h.flags, req));
            if h.flags & FLAG_NO_REPLY != 0 {
                continue;
            }
            if let Some(reply) = reply {
                let mut out = Vec::new();
                reply.encode(h.opcode, h.request_id, &mut out);
                if stream.write_all(&out).is_err() {
                    return;
                }
            }
        });
        Daemon {
            seen,
            _thread: thread,
        }
    }

    /// The requests seen so far, once `count` have come.
    fn seen(&self, count: usize) -> Vec<(u64, u16, Request<'static>)> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let seen = self.seen.lock().unwrap().clone();
            if seen.len() >= count {
                return seen;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{} requests: {seen:?}",
                seen.len()
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

/// `name` stored `size` bytes at `offset` of `segment`.
fn stored(name: &str, segment: u32, offset: u64, size: u64) -> ObjectRef {
    ObjectRef {
        id: ObjectId::from_raw(1000 + offset),
        name: ObjectName::new(name).unwrap(),
        size,
        metadata: Arc::from(&b""[..]),
        location: Location::Host { segment, offset },
        version: 1,
    }
}

/// Where the test daemon stores inline PUTs (in the arena, so that kept views can be made).
const PUT_AT: u64 = 4 << 20;

/// What a daemon of one arena answers: PUTs stored at [`PUT_AT`], lends in the arena (a small
/// one of 64 KiB at 0, a big one of 1 MiB at 1 MiB), PUBLISHes where they say; PUBLISH_MANY
/// known or not (`publish_many`).
fn store(publish_many: bool) -> Box<Answer> {
    Box::new(move |req| {
        Some(match req {
            Request::Put { name, data, .. } => {
                Reply::Object(stored(name, ARENA, PUT_AT, data.len() as u64))
            }
            Request::Lend { flags, .. } if flags & LEND_SMALL != 0 => Reply::Lent(Lend {
                id: 7,
                segment: ARENA,
                offset: 0,
                size: 64 << 10,
                max_object: 4096,
            }),
            Request::Lend { .. } => Reply::Lent(Lend {
                id: 8,
                segment: ARENA,
                offset: 1 << 20,
                size: 1 << 20,
                max_object: 256 << 10,
            }),
            Request::Publish {
                name, offset, size, ..
            } => Reply::Object(stored(name, ARENA, *offset, *size)),
            Request::PublishMany { items, .. } if publish_many => Reply::Published(
                (items.iter())
                    .map(|i| Ok(stored(&i.name, ARENA, i.offset, i.size)))
                    .collect(),
            ),
            Request::PublishMany { .. } => Reply::Failure(Failure::from_error(&Error::Protocol(
                "UNKNOWN_OPCODE: PUBLISH_MANY".into(),
            ))),
            Request::Release { .. } => return None,
            other => Reply::Failure(Failure::from_error(&Error::Internal(format!(
                "the test daemon does not answer {other:?}"
            )))),
        })
    })
}

/// A client over a socket pair with `table` as its hold table and the arena mapped, and the
/// daemon answering with `answer`.
fn client(table: &Table, pipelined_puts: bool, answer: Box<Answer>) -> (Client, Daemon) {
    let (ours, theirs) = UnixStream::pair().unwrap();
    let maps = mappings(1 << 30, Some(table.reader.clone()));
    maps.insert_segment(ARENA, own_segment(ARENA_LEN));
    let inner = Arc::new(ClientInner {
        core: Core::new("/nonexistent".into(), maps, false),
        conn: Mutex::new(Conn::new(ours)),
        closed: Default::default(),
        closer: Mutex::new(None),
        defer_cuda: false,
        shared_reads: true,
        flusher: None,
        lend: ClientLend::new(true),
        pipelined_puts,
    });
    (Client { inner }, Daemon::start(theirs, answer))
}

fn flags_of(req: &Request<'_>) -> u32 {
    match req {
        Request::Put { flags, .. } | Request::Publish { flags, .. } => *flags,
        other => panic!("no put: {other:?}"),
    }
}

const PIPELINED: u32 = vovp_proto::PUT_PIPELINED;
const KEEP: u32 = vovp_proto::PUT_KEEP_REFERENCE;

#[test]
fn a_small_put_goes_out_without_waiting_counted_in_the_hold_table_first() {
    let table = Table::new();
    let (c, daemon) = client(&table, true, store(true));
    c.put("a", b"bytes", b"m", CreateOptions::default())
        .unwrap();
    assert_eq!(table.holds.puts_sent(), 1);
    assert_eq!(c.unread_replies(), 1);
    let seen = daemon.seen(1);
    assert_eq!(seen[0].2.opcode(), Opcode::Put);
    assert_eq!(flags_of(&seen[0].2), PIPELINED);
    // Its reply is read in front of the next call's: none failed.
    c.sync().unwrap();
    assert_eq!(c.unread_replies(), 0);
}

#[test]
fn a_put_of_a_name_whose_own_put_is_unanswered_waits() {
    let table = Table::new();
    // The first answer comes late: the second put finds the first one's owed.
    let answer = store(true);
    let first = std::sync::atomic::AtomicBool::new(true);
    let slow: Box<Answer> = Box::new(move |req| {
        if first.swap(false, std::sync::atomic::Ordering::SeqCst) {
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        answer(req)
    });
    let (c, daemon) = client(&table, true, slow);
    c.put("a", b"one", b"", CreateOptions::default()).unwrap();
    c.put("a", b"two", b"", CreateOptions::default()).unwrap();
    let seen = daemon.seen(2);
    assert_eq!((flags_of(&seen[0].2), flags_of(&seen[1].2)), (PIPELINED, 0));
    assert_eq!(table.holds.puts_sent(), 1, "the second was not counted");
    assert_eq!(c.unread_replies(), 0, "the owed reply was read first");
}

#[test]
fn a_published_name_fails_at_once_unless_replaced() {
    let mut table = Table::new();
    table.publish("taken");
    let (c, daemon) = client(&table, true, store(true));
    let e = c.put("taken", b"x", b"", CreateOptions::default());
    assert!(matches!(e, Err(Error::AlreadyExists(_))));
    assert_eq!(table.holds.puts_sent(), 0);
    let replace = CreateOptions {
        replace: true,
        ..Default::default()
    };
    c.put("taken", b"x", b"", replace).unwrap();
    let seen = daemon.seen(1);
    assert_eq!(seen.len(), 1, "the refused put sent nothing");
    assert_eq!(flags_of(&seen[0].2), PIPELINED | vovp_proto::CREATE_REPLACE);
}

#[test]
fn a_pipelined_put_the_store_refused_is_reported_by_sync_once() {
    let table = Table::new();
    let refusing: Box<Answer> = Box::new(|req| match req {
        Request::Put { name, .. } => Some(Reply::Failure(Failure::from_error(
            &Error::AlreadyExists(name.to_string()),
        ))),
        _ => None,
    });
    let (c, _daemon) = client(&table, true, refusing);
    c.put("a", b"x", b"", CreateOptions::default()).unwrap();
    c.put("b", b"x", b"", CreateOptions::default()).unwrap();
    assert!(matches!(c.sync(), Err(Error::AlreadyExists(_))));
    c.sync().unwrap();
}

#[test]
fn with_pipelining_off_every_put_waits_and_keeps_what_it_is_asked_to() {
    let table = Table::new();
    let (c, daemon) = client(&table, false, store(true));
    c.put("a", b"x", b"", CreateOptions::default()).unwrap();
    assert_eq!(
        c.put_id("b", b"y", b"", CreateOptions::default()).unwrap(),
        1000 + PUT_AT
    );
    let kept = c
        .put_and_view("c", b"z", b"", CreateOptions::default())
        .unwrap();
    assert_eq!(kept.id().get(), 1000 + PUT_AT);
    assert!(c
        .put_view_later("d", b"w", b"", CreateOptions::default())
        .unwrap()
        .is_none());
    let seen = daemon.seen(3);
    let flags: Vec<u32> = seen.iter().map(|s| flags_of(&s.2)).collect();
    assert_eq!(flags, [0, 0, KEEP]);
    assert_eq!(table.holds.puts_sent(), 0);
    // The kept reference goes back when its view drops (with the next request).
    drop(kept);
    c.stats().ok();
    let seen = daemon.seen(5);
    assert!(matches!(&seen[3].2, Request::Release { ids } if ids[..] == [1000 + PUT_AT]));
}

#[test]
fn kept_small_puts_go_into_the_small_lend_together() {
    let table = Table::new();
    let (c, daemon) = client(&table, true, store(true));
    let puts: Vec<(&str, &[u8], &[u8], CreateOptions)> = ["a", "b", "c"]
        .iter()
        .map(|&n| (n, &b"eight by"[..], &b""[..], CreateOptions::default()))
        .collect();
    let views: Vec<_> = (c.put_views_later(&puts).into_iter())
        .map(|v| v.expect("the small lend's way").expect("sent"))
        .collect();
    // Written before the request went out, one 64-byte block each, in order.
    let offsets: Vec<_> = views.iter().map(|v| v.location()).collect();
    let at = |offset| Location::Host {
        segment: ARENA,
        offset,
    };
    assert_eq!(offsets, [at(0), at(64), at(128)]);
    // SAFETY: the view's 8 bytes, kept mapped by it.
    assert_eq!(
        unsafe { std::slice::from_raw_parts(views[1].as_ptr(), 8) },
        b"eight by"
    );
    let seen = daemon.seen(3);
    assert!(matches!(
        seen[0].2,
        Request::Lend {
            flags: LEND_SMALL,
            ..
        }
    ));
    assert!(matches!(&seen[1].2, Request::PublishMany { items, .. } if items.is_empty()));
    let Request::PublishMany { lend, items } = &seen[2].2 else {
        panic!("{:?}", seen[2].2);
    };
    assert_eq!((*lend, items.len()), (7, 3));
    assert!(items.iter().all(|i| i.flags == KEEP | PIPELINED));
    assert_eq!(table.holds.puts_sent(), 3);
    // One reply owed for the three; waiting on one reads it, and every view has its object.
    assert_eq!(c.unread_replies(), 1);
    views[2].wait().unwrap();
    for v in &views {
        let Location::Host { offset, .. } = v.location() else {
            unreachable!("a host put")
        };
        assert_eq!(v.take_view().unwrap().id().get(), 1000 + offset);
    }
}

#[test]
fn a_store_without_publish_many_gets_a_publish_per_put() {
    let table = Table::new();
    let (c, daemon) = client(&table, true, store(false));
    let puts: Vec<(&str, &[u8], &[u8], CreateOptions)> = ["a", "b"]
        .iter()
        .map(|&n| (n, &b"x"[..], &b""[..], CreateOptions::default()))
        .collect();
    let views: Vec<_> = (c.put_views_later(&puts).into_iter())
        .map(|v| v.unwrap().unwrap())
        .collect();
    let seen = daemon.seen(4);
    let ops: Vec<Opcode> = seen.iter().map(|s| s.2.opcode()).collect();
    assert_eq!(
        ops,
        [
            Opcode::Lend,
            Opcode::PublishMany,
            Opcode::Publish,
            Opcode::Publish
        ]
    );
    assert_eq!(c.unread_replies(), 2);
    c.sync().unwrap();
    assert!(views.iter().all(|v| v.take_view().is_some()));
}

#[test]
fn a_kept_put_the_lend_takes_returns_before_its_answer_and_keeps_the_lend_until_it() {
    let table = Table::new();
    let (c, daemon) = client(&table, true, store(true));
    let data = vec![5u8; 100_000];
    let view = c
        .put_view_later("big", &data, b"", CreateOptions::default())
        .unwrap()
        .expect("through the lend");
    assert_eq!(
        view.location(),
        Location::Host {
            segment: ARENA,
            offset: 1 << 20
        }
    );
    let seen = daemon.seen(2);
    assert!(matches!(seen[0].2, Request::Lend { flags: 0, .. }));
    assert_eq!(seen[1].2.opcode(), Opcode::Publish);
    assert_eq!(flags_of(&seen[1].2), KEEP | PIPELINED);
    // Its write into the lend stays announced until the reply is read: the store cannot
    // take the lend back meanwhile. (The populating thread of a fresh lend is a writer too.)
    assert!(!table.holds.lend_revoker().revoke(8));
    view.wait().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !table.holds.lend_revoker().revoke(8) {
        assert!(
            std::time::Instant::now() < deadline,
            "the lend stays written"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

#[test]
fn a_batch_sends_kept_puts_that_wait_inline_together() {
    let table = Table::new();
    let (c, daemon) = client(&table, false, store(true));
    let items: Vec<(&str, &[u8], &[u8])> =
        vec![("a", b"1", b""), ("b", b"22", b""), ("c", b"333", b"")];
    let options = vovp_types::PutOptions::default().with(true, true);
    let answers = c.put_batch(&items, options).unwrap();
    assert!(answers
        .iter()
        .all(|a| matches!(a, Ok(crate::Put::Kept(v)) if v.id().get() == 1000 + PUT_AT)));
    let seen = daemon.seen(3);
    let ids: Vec<u64> = seen.iter().take(3).map(|s| s.0).collect();
    assert!(seen.iter().take(3).all(|s| flags_of(&s.2) == KEEP));
    assert_eq!(ids, [1, 2, 3], "one write, in order");
}
