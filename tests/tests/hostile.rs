//! Hostile and unlucky clients against the real daemon: each test is the regression test of one
//! defect found by probing (issue "one request can wedge the whole store", D1–D13). Each asserts
//! both the bad client's fate and that everyone else is still served.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use vovp::{CreateOptions, Error, Store};
use vovp_tests::{name_payload, rss_bytes, wait_until, Daemon, Raw};

const T: Duration = Duration::from_secs(20);

fn create_payload(name: &[u8], size: u64) -> Vec<u8> {
    let mut p = name_payload(name);
    p.extend(size.to_le_bytes());
    p.extend(0u32.to_le_bytes()); // flags
    p.push(1); // CPU
    p.extend(0u32.to_le_bytes());
    p.extend(0u32.to_le_bytes()); // no metadata
    p
}

fn get_payload(timeout_ms: i64, names: &[&[u8]]) -> Vec<u8> {
    let mut p = timeout_ms.to_le_bytes().to_vec();
    p.extend((names.len() as u32).to_le_bytes());
    for n in names {
        p.extend(name_payload(n));
    }
    p
}

/// The store answers a plain request within `limit` (it is not wedged).
fn responsive(c: &vovp_client::Client, limit: Duration) -> bool {
    let start = Instant::now();
    c.contains("anything").is_ok() && start.elapsed() < limit
}

/// D1: CREATE of a size near 2^64 while an unreferenced sealed object exists used to spin the
/// daemon at 100 % forever.
#[test]
fn create_of_a_size_near_u64_max_is_out_of_memory_and_the_store_keeps_serving() {
    let d = Daemon::start("16M");
    let good = d.client();
    good.put("cached", b"evictable", b"", CreateOptions::default())
        .unwrap();
    let mut r = Raw::connect(&d);
    r.hello();
    for (i, size) in [u64::MAX, 0xF000_0000_0000_0001, 1 << 63]
        .into_iter()
        .enumerate()
    {
        let id = 10 + i as u64;
        r.send(&Raw::frame(
            vovp_proto::VERSION,
            0x02,
            id,
            &create_payload(b"huge", size),
        ));
        assert_eq!(r.reply(), Some((0x82, id, 3)), "size {size:#x}");
    }
    assert!(responsive(&good, Duration::from_secs(2)));
    assert!(good.contains("cached").unwrap(), "nothing evicted for it");
    // The Rust client says the same.
    assert!(matches!(
        good.create("h", u64::MAX, b"", CreateOptions::default()),
        Err(Error::OutOfMemory { .. })
    ));
}

