//! The client's side of a session with a daemon that answers anything. A fake daemon on a real
//! socket answers each request of the real blocking client (`vovp_client::Client`) with a
//! reply the input picks: a well-formed one with numbers from the input (HELLO's and
//! SEGMENT's segments, SHARED's directory and hold table, LEND's range, objects anywhere), a
//! random payload, an error, a wrong opcode or request id, or a closed socket; segment fds
//! are memfds of a size the input picks, smaller than announced included. Every client call
//! must end with a value or a typed error, and every byte of every view and buffer it hands
//! out must be readable: no panic, no SIGBUS, no hang.
//!
//! Input: the first half drives the client (byte 0: shared reads and lends on or off; then
//! one call per byte), the second half the fake daemon's answers.

use std::io::Read;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use vovp::{
    CreateOptions, Error, Lend, Location, ObjectId, ObjectName, ObjectRef, Store, StoreStats,
};
use vovp_client::{Client, ClientOptions};
use vovp_proto::{Failure, Header, Reply, Request, Status, FLAG_NO_REPLY, HEADER_LEN, LIST_END};
use vovp_shm::{DirectoryRegion, HoldRegion};

/// The target's body: panics (or crashes) on a finding.
pub fn run(data: &[u8]) {
    let Some((&flags, _)) = data.split_first() else {
        return;
    };
    let (calls, answers) = data.split_at(data.len() / 2 + 1);
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!("vovp-fuzz-client-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("socket directory");
    let path = dir.join(format!("{}.sock", N.fetch_add(1, Ordering::Relaxed)));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).expect("bind");
    let answers = answers.to_vec();
    let fake = std::thread::spawn(move || fake_daemon(&listener, &answers));
    let options = ClientOptions {
        no_shared_reads: flags & 1 == 0,
        no_lend_puts: flags & 2 == 0,
        ..ClientOptions::default()
    };
    if let Ok(client) = Client::connect_with(&path, options) {
        for (i, &op) in calls[1..].iter().enumerate() {
            call(&client, op, i);
        }
    }
    fake.join().expect("the fake daemon");
    let _ = std::fs::remove_file(&path);
}

/// One client call; whatever it hands out is read (and a buffer written) whole.
fn call(client: &Client, op: u8, i: usize) {
    let name = format!("n{}", op >> 4);
    let touch = |bytes: &[u8]| bytes.iter().fold(0u8, |a, b| a ^ b);
    let r: Result<(), Error> = match op & 7 {
        0 => client.get(&[&name], Some(Duration::ZERO)).map(|views| {
            for v in views.iter().flatten() {
                std::hint::black_box(touch(v));
                std::hint::black_box(touch(v.metadata()));
            }
        }),
        1 => client.put(&name, &[i as u8; 100], b"m", CreateOptions::default()),
        2 => client.put(
            &name,
            &vec![i as u8; 100 << 10],
            b"",
            CreateOptions::default(),
        ),
        3 => client.stats().map(drop),
        4 => client.contains(&name).map(drop),
        5 => client
            .create(&name, 70_000, b"", CreateOptions::default())
            .and_then(|mut b| {
                b.as_mut_slice().fill(1);
                b.seal().map(|v| {
                    std::hint::black_box(touch(&v));
                })
            }),
        6 => client.delete(&name),
        // Small kept puts in one message (PUBLISH_MANY), each view read and then waited for.
        _ if op & 0x88 == 0x88 => {
            let names: Vec<String> = (0..3).map(|k| format!("{name}-{k}")).collect();
            let data = [i as u8; 64];
            let puts: Vec<_> = (names.iter())
                .map(|n| (n.as_str(), &data[..], &b"m"[..], CreateOptions::default()))
                .collect();
            let mut first = Ok(());
            for answer in client.put_views_later(&puts).into_iter().flatten() {
                let r = answer.and_then(|p| {
                    // SAFETY: the view's bytes, mapped while it lives.
                    let bytes = unsafe { std::slice::from_raw_parts(p.as_ptr(), 64) };
                    std::hint::black_box(touch(bytes));
                    p.wait().map(|()| drop(p.take_view()))
                });
                first = first.and(r);
            }
            first
        }
        // A small kept put whose reply is read later (its view checked against the reply).
        _ if op & 8 != 0 => client
            .put_view_later(&name, &[i as u8; 64], b"m", CreateOptions::default())
            .and_then(|pending| match pending {
                None => Ok(()),
                Some(p) => {
                    // SAFETY: the view's bytes, mapped while it lives.
                    let bytes = unsafe { std::slice::from_raw_parts(p.as_ptr(), 64) };
                    std::hint::black_box(touch(bytes));
                    p.wait().map(|()| drop(p.take_view()))
                }
            }),
        _ => client.list().map(drop),
    };
    if let Err(e) = r {
        // A typed error naming its cause; an internal one only where the daemon said so (the
        // fake's error replies all say "fuzz").
        assert!(!matches!(&e, Error::Internal(m) if m != "fuzz"), "{e:?}");
    }
}

