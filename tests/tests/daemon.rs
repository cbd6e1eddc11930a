//! The real daemon with clients in other processes.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Output;
use std::time::Duration;

use vovp::{CreateOptions, Error, NotificationKind, Store};
use vovp_tests::{name_payload, pattern, read_line, wait_until, Daemon, Raw};

const T: Duration = Duration::from_secs(20);

#[test]
fn put_in_one_process_get_in_another_sees_the_same_memory() {
    let d = Daemon::start("64M");
    // Another process puts; this one gets the bytes.
    let out = d.cli(&["put", "greeting", "--data", "hello from another process"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let c = d.client();
    assert_eq!(
        &c.get_one("greeting", None).unwrap()[..],
        b"hello from another process"
    );

    // This process creates an object and keeps a pointer into its own mapping; the other process
    // reads through its mapping. Writing after the other process's first read and reading again
    // shows both map the same physical pages (nothing was copied on get).
    let mut buf = c
        .create("shared", 4096, b"", CreateOptions::default())
        .unwrap();
    buf.as_mut_slice().fill(b'A');
    let ptr = buf.as_mut_ptr();
    let _view = buf.seal().unwrap();
    let first = d.cli(&["get", "shared"]);
    assert_eq!(first.stdout, vec![b'A'; 4096]);
    // SAFETY: deliberately writing a sealed object we hold, to observe the sharing.
    unsafe { std::ptr::write_bytes(ptr, b'B', 4096) };
    let second = d.cli(&["get", "shared"]);
    assert_eq!(second.stdout, vec![b'B'; 4096]);

    // Large objects go through create + parallel copy + seal.
    let big: Vec<u8> = (0..(8 << 20)).map(|i: u32| (i % 241) as u8).collect();
    c.put("big", &big, b"m", CreateOptions::default()).unwrap();
    let got = d.cli(&["get", "big"]);
    assert!(got.stdout == big);
}

#[test]
fn killed_clients_release_everything() {
    let d = Daemon::start("64M");
    let c = d.client();
    c.put("held", &[1u8; 10_000], b"", CreateOptions::default())
        .unwrap();
    let mut holder = d.fixture_spawn(&["hold", "held"]);
    assert_eq!(read_line(&mut holder), "holding");
    let mut creator = d.fixture_spawn(&["create-hold", "half-written", "1000000"]);
    assert_eq!(read_line(&mut creator), "created");
    let s = c.stats().unwrap();
    assert_eq!((s.references, s.unsealed), (2, 1));
    holder.kill().unwrap();
    creator.kill().unwrap();
    let _ = (holder.wait(), creator.wait());
    wait_until(T, || {
        let s = c.stats().unwrap();
        s.references == 0 && s.unsealed == 0
    });
    assert!(!c.contains("half-written").unwrap());
    c.delete("held").unwrap();
    let s = c.stats().unwrap();
    assert_eq!((s.used_bytes, s.objects), (0, 0), "{s:?}");
}

#[test]
fn thirty_two_processes_hammering_leave_consistent_stats() {
    let d = Daemon::start("256M");
    let children: Vec<_> = (0..32)
        .map(|i| {
            d.fixture_spawn(&[
                "hammer",
                "--seconds",
                "3",
                "--seed",
                &(i + 1).to_string(),
                "--names",
                "24",
            ])
        })
        .collect();
    let mut total = 0u64;
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "hammer failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        total += String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse::<u64>()
            .unwrap();
    }
    assert!(total > 1000, "only {total} operations");
    let c = d.client();
    wait_until(T, || {
        let s = c.stats().unwrap();
        s.references == 0 && s.unsealed == 0 && s.pending_delete == 0
    });
    for info in c.list().unwrap() {
        assert!(info.sealed);
        c.delete(info.name.as_str()).unwrap();
    }
    let s = c.stats().unwrap();
    assert_eq!((s.objects, s.used_bytes, s.references), (0, 0, 0), "{s:?}");
}

#[test]
fn malformed_input_gets_errors_and_the_daemon_keeps_serving() {
    let d = Daemon::start("16M");
    let good = d.client();
    good.put("survivor", b"still here", b"", CreateOptions::default())
        .unwrap();

    // Anything before HELLO.
    let mut r = Raw::connect(&d);
    r.send(&Raw::frame(vovp_proto::VERSION, 0x0C, 5, &[]));
    assert_eq!(r.reply(), Some((0x8C, 5, 18)));
    r.hello();
    // Unknown opcode, truncated payload, trailing bytes, name too long, bad UTF-8: an error
    // reply each, and the connection stays usable.
    r.send(&Raw::frame(vovp_proto::VERSION, 0x55, 6, &[1, 2, 3]));
    assert_eq!(r.reply(), Some((0xD5, 6, 14)));
    r.send(&Raw::frame(vovp_proto::VERSION, 0x03, 7, &[200, 0, b'x']));
    assert_eq!(r.reply(), Some((0x83, 7, 12)));
    r.send(&Raw::frame(vovp_proto::VERSION, 0x0C, 8, &[0]));
    assert_eq!(r.reply(), Some((0x8C, 8, 12)));
    let mut create = name_payload(&[b'n'; 300]);
    create.extend(10u64.to_le_bytes());
    create.extend(0u32.to_le_bytes());
    create.push(1);
    create.extend(0u32.to_le_bytes());
    create.extend(0u32.to_le_bytes());
    r.send(&Raw::frame(vovp_proto::VERSION, 0x02, 9, &create));
    assert_eq!(r.reply(), Some((0x82, 9, 7)));
    r.send(&Raw::frame(
        vovp_proto::VERSION,
        0x08,
        10,
        &name_payload(&[0xff, 0xfe]),
    ));
    assert_eq!(r.reply(), Some((0x88, 10, 7)));
    // A GET whose count claims four billion names.
    let mut get = 0i64.to_le_bytes().to_vec();
    get.extend(u32::MAX.to_le_bytes());
    r.send(&Raw::frame(vovp_proto::VERSION, 0x06, 11, &get));
    assert_eq!(r.reply(), Some((0x86, 11, 12)));
    // Release of something never held.
    let mut rel = 1u32.to_le_bytes().to_vec();
    rel.extend(12345u64.to_le_bytes());
    r.send(&Raw::frame(vovp_proto::VERSION, 0x07, 12, &rel));
    assert_eq!(r.reply(), Some((0x87, 12, 9)));
    r.send(&Raw::frame(
        vovp_proto::VERSION,
        0x08,
        13,
        &name_payload(b"survivor"),
    ));
    assert_eq!(r.reply(), Some((0x88, 13, 0)));

    // Wrong version and absurd length: an error, then the connection is closed.
    let mut v = Raw::connect(&d);
    v.send(&Raw::frame(9, 0x01, 1, &[0; 4]));
    assert_eq!(v.reply().map(|x| x.2), Some(13));
    assert!(v.closed());
    let mut l = Raw::connect(&d);
    let mut absurd = u32::MAX.to_le_bytes().to_vec();
    absurd.extend([1, 1, 0, 0]);
    absurd.extend(1u64.to_le_bytes());
    l.send(&absurd);
    assert_eq!(l.reply().map(|x| x.2), Some(15));
    assert!(l.closed());
    // A client vanishing mid-frame, and one vanishing mid-put.
    let mut m = Raw::connect(&d);
    m.hello();
    let mut partial = Raw::frame(vovp_proto::VERSION, 0x05, 2, &[0u8; 1000]);
    partial.truncate(100);
    m.send(&partial);
    drop(m);
    let mut oversized_put = name_payload(b"too-big");
    oversized_put.extend(0u32.to_le_bytes());
    oversized_put.extend(0u32.to_le_bytes());
    oversized_put.extend((2u64 << 20).to_le_bytes());
    oversized_put.extend(vec![0u8; 2 << 20]);
    let mut p = Raw::connect(&d);
    p.hello();
    p.send(&Raw::frame(vovp_proto::VERSION, 0x05, 3, &oversized_put));
    assert_eq!(p.reply(), Some((0x85, 3, 15)));

    // Everyone else is still served, and nothing leaked.
    assert_eq!(&good.get_one("survivor", None).unwrap()[..], b"still here");
    wait_until(T, || good.stats().unwrap().references == 0);
    assert_eq!(good.stats().unwrap().objects, 1);
}

#[test]
fn errors_travel_as_typed_errors() {
    let d = Daemon::start("1M");
    let c = d.client();
    assert!(matches!(
        c.get_one("missing", None),
        Err(Error::NotFound(_))
    ));
    assert!(matches!(c.delete("missing"), Err(Error::NotFound(_))));
    let held = c
        .create("a", 700_000, b"", CreateOptions::default())
        .unwrap();
    match c.create("b", 700_000, b"", CreateOptions::default()) {
        Err(Error::OutOfMemory {
            requested,
            available,
        }) => {
            assert_eq!(requested, 700_000);
            assert!(available < 700_000);
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    drop(held);
    c.put("x", b"1", b"", CreateOptions::default()).unwrap();
    assert!(matches!(
        c.put("x", b"2", b"", CreateOptions::default()),
        Err(Error::AlreadyExists(_))
    ));
    assert!(matches!(
        c.get_one(&"n".repeat(300), None),
        Err(Error::InvalidName(_))
    ));
}

#[test]
fn get_waits_for_a_seal_from_another_process() {
    let d = Daemon::start("16M");
    let c = d.client();
    let mut creator = d.fixture_spawn(&["create-hold", "later", "64", "--seconds", "1"]);
    assert_eq!(read_line(&mut creator), "created");
    // Unsealed: not visible; the creator then exits without sealing, which aborts it.
    assert!(c.get(&["later"], Some(Duration::from_millis(100))).unwrap()[0].is_none());
    creator.wait().unwrap();
    wait_until(T, || c.stats().unwrap().unsealed == 0);
    let socket = d.socket.clone();
    let t = std::thread::spawn(move || {
        let other = vovp_client::Client::connect(&socket).unwrap();
        // Once the GET below waits (the daemon counts it), not before.
        wait_until(T, || other.stats().unwrap().waiting_gets == 1);
        other
            .put("later", b"sealed now", b"", CreateOptions::default())
            .unwrap();
    });
    let v = c.get_one("later", Some(Duration::from_secs(20))).unwrap();
    assert_eq!(&v[..], b"sealed now");
    t.join().unwrap();
}

#[test]
fn subscribers_see_seals_and_deletes() {
    let d = Daemon::start("16M");
    let c = d.client();
    let mut sub = c.subscribe().unwrap();
    let out = d.cli(&["put", "news", "--data", "x"]);
    assert!(out.status.success());
    let n = sub.next(Some(T)).unwrap().expect("a notification within T");
    assert_eq!(
        (n.kind, n.name.as_str(), n.size),
        (NotificationKind::Sealed, "news", 1)
    );
    c.delete("news").unwrap();
    let n = sub.next(Some(T)).unwrap().expect("a notification within T");
    assert_eq!(n.kind, NotificationKind::Deleted);
    // Nothing more: a timeout, and the stream is still usable after it.
    assert!(sub.next(Some(Duration::from_millis(50))).unwrap().is_none());
    let out = d.cli(&["put", "later", "--data", "yz"]);
    assert!(out.status.success());
    let n = sub
        .next(Some(T))
        .unwrap()
        .expect("a notification after a timeout");
    assert_eq!((n.name.as_str(), n.size), ("later", 2));
    // A closer ends a `next` blocked in another thread.
    let closer = sub.closer().unwrap();
    let blocked = std::thread::spawn(move || sub.next(None));
    std::thread::sleep(Duration::from_millis(50));
    closer.close();
    assert!(matches!(
        blocked.join().unwrap(),
        Err(vovp::Error::Connection(_))
    ));
}

#[test]
fn async_client_round_trip() {
    let d = Daemon::start("16M");
    let rt = std::thread::spawn({
        let socket = d.socket.clone();
        move || {
            let runtime = vovp_tests::runtime();
            runtime.block_on(async move {
                use vovp::AsyncStore;
                let c = vovp_client::AsyncClient::connect(&socket).await.unwrap();
                c.put("async", b"from async", b"", CreateOptions::default())
                    .await
                    .unwrap();
                let v = AsyncStore::get(&c, &["async"], None).await.unwrap();
                assert_eq!(&v[0].as_ref().unwrap()[..], b"from async");
                let big = vec![7u8; 3 << 20];
                c.put("async-big", &big, b"", CreateOptions::default())
                    .await
                    .unwrap();
                drop(v);
                c.flush().await.unwrap();
                AsyncStore::stats(&c).await.unwrap()
            })
        }
    });
    let stats = rt.join().unwrap();
    assert_eq!((stats.objects, stats.references), (2, 0));
    assert_eq!(&d.cli(&["get", "async"]).stdout, b"from async");
}

/// Regression: an async client's `ObjectBuffer::seal` went through a second (blocking)
/// connection, i.e. sealed as another holder, and the daemon refused it (NOT_CREATOR). It
/// seals on the client's own connection now: with the connection free (a single-threaded
/// runtime), and while another task's GET holds it (a multi-threaded runtime: the seal waits
/// for the GET, which another process answers). An async client is one connection.
#[test]
fn async_client_buffer_seals_as_its_creator() {
    use vovp::AsyncStore;
    let d = Daemon::start("16M");
    let watcher = d.client();
    let before = watcher.connections().unwrap();
    let socket = d.socket.clone();
    let async_client = std::thread::spawn(move || {
        vovp_tests::runtime().block_on(async move {
            let c = vovp_client::AsyncClient::connect(&socket).await.unwrap();
            let mut buf =
                AsyncStore::create(&c, "sealed-by-buffer", 64, b"", CreateOptions::default())
                    .await
                    .unwrap();
            buf.as_mut_slice().fill(7);
            let view = buf.seal().expect("the creator's connection seals");
            assert_eq!(&view[..], &[7u8; 64][..]);
            drop(view);
            c.flush().await.unwrap();
            c
        })
    })
    .join()
    .unwrap();
    // One connection (before the fix, a second one for seals).
    let c = async_client;
    assert_eq!(watcher.connections().unwrap(), before + 1);
    drop(c);
    wait_until(T, || watcher.connections().unwrap() == before);
    assert_eq!(d.cli(&["get", "sealed-by-buffer"]).stdout, vec![7u8; 64]);

    let socket = d.socket.clone();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let sealed = runtime.block_on(async move {
        let c = vovp_client::AsyncClient::connect(&socket).await.unwrap();
        assert_eq!(watcher.connections().unwrap(), before + 1);
        let mut buf = AsyncStore::create(&c, "sealed-while-busy", 8, b"", CreateOptions::default())
            .await
            .unwrap();
        buf.as_mut_slice().fill(9);
        // Another task's GET waits on the connection for an object another process puts.
        let waiting = tokio::spawn({
            let c = c.clone();
            async move { AsyncStore::get(&c, &["later"], Some(T)).await }
        });
        // The GET is in place (the daemon counts it): it holds the connection until answered,
        // so the seal below finds the connection busy and waits for it, off the runtime.
        let watcher = tokio::task::spawn_blocking(move || {
            wait_until(T, || watcher.stats().unwrap().waiting_gets == 1);
            watcher
        })
        .await
        .unwrap();
        let sealing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        // Sealed from a task on a worker thread, as async code would.
        let seal = tokio::spawn({
            let sealing = sealing.clone();
            async move {
                sealing.store(true, std::sync::atomic::Ordering::SeqCst);
                buf.seal()
            }
        });
        // Once the seal has started, another process puts what the GET waits for.
        let put = std::thread::spawn(move || {
            while !sealing.load(std::sync::atomic::Ordering::SeqCst) {
                std::thread::yield_now();
            }
            watcher
                .put("later", b"now", b"", CreateOptions::default())
                .unwrap();
        });
        let view = seal.await.unwrap().unwrap();
        put.join().unwrap();
        let got = waiting.await.unwrap().unwrap();
        assert_eq!(&got[0].as_ref().unwrap()[..], b"now");
        view.to_vec()
    });
    assert_eq!(sealed, vec![9u8; 8]);
    assert_eq!(d.cli(&["get", "sealed-while-busy"]).stdout, vec![9u8; 8]);
}

/// The blocking client's extras for the Python core: `put_many` (one write, one round trip),
/// `seal_later` (the reply read in front of the next request's), `private_view` (writes stay
/// in this process), `put_id`, `close` (the daemon releases everything; no call after it).
#[test]
fn blocking_client_extras() {
    let d = Daemon::start("16M");
    let c = d.client();
    let other = d.client();
    let before = c.last_request_id();
    let views = c
        .put_many(&[
            ("m1", b"one", b"", CreateOptions::default()),
            ("m2", b"two", b"", CreateOptions::default()),
            ("m1", b"again", b"", CreateOptions::default()),
        ])
        .unwrap();
    assert_eq!(c.last_request_id(), before + 3, "three PUTs, nothing else");
    assert_eq!(&views[0].as_ref().unwrap()[..], b"one");
    assert_eq!(&views[1].as_ref().unwrap()[..], b"two");
    assert!(matches!(views[2], Err(Error::AlreadyExists(_))));

    let mut buf = c.create("later", 4, b"", CreateOptions::default()).unwrap();
    buf.as_mut_slice().copy_from_slice(b"abcd");
    c.seal_later("later").unwrap();
    // Its release goes out after the SEAL (one connection, in order): the object stays.
    drop(buf.into_view());
    assert_eq!(c.unread_replies(), 1);
    // Another process's GET waits for the seal, which went out without a round trip.
    assert_eq!(
        d.cli(&["get", "later", "--timeout-ms", "20000"]).stdout,
        b"abcd"
    );
    c.seal_later("m1").unwrap(); // fails (already sealed): only a warning, later
    assert!(c.contains("later").unwrap());
    assert_eq!(c.unread_replies(), 0);

    // A private view of another client's object: writable here, unchanged in the store.
    let theirs = other.get_one("m2", None).unwrap();
    let mine = other.private_view(&theirs).unwrap().expect("a host object");
    // SAFETY: a private copy-on-write mapping of the object's 3 bytes, kept by `mine`.
    unsafe { std::ptr::copy_nonoverlapping(b"TWO".as_ptr(), mine.ptr, 3) };
    assert_eq!(&other.get_one("m2", None).unwrap()[..], b"two");
    assert_eq!(d.cli(&["get", "m2"]).stdout, b"two");

    let id = c
        .put_id("with-id", b"x", b"", CreateOptions::default())
        .unwrap();
    assert!(c
        .list()
        .unwrap()
        .iter()
        .any(|i| i.id.get() == id && i.name.as_str() == "with-id"));
    assert_eq!(c.max_inline(), vovp_proto::MAX_INLINE);

    // Closed with views alive: the daemon drops the connection's references at once.
    let watcher = d.client();
    let refs = watcher.stats().unwrap().references;
    assert!(refs >= 2, "{refs}");
    c.close();
    assert!(matches!(c.contains("m1"), Err(Error::Connection(_))));
    wait_until(T, || watcher.stats().unwrap().references == refs - 2);
    drop(views); // sends nothing on the closed connection
    drop(theirs);
}

#[test]
fn socket_lifecycle_live_stale_and_clean_shutdown() {
    let d = Daemon::start("8M");
    // A second daemon on the same live socket refuses to start.
    let second = std::process::Command::new(vovp_tests::bin("vovp-engine"))
        .args(["-m", "8M", "-s"])
        .arg(&d.socket)
        .output()
        .unwrap();
    assert!(!second.status.success());
    assert!(String::from_utf8_lossy(&second.stderr).contains("already serves"));
    let mode = std::fs::metadata(&d.socket)
        .map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o777)
        .unwrap();
    assert_eq!(mode, 0o600);
    // SIGTERM: clean exit, socket file removed.
    let socket = d.socket.clone();
    let status = d.terminate();
    assert!(status.success(), "{status:?}");
    assert!(!socket.exists());
}

#[test]
fn stale_socket_is_replaced() {
    let mut d = Daemon::start("8M");
    d.child.kill().unwrap(); // SIGKILL leaves the socket file behind
    d.child.wait().unwrap();
    assert!(d.socket.exists());
    let d2 = Daemon::start_with_socket("8M", &d.socket);
    assert!(d2.client().stats().is_ok());
}

/// The uid the `--allow-uid` tests run their other clients as.
const NOBODY: &str = "65534";

/// Whether this process may start clients under another uid: root (and `setpriv`, where the
/// client is not the fixture, which drops to the uid itself); says why not otherwise.
fn may_run_clients_as_another_uid(with_setpriv: bool) -> bool {
    if unsafe { libc::getuid() } != 0 || (with_setpriv && !Path::new(SETPRIV).exists()) {
        vovp_tests::precondition_missing(
            "needs root (and setpriv for the CLI) to run a client under another uid",
        );
        return false;
    }
    true
}

const SETPRIV: &str = "/usr/bin/setpriv";

#[test]
fn peers_outside_the_allowed_uids_are_refused() {
    if !may_run_clients_as_another_uid(true) {
        return;
    }
    let as_nobody = |d: &Daemon| {
        std::process::Command::new(SETPRIV)
            .args(["--reuid", NOBODY, "--regid", NOBODY, "--clear-groups"])
            .arg(vovp_tests::bin("vovp"))
            .arg("-s")
            .arg(&d.socket)
            .arg("stats")
            .output()
            .unwrap()
    };
    // World-connectable socket, but uid 65534 is not allowed: refused by SO_PEERCRED.
    let d = Daemon::start_with("8M", &["--socket-mode", "666"]);
    let out = as_nobody(&d);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("closed the connection"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Allowed explicitly: served.
    let d = Daemon::start_with("8M", &["--socket-mode", "666", "--allow-uid", NOBODY]);
    let out = as_nobody(&d);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `vovp-fixture --as-uid 65534 ARGS` against `d`, to completion (the fixture starts as root
/// and drops to the other uid before it connects).
fn as_nobody(d: &Daemon, args: &[&str]) -> Output {
    let mut all = vec!["--as-uid", NOBODY];
    all.extend(args);
    d.fixture(&all)
}

fn text(out: &Output) -> String {
    format!(
        "{}: {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Asserts that `out` is a `write-view` that died of SIGSEGV at its write.
fn assert_write_faulted(out: &Output, what: &str) {
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGSEGV),
        "{what}: {}",
        text(out)
    );
    assert_eq!(out.stdout, b"got\n", "{what}: {}", text(out));
}

/// An `--allow-uid` client (another uid) with client arenas (the default): it gets only
/// read-only fds of memory it did not create, so it reads everyone's objects (segment 0, other
/// clients' arenas; through its hold table or over the socket) and faults writing them; what
/// it puts or creates goes into arenas of its own, which it alone may write.
#[test]
fn a_client_of_another_uid_reads_everything_but_writes_only_what_it_created() {
    if !may_run_clients_as_another_uid(false) {
        return;
    }
    let d = Daemon::start_with("256M", &["--socket-mode", "666", "--allow-uid", NOBODY]);
    let c = d.client();
    // This uid's objects: in segment 0 (an inline put, which the store copies in) and in this
    // client's arena (a put through its lend; a big one through CREATE).
    let ours = [
        ("inline", pattern(10_000, 1)),
        ("lent", pattern(200_000, 2)),
        ("created", pattern(3 << 20, 3)),
    ];
    for (name, data) in &ours {
        c.put(name, data, name.as_bytes(), CreateOptions::default())
            .unwrap();
    }
    c.sync().unwrap();

    let out = as_nobody(&d, &["read", "inline", "lent", "created"]);
    let expected: String = ours
        .iter()
        .map(|(name, data)| {
            format!(
                "{name} len={} fnv={:x} meta={name}\n",
                data.len(),
                vovp_tests::fnv(data)
            )
        })
        .collect();
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout), expected);
    // Its mappings of them are read-only: a write through a view is SIGSEGV.
    for (name, _) in &ours {
        assert_write_faulted(&as_nobody(&d, &["write-view", name]), name);
    }
    // A private view is writable, and stays private: the view still reads the store's bytes.
    let out = as_nobody(&d, &["write-view", "--private", "lent"]);
    assert!(out.status.success(), "{}", text(&out));
    let lent_fnv = vovp_tests::fnv(&ours[1].1);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("got\nfnv={lent_fnv:x}\n")
    );
    for (name, data) in &ours {
        assert!(c.get_one(name, None).unwrap()[..] == data[..], "{name}");
    }

    // Its own objects: inline, through its lend, through CREATE (a put too big for a lend, and
    // a create written in place): into arenas of its own, which its fds may write. What each
    // is charged shows the way it went: 64-byte units, or a whole lend of 4 MiB.
    for (name, size, how, charged) in [
        ("theirs-inline", 1_000, "put", 1_024),
        ("theirs-lent", 200_000, "put", 4 << 20),
        ("theirs-put", 3 << 20, "put", 3 << 20),
        ("theirs-created", 100_000, "--create", 100_032),
    ] {
        let used = c.stats().unwrap().used_bytes;
        let size = size.to_string();
        let mut args = vec!["put", name, &size];
        if how == "--create" {
            args.push(how);
        }
        let connections = c.connections().unwrap();
        let out = as_nobody(&d, &args);
        // A fresh client's first put of 64 KiB or more asks for a lend, whatever its size, to
        // learn how big a lend's objects may be: "theirs-put" leaves an empty lend behind,
        // charged until the daemon has handled the process's exit (counted out of
        // `connections` after the lend is freed).
        wait_until(T, || c.connections().unwrap() == connections);
        assert_eq!(c.stats().unwrap().used_bytes - used, charged, "{name}");
        assert!(
            out.status.success() && out.stdout == b"ok\n",
            "{name}: {}",
            text(&out)
        );
        let v = c.get_one(name, None).unwrap();
        assert!(
            v.len().to_string() == size && v.iter().all(|&b| b == 0x5A),
            "{name}"
        );
    }
    // And this uid's clients, in turn, map the other uid's arenas read-only.
    assert_write_faulted(&d.fixture(&["write-view", "theirs-lent"]), "theirs-lent");
    assert_write_faulted(&d.fixture(&["write-view", "theirs-put"]), "theirs-put");

    // The clients that faulted left nothing behind.
    wait_until(T, || {
        let s = c.stats().unwrap();
        (s.references, s.unsealed, s.holders, s.objects) == (0, 0, 0, 7)
    });
}

/// With `--prefault` every object lives in segment 0, which the daemon's own uid's clients
/// write but a client of another uid gets read-only: it can put only inline (the store
/// copies the bytes in), and a CREATE is a clear error, the object aborted (`actors/src/segment.rs`,
/// "What isolation does and does not cover").
#[test]
fn with_prefault_a_client_of_another_uid_puts_only_inline() {
    if !may_run_clients_as_another_uid(false) {
        return;
    }
    let d = Daemon::start_with(
        "128M",
        &["--prefault", "--socket-mode", "666", "--allow-uid", NOBODY],
    );
    let c = d.client();
    let data = pattern(300_000, 4);
    c.put("ours", &data, b"m", CreateOptions::default())
        .unwrap();
    let out = as_nobody(&d, &["read", "ours"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("ours len=300000 fnv={:x} meta=m\n", vovp_tests::fnv(&data)),
        "{}",
        text(&out)
    );
    assert_write_faulted(&as_nobody(&d, &["write-view", "ours"]), "ours");

    let out = as_nobody(&d, &["put", "small", "1000"]);
    assert!(out.stdout == b"ok\n", "{}", text(&out));
    assert_eq!(&c.get_one("small", None).unwrap()[..], &[0x5A; 1000][..]);
    // Too big to go inline (and no lends without arenas), or a create: refused, saying why.
    for args in [
        &["put", "big", "300000"][..],
        &["put", "made", "100", "--create"],
    ] {
        let out = as_nobody(&d, args);
        let said = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", text(&out));
        assert!(
            said.starts_with("err Protocol(") && said.contains("may not write"),
            "{args:?}: {said}"
        );
    }
    wait_until(T, || {
        let s = c.stats().unwrap();
        (s.unsealed, s.references, s.objects) == (0, 0, 2)
    });
    assert!(!c.contains("big").unwrap() && !c.contains("made").unwrap());
    // The names are free for a client that may write there.
    c.put("big", &data, b"", CreateOptions::default()).unwrap();
    assert!(c.get_one("big", None).unwrap()[..] == data[..]);
}

#[test]
fn cuda_put_without_a_gpu_is_a_clear_error_and_the_daemon_keeps_serving() {
    let d = Daemon::start("8M");
    let c = d.client();
    let cuda = CreateOptions {
        device: Some(vovp::Device::Cuda(0)),
        ..Default::default()
    };
    match c.create("gpu-tensor", 4096, b"", cuda) {
        Err(Error::GpuUnavailable(reason)) => assert!(!reason.is_empty()),
        Ok(_) => eprintln!("this machine has a GPU: see gpu/check.sh for the GPU checks"),
        Err(other) => panic!("expected GpuUnavailable, got {other:?}"),
    }
    c.put("host-tensor", b"fine", b"", CreateOptions::default())
        .unwrap();
    assert_eq!(&c.get_one("host-tensor", None).unwrap()[..], b"fine");
}

#[test]
fn a_client_killed_while_waiting_in_a_get_releases_at_once() {
    let d = Daemon::start("16M");
    let c = d.client();
    c.put("held", &[3u8; 1000], b"", CreateOptions::default())
        .unwrap();
    // Holds "held", then blocks in a GET (one-hour timeout) for a name nobody will seal.
    let mut waiter = d.fixture_spawn(&["hold", "held", "--wait-for", "never-sealed"]);
    assert_eq!(read_line(&mut waiter), "holding");
    // The GET is in the daemon: its waiter is registered (no guessed sleep).
    wait_until(T, || c.stats().unwrap().waiting_gets == 1);
    assert_eq!(c.stats().unwrap().references, 1);
    waiter.kill().unwrap();
    let _ = waiter.wait();
    // Well before the GET's timeout: the daemon noticed the dead peer and released.
    wait_until(Duration::from_secs(5), || {
        c.stats().unwrap().references == 0
    });
    // And the store still serves, including a later seal of the awaited name.
    c.put("never-sealed", b"x", b"", CreateOptions::default())
        .unwrap();
    assert!(c.contains("never-sealed").unwrap());
}