/// D2: a client that pipelines thousands of requests before HELLO and never reads used to
/// freeze every client (the HELLO reply was a blocking write on the daemon's one thread), and
/// SIGTERM waited for it.
#[test]
fn a_client_that_never_reads_cannot_freeze_the_daemon() {
    let d = Daemon::start_with("16M", &["--write-timeout", "2"]);
    let good = d.client();
    let mut flood = Vec::new();
    for i in 0..20_000u64 {
        flood.extend(Raw::frame(vovp_proto::VERSION, 0x0C, i + 2, &[]));
    }
    flood.extend(Raw::frame(
        vovp_proto::VERSION,
        0x01,
        1,
        &7u32.to_le_bytes(),
    ));
    let mut bad = UnixStream::connect(&d.socket).unwrap();
    bad.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    // Our own send buffer fills too; whatever got through is enough to fill the daemon's side.
    let _ = bad.write_all(&flood);
    for _ in 0..20 {
        assert!(responsive(&good, Duration::from_secs(2)), "store wedged");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The stuck client is disconnected after the write timeout; the store keeps serving.
    wait_until(T, || good.connections().unwrap() == 1);
    let start = Instant::now();
    let status = d.terminate();
    assert!(status.success() && start.elapsed() < Duration::from_secs(5));
    drop(bad);
}

/// D3: one GET frame of millions of 1-byte names pinned hundreds of MB while it waited.
#[test]
fn get_names_are_bounded_per_request() {
    let d = Daemon::start("16M");
    let mut r = Raw::connect(&d);
    r.hello();
    let names: Vec<Vec<u8>> = (0..16_385).map(|i| format!("{i:x}").into_bytes()).collect();
    let refs: Vec<&[u8]> = names.iter().map(Vec::as_slice).collect();
    r.send(&Raw::frame(
        vovp_proto::VERSION,
        0x06,
        5,
        &get_payload(60_000, &refs),
    ));
    let (op, id, payload) = r.reply_payload().unwrap();
    assert_eq!((op, id, payload[0]), (0x86, 5, 15));
    assert!(String::from_utf8_lossy(&payload).contains("at most 16384"));
    // The largest allowed GET still works (and times out with nothing found).
    r.send(&Raw::frame(
        vovp_proto::VERSION,
        0x06,
        6,
        &get_payload(50, &refs[..16_384]),
    ));
    let (op, id, payload) = r.reply_payload().unwrap();
    assert_eq!((op, id, payload[0]), (0x86, 6, 0));
    assert_eq!(
        u32::from_le_bytes(payload[1..5].try_into().unwrap()),
        16_384
    );
    let rss = rss_bytes(d.child.id());
    assert!(rss < 200 << 20, "daemon RSS {rss} after a maximal GET");
}

/// D5: LIST replies grew without bound (refused by clients over 64 MiB); now paged.
#[test]
fn list_is_paged_and_every_object_is_listed_once() {
    let d = Daemon::start("64M");
    let c = d.client();
    let n = 5000;
    for i in 0..n {
        c.put(&format!("obj-{i:05}"), b"x", b"", CreateOptions::default())
            .unwrap();
    }
    let mut names: Vec<String> = c
        .list()
        .unwrap()
        .into_iter()
        .map(|i| i.name.to_string())
        .collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), n);
    // On the wire: the first page stops at the page size and gives a cursor to go on.
    let mut r = Raw::connect(&d);
    r.hello();
    let (_, _, p) = {
        r.send(&Raw::frame(vovp_proto::VERSION, 0x0A, 2, &[]));
        r.reply_payload().unwrap()
    };
    assert_eq!(p[0], 0);
    assert_eq!(u32::from_le_bytes(p[1..5].try_into().unwrap()), 4096);
    let next = u64::from_le_bytes(p[p.len() - 8..].try_into().unwrap());
    assert_ne!(next, u64::MAX);
}

/// D7: a client that half-closes (shutdown(SHUT_WR)) while its GET waits is alive: it gets its
/// real reply and keeps its references until it closes the connection entirely.
#[test]
fn a_half_closed_client_keeps_its_references_and_gets_its_reply() {
    let d = Daemon::start("16M");
    let good = d.client();
    good.put("held", b"bytes", b"", CreateOptions::default())
        .unwrap();
    let mut r = Raw::connect(&d);
    r.hello();
    r.send(&Raw::frame(
        vovp_proto::VERSION,
        0x06,
        2,
        &get_payload(0, &[b"held"]),
    ));
    assert_eq!(r.reply(), Some((0x86, 2, 0)));
    r.send(&Raw::frame(
        vovp_proto::VERSION,
        0x06,
        3,
        &get_payload(700, &[b"never"]),
    ));
    r.0.shutdown(std::net::Shutdown::Write).unwrap();
    let (op, id, p) = r.reply_payload().unwrap();
    assert_eq!((op, id, p[0]), (0x86, 3, 0), "not SHUTTING_DOWN: {p:?}");
    assert_eq!(&p[1..6], &[1, 0, 0, 0, 0], "one name, not found");
    // The daemon has read the half-close (it counts the connection as half-closed) ...
    wait_until(T, || good.stats().unwrap().half_closed == 1);
    // ... and keeps the connection's reference.
    assert_eq!(
        good.stats().unwrap().references,
        1,
        "still held while half-open"
    );
    drop(r);
    wait_until(T, || {
        let s = good.stats().unwrap();
        s.references == 0 && s.half_closed == 0
    });
}