/// Bytes of the fake daemon's script; zeros once it runs out.
struct Script<'a>(&'a [u8]);

impl Script<'_> {
    fn byte(&mut self) -> u8 {
        let (&b, rest) = self.0.split_first().unwrap_or((&0, &[]));
        self.0 = rest;
        b
    }
    fn done(&self) -> bool {
        self.0.is_empty()
    }
    /// Mostly small, sometimes anything.
    fn number(&mut self) -> u64 {
        match self.byte() {
            b @ 0..=239 => u64::from(b) * 4096,
            _ => u64::from_le_bytes(std::array::from_fn(|_| self.byte())),
        }
    }
}

fn fake_daemon(listener: &UnixListener, answers: &[u8]) {
    let Ok((mut stream, _)) = listener.accept() else {
        return;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let mut script = Script(answers);
    // Regions and memfds live as long as the session (the client maps them).
    let mut kept: Vec<Box<dyn std::any::Any>> = Vec::new();
    while let Some((header, payload)) = read_frame(&mut stream) {
        if header.flags & FLAG_NO_REPLY != 0 {
            continue;
        }
        if script.done() {
            return; // closes the socket: the client's next call fails as a lost connection
        }
        let (opcode, id) = (header.opcode, header.request_id);
        let mut out = Vec::new();
        let mut fds: Vec<OwnedFd> = Vec::new();
        match script.byte() % 8 {
            0..=4 => {
                let Ok(req) = Request::decode(opcode, &payload) else {
                    return;
                };
                let reply = answer(&req, &mut script, &mut fds, &mut kept);
                reply.encode(opcode, id, &mut out);
            }
            5 => {
                let len = usize::from(script.byte());
                let junk: Vec<u8> = (0..len).map(|_| script.byte()).collect();
                let mut w = vovp_proto::FrameWriter::begin(&mut out, opcode | 0x80, 0, id);
                w.raw(&junk);
                w.finish();
            }
            6 => Reply::Failure(Failure {
                status: Status::from_code(script.byte()).unwrap_or(Status::NotFound),
                message: "fuzz".into(),
                figures: None,
            })
            .encode(opcode, id, &mut out),
            _ => Reply::Empty.encode(script.byte(), id ^ u64::from(script.byte()), &mut out),
        }
        let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
        let sent = match vovp_shm::fdpass::send_with_fds(&stream, &out, &borrowed) {
            Ok(n) => n,
            Err(_) => return,
        };
        if !crate::send_all(&stream, &out[sent..]) {
            return;
        }
    }
}

fn read_frame(stream: &mut UnixStream) -> Option<(Header, Vec<u8>)> {
    let mut head = [0u8; HEADER_LEN];
    stream.read_exact(&mut head).ok()?;
    let header = Header::parse(&head).ok()??;
    let mut payload = vec![0u8; header.frame_len() - HEADER_LEN];
    stream.read_exact(&mut payload).ok()?;
    Some((header, payload))
}

/// A memfd of `len` bytes (the fd a segment rides on).
fn memfd(len: u64) -> Option<OwnedFd> {
    let fd = rustix::fs::memfd_create("vovp-fuzz-segment", rustix::fs::MemfdFlags::CLOEXEC).ok()?;
    rustix::fs::ftruncate(&fd, len.min(64 << 20)).ok()?;
    Some(fd)
}

/// A segment of `announced` bytes whose fd holds that many, or (one time in four) fewer.
fn segment_fd(announced: u64, script: &mut Script<'_>) -> Option<OwnedFd> {
    let actual = match script.byte() % 4 {
        0 => announced / 2,
        _ => announced,
    };
    memfd(actual)
}

fn object(name: &str, size: u64, script: &mut Script<'_>) -> ObjectRef {
    ObjectRef {
        id: ObjectId::from_raw(script.number().max(1)),
        name: ObjectName::new(name).unwrap_or_else(|_| ObjectName::new("x").expect("name")),
        size,
        metadata: Arc::from(&b"m"[..]),
        location: Location::Host {
            segment: u32::from(script.byte() % 3),
            offset: script.number() / 64 * 64,
        },
        version: script.number(),
    }
}

/// A well-formed reply to `req`, with numbers (and fds) from the script.
fn answer(
    req: &Request<'_>,
    script: &mut Script<'_>,
    fds: &mut Vec<OwnedFd>,
    kept: &mut Vec<Box<dyn std::any::Any>>,
) -> Reply {
    match req {
        Request::Hello { .. } => {
            let size = script.number().clamp(4096, 16 << 20);
            fds.extend(segment_fd(size, script));
            Reply::Hello {
                capacity: size,
                max_inline: 256 << 10,
                segments: vec![(0, size)],
            }
        }
        Request::Segment { id } => {
            let size = script.number().clamp(4096, 16 << 20);
            fds.extend(segment_fd(size, script));
            Reply::Segment {
                size,
                writable: *id != 0 && script.byte() & 1 == 0,
            }
        }
        Request::Shared => {
            let published = script.byte() & 1 == 0;
            if published {
                if let (Ok(dir), Ok(holds)) =
                    (DirectoryRegion::create(64), HoldRegion::create(16, 1))
                {
                    fds.extend(dir.read_only_fd().try_clone().ok().map(OwnedFd::from));
                    fds.extend(holds.fd().try_clone().ok().map(OwnedFd::from));
                    kept.push(Box::new(dir));
                    kept.push(Box::new(holds));
                }
            }
            Reply::Shared { published }
        }
        Request::Lend { at_least, .. } => {
            let size = (*at_least).max(script.number());
            Reply::Lent(Lend {
                id: script.number().max(1),
                segment: u32::from(script.byte() % 3),
                offset: script.number() / 64 * 64,
                size,
                max_object: size / 2,
            })
        }
        Request::Create { name, size, .. } => Reply::Object(object(name, *size, script)),
        Request::Put { name, data, .. } => Reply::Object(object(name, data.len() as u64, script)),
        Request::Publish { name, size, .. } => Reply::Object(object(name, *size, script)),
        Request::PublishMany { items, .. } => Reply::Published(
            items
                .iter()
                .map(|i| match script.byte() & 3 {
                    0 => Err(vovp_proto::Failure {
                        status: vovp_proto::Status::AlreadyExists,
                        message: format!("{} is taken", i.name),
                        figures: None,
                    }),
                    _ => Ok(object(&i.name, i.size, script)),
                })
                .collect(),
        ),
        Request::Seal { .. } => Reply::Version(script.number()),
        Request::Get { names, .. } | Request::GetNewer { names, .. } => Reply::Objects(
            names
                .iter()
                .map(|n| {
                    let size = script.number() % (1 << 20);
                    (script.byte() & 1 == 0).then(|| object(n, size, script))
                })
                .collect(),
        ),
        Request::Contains { .. } => Reply::Bool(script.byte() & 1 == 0),
        Request::Evict { .. } => Reply::Count(script.number()),
        Request::List { .. } => Reply::List {
            entries: Vec::new(),
            next: LIST_END,
        },
        Request::Stats { fields } => Reply::Stats {
            stats: StoreStats {
                capacity: script.number(),
                ..StoreStats::default()
            },
            connections: 1,
            fields: *fields,
        },
        _ => Reply::Empty,
    }
}