/// D8: a connection that never sends HELLO is closed after the handshake timeout, with a reason.
#[test]
fn a_silent_connection_is_closed_after_the_handshake_timeout() {
    let d = Daemon::start_with("16M", &["--handshake-timeout", "1"]);
    let good = d.client();
    let mut silent = Raw::connect(&d);
    let start = Instant::now();
    let (_, _, p) = silent.reply_payload().expect("a reason before the close");
    assert_eq!(p[0], 18, "PROTOCOL_STATE");
    assert!(String::from_utf8_lossy(&p).contains("no HELLO"));
    assert!(silent.closed());
    assert!(start.elapsed() >= Duration::from_millis(900));
    // Half a frame is not enough either, even after HELLO.
    let mut half = Raw::connect(&d);
    half.hello();
    half.send(&Raw::frame(vovp_proto::VERSION, 0x0C, 9, &[])[..10]);
    let (_, _, p) = half.reply_payload().expect("a reason");
    assert!(String::from_utf8_lossy(&p).contains("incomplete"));
    assert!(half.closed());
    assert!(responsive(&good, Duration::from_secs(2)));
}

/// D8 / connection floods: past the connection limit a client gets a clear refusal, connected
/// clients keep being served, and new clients get in again once others leave.
#[test]
fn connections_beyond_the_limit_are_refused_clearly_and_recover() {
    let d = Daemon::start_with("16M", &["--max-connections", "4"]);
    let good = d.client();
    let mut others: Vec<_> = (0..3).map(|_| d.client()).collect();
    match vovp_client::Client::connect(&d.socket) {
        Err(Error::Connection(msg)) => assert!(msg.contains("at most 4 connections"), "{msg}"),
        Err(other) => panic!("expected a connection refusal, got {other:?}"),
        Ok(_) => panic!("a fifth connection was accepted"),
    }
    assert!(responsive(&good, Duration::from_secs(2)));
    others.pop();
    wait_until(T, || vovp_client::Client::connect(&d.socket).is_ok());
}

/// D9: a subscriber that closes its connection is dropped at once, not at the next
/// notification.
#[test]
fn closed_subscribers_are_dropped_at_once() {
    let d = Daemon::start("16M");
    let good = d.client();
    let sub = good.subscribe().unwrap();
    wait_until(T, || good.connections().unwrap() == 2);
    drop(sub);
    wait_until(Duration::from_secs(3), || good.connections().unwrap() == 1);
}

/// D10: input buffers grown by one large frame are given back: idle connections that once
/// sent 64 MiB no longer pin it.
#[test]
fn idle_connections_do_not_pin_the_buffers_of_their_largest_frame() {
    let d = Daemon::start("16M");
    let base = rss_bytes(d.child.id());
    let mut idle = Vec::new();
    for i in 0..6u64 {
        let mut r = Raw::connect(&d);
        r.hello();
        // A PUT just under the frame limit: refused (over max_inline) after it was read whole.
        let mut put = name_payload(b"big");
        put.extend(0u32.to_le_bytes());
        put.extend(0u32.to_le_bytes());
        let data = (64u64 << 20) - 64;
        put.extend(data.to_le_bytes());
        put.resize(put.len() + data as usize, 0);
        r.send(&Raw::frame(vovp_proto::VERSION, 0x05, i, &put));
        assert_eq!(r.reply(), Some((0x85, i, 15)));
        idle.push(r);
    }
    let rss = rss_bytes(d.child.id());
    assert!(
        rss < base + (128 << 20),
        "daemon RSS {rss} (was {base}) with 6 idle connections"
    );
    assert!(responsive(&d.client(), Duration::from_secs(2)));
}

/// D12: NO_REPLY on anything but RELEASE used to silence errors (a failing CREATE never got an
/// answer); now it is refused with a reply.
#[test]
fn no_reply_is_refused_outside_release() {
    let d = Daemon::start("16M");
    let mut r = Raw::connect(&d);
    r.hello();
    r.send(&Raw::frame_with_flags(
        vovp_proto::VERSION,
        0x02,
        1,
        4,
        &create_payload(b"x", 10),
    ));
    let (op, id, p) = r.reply_payload().unwrap();
    assert_eq!((op, id, p[0]), (0x82, 4, 12));
    assert!(String::from_utf8_lossy(&p).contains("NO_REPLY"));
    assert!(!d.client().contains("x").unwrap());
    assert!(d.client().list().unwrap().is_empty(), "nothing was created");
}

/// D13: a Rust client whose daemon died says so, instead of "failed to fill whole buffer".
#[test]
fn a_dead_daemon_is_a_connection_error() {
    let mut d = Daemon::start("16M");
    let c = d.client();
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    match c.contains("x") {
        Err(Error::Connection(msg)) => {
            assert!(msg.contains("closed the connection"), "{msg}")
        }
        other => panic!("expected a connection error, got {other:?}"),
    }
}

/// Reliability: `-m` larger than the machine can back is refused at start (it would fail later
/// with SIGBUS in whichever client touched the first unbackable page); `--overcommit` starts it
/// anyway with a warning.
#[test]
fn a_store_larger_than_the_machine_is_refused_at_start() {
    let dir = std::env::temp_dir().join(format!("vovp-oc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("s.sock");
    let out = std::process::Command::new(vovp_tests::bin("vovp-engine"))
        .args(["-m", "64T", "-s"])
        .arg(&socket)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("more than this machine can back") && err.contains("--overcommit"),
        "{err}"
    );
    assert!(!socket.exists(), "refused before binding");
    let d = Daemon::start_with("2T", &["--overcommit"]);
    assert!(responsive(&d.client(), Duration::from_secs(2)));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Reliability (fd exhaustion): a flood of connections that runs the daemon out of file
/// descriptors (accept fails with EMFILE) does not stop it serving the connected clients, fills
/// no log with one line per failed accept, and it recovers by itself once fds free up.
#[test]
fn running_out_of_fds_is_survived_and_recovered_from() {
    use std::os::unix::process::CommandExt;
    let dir = std::env::temp_dir().join(format!("vovp-fd-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("s.sock");
    let log = std::fs::File::create(dir.join("log")).unwrap();
    let mut cmd = std::process::Command::new(vovp_tests::bin("vovp-engine"));
    cmd.args(["-m", "16M", "--max-connections", "1000", "-s"])
        .arg(&socket)
        .stderr(log);
    // SAFETY: setrlimit only, between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: 96,
                rlim_max: 96,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    wait_until(T, || UnixStream::connect(&socket).is_ok());
    let good = vovp_client::Client::connect(&socket).unwrap();
    // Far more connections than fds: the kernel queues them, the daemon hits EMFILE.
    let flood: Vec<_> = (0..200)
        .filter_map(|_| UnixStream::connect(&socket).ok())
        .collect();
    assert!(flood.len() > 60, "only {} connections queued", flood.len());
    for _ in 0..20 {
        assert!(
            responsive(&good, Duration::from_secs(2)),
            "connected client starved"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(flood);
    // Recovers by itself: a new client gets in and is served.
    wait_until(T, || {
        vovp_client::Client::connect(&socket).is_ok_and(|c| c.contains("x").is_ok())
    });
    let _ = child.kill();
    let _ = child.wait();
    let text = std::fs::read_to_string(dir.join("log")).unwrap();
    let failures = text.matches("accept failed").count();
    assert!(
        (1..=3).contains(&failures),
        "{failures} accept-failure lines:\n{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Reliability: a subscriber that never reads costs a bounded queue (4096 notifications, then
/// it is dropped as too slow) and is disconnected once its replies stay unread past the write
/// timeout; publishers are never slowed down by it.
#[test]
fn a_subscriber_that_never_reads_is_bounded_and_dropped() {
    let d = Daemon::start_with("64M", &["--write-timeout", "1"]);
    let good = d.client();
    let mut sub = Raw::connect(&d);
    sub.hello();
    sub.send(&Raw::frame(vovp_proto::VERSION, 0x0D, 2, &[]));
    assert_eq!(sub.reply(), Some((0x8D, 2, 0)));
    // From here on the subscriber reads nothing.
    let start = Instant::now();
    // 16000 notifications: more than the queue (4096) plus what the socket buffers hold.
    for i in 0..8_000 {
        let name = format!("n{i}");
        good.put(&name, b"x", b"", CreateOptions::default())
            .unwrap();
        good.delete(&name).unwrap();
    }
    let elapsed = start.elapsed();
    wait_until(T, || good.connections().unwrap() == 1);
    assert!(responsive(&good, Duration::from_secs(2)));
    let rss = rss_bytes(d.child.id());
    assert!(
        rss < 200 << 20,
        "daemon RSS {rss} after 16000 unread notifications"
    );
    assert!(
        elapsed < Duration::from_secs(60),
        "publishing took {elapsed:?}"
    );
}

/// Receives one reply frame and its fds on a raw connection.
fn reply_with_fds(r: &Raw) -> (Vec<u8>, Vec<std::os::fd::OwnedFd>) {
    let mut buf = vec![0u8; 1 << 16];
    let mut got = 0;
    let mut fds = Vec::new();
    loop {
        let n = vovp_shm::fdpass::recv_with_fds(&r.0, &mut buf[got..], &mut fds).unwrap();
        assert!(n > 0, "connection closed");
        got += n;
        if got >= 4 && got >= 4 + u32::from_le_bytes(buf[..4].try_into().unwrap()) as usize {
            buf.truncate(got);
            return (buf, fds);
        }
    }
}

/// The fds a client gets can neither write nor punch holes nor be mapped writable.
fn assert_read_only(fd: &std::os::fd::OwnedFd, size: u64) {
    use std::os::fd::AsRawFd;
    let flags = rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE;
    assert!(rustix::fs::fallocate(fd, flags, 0, 4096).is_err(), "punch");
    assert!(rustix::io::write(fd, b"x").is_err(), "write");
    let map = memmap2::MmapOptions::new()
        .len(size as usize)
        .map_raw(fd.as_raw_fd());
    assert!(map.is_err(), "a writable shared mapping");
}

/// D6: sealed objects were not immutable: every client mapped the whole segment read-write and
/// could overwrite or punch holes into any object. Now the store's segment comes read-only, and
/// another client's arena too; only the creator gets its own arena writable.
#[test]
fn clients_get_read_only_fds_except_for_their_own_arena() {
    let d = Daemon::start("64M");
    let creator = d.client();
    creator
        .put("big", &vec![3u8; 2 << 20], b"", CreateOptions::default())
        .unwrap();
    let view = creator.get_one("big", None).unwrap();
    let vovp::Location::Host { segment, .. } = view.location() else {
        panic!("host object")
    };
    assert_ne!(segment, 0, "created objects live in the creator's arena");

    let r = Raw::connect(&d);
    let mut r = r;
    r.send(&Raw::frame(
        vovp_proto::VERSION,
        0x01,
        1,
        &7u32.to_le_bytes(),
    ));
    let (hello, fds) = reply_with_fds(&r);
    assert_eq!(hello[16], 0, "HELLO ok");
    assert_eq!(fds.len(), 1);
    assert_read_only(&fds[0], 64 << 20);
    // Someone else's arena: read-only too.
    r.send(&Raw::frame(
        vovp_proto::VERSION,
        0x0F,
        2,
        &segment.to_le_bytes(),
    ));
    let (reply, fds) = reply_with_fds(&r);
    assert_eq!(reply[16], 0, "SEGMENT ok");
    let size = u64::from_le_bytes(reply[17..25].try_into().unwrap());
    assert_eq!(reply[25], 0, "not writable for a non-owner");
    assert_read_only(&fds[0], size);
    // An unknown segment is a clear NOT_FOUND.
    r.send(&Raw::frame(
        vovp_proto::VERSION,
        0x0F,
        3,
        &999u32.to_le_bytes(),
    ));
    assert_eq!(r.reply(), Some((0x8F, 3, 1)));
    assert!(view.bytes().iter().all(|&b| b == 3));
}
