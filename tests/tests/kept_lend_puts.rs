//! Kept puts of 64 KiB and more that return before the store's answer
//! (`Client::put_view_later` through the client's lend, what the Python `put_tensor` of a
//! host tensor up to 4 MiB does): the bytes are copied into the lend, the PUBLISH goes out,
//! and the caller gets the store's copy at once. Real daemon, clients on separate
//! connections. What must survive the missing round trip: others find the object once the
//! put returned; the lend is never taken back or replaced while a PUBLISH into it is still
//! unanswered, nor while a failed put's view still shows its bytes.

use std::time::Duration;

use vovp::{CreateOptions, Store};
use vovp_client::PipelinedView;
use vovp_tests::{pattern, put_later, view_bytes as bytes, Daemon};

const MIB: usize = 1 << 20;

/// With the store stopped (SIGSTOP), a 1 MiB kept put still returns with its view: it
/// waited for nothing. Once the store runs again, another client finds the object, in the
/// same memory, and the view resolves to its id.
#[test]
fn a_kept_lend_put_returns_before_the_store_answers() {
    let d = Daemon::start("1G");
    let c = d.client();
    let other = d.client();
    // The first put takes the lend (a LEND round trip).
    let first = put_later(&c, "first", &pattern(MIB, 1)).expect("through the lend");
    first.wait().unwrap();
    let data = pattern(MIB, 2);
    let stopped = vovp_tests::memfd::Stopped::new(d.child.id());
    let (tx, rx) = std::sync::mpsc::channel();
    let putter = std::thread::spawn(move || {
        let v = put_later(&c, "m", &data).expect("through the lend");
        let _ = tx.send(c.unread_replies());
        (c, v, data)
    });
    let owed = rx.recv_timeout(Duration::from_secs(10));
    drop(stopped);
    let (c, v, data) = putter.join().unwrap();
    assert_eq!(owed, Ok(1), "the put waited for the stopped store");
    assert_eq!(bytes(&v), &data[..]);
    let got = other
        .get_one("m", None)
        .expect("found once the put returned");
    assert_eq!(got.bytes(), &data[..]);
    assert_eq!(got.metadata(), b"meta");
    assert_eq!(got.location(), v.location(), "the same memory, zero-copy");
    v.wait().unwrap();
    let view = v.take_view().expect("the view, once answered");
    assert_eq!((view.version(), view.id()), (1, got.id()));
    // A name already published fails at once; under 64 KiB and over 4 KiB: not this way.
    assert!(matches!(
        c.put_view_later("m", &data, b"", CreateOptions::default()),
        Err(vovp::Error::AlreadyExists(_))
    ));
    assert!(put_later(&c, "mid", &[1u8; 8192]).is_none());
    c.sync().unwrap();
}

/// Kept puts back to back fill lend after lend (16 MiB lends, 1 MiB puts): a full lend whose
/// puts are still unanswered is replaced once their replies are read, so every put goes this
/// way, and every object is stored whole.
#[test]
fn kept_lend_puts_back_to_back_replace_full_lends() {
    let d = Daemon::start("1G");
    let c = d.client();
    let other = d.client();
    let views: Vec<PipelinedView> = (0..40)
        .map(|i| put_later(&c, &format!("b{i}"), &pattern(MIB, i as u32)).expect("this way"))
        .collect();
    assert!(c.unread_replies() > 0, "nothing left unanswered");
    for (i, v) in views.iter().enumerate() {
        let got = other.get_one(&format!("b{i}"), None).expect("stored");
        assert_eq!(got.bytes(), &pattern(MIB, i as u32)[..]);
        assert_eq!(got.location(), v.location());
        v.wait().unwrap();
    }
    c.sync().unwrap();
}

/// A put the store refuses (the name is taken by an unsealed object, which the shared
/// directory does not show) is reported by `wait` and `sync`; its bytes stay readable in the
/// view, in a range of the lend that no object owns. So while the view lives the client
/// takes no new lend and the store, short of memory, does not take this one back (it would
/// free the range, and the client's next lend or object could land there): puts go the
/// waiting way once the lend is full, and the bytes never change.
#[test]
fn a_failed_lend_put_keeps_its_bytes_and_its_lend_until_its_view_goes() {
    // 64 MiB: lends of 1 MiB, objects up to 256 KiB through them.
    let d = Daemon::start("64M");
    let _taken = vovp_tests::taken_unsealed(&d, "taken");
    let c = d.client();
    // (A seed no put below uses: one landing on this range would change its bytes.)
    let mine = pattern(128 << 10, 200);
    let failed = vovp_tests::refused_put_later(&c, "taken", &mine);
    // Fill several lends' worth, each object deleted at once (so a lend would empty).
    let mut waited = 0;
    for i in 0..24u32 {
        let name = format!("fill{i}");
        let data = pattern(128 << 10, i);
        match put_later(&c, &name, &data) {
            Some(v) => v.wait().unwrap(),
            None => {
                waited += 1;
                c.put(&name, &data, b"meta", CreateOptions::default())
                    .unwrap();
            }
        }
        assert_eq!(c.get_one(&name, None).unwrap().bytes(), &data[..]);
        c.delete(&name).unwrap();
        assert_eq!(bytes(&failed), &mine[..], "the failed put's bytes changed");
    }
    assert!(waited > 0, "a full lend held by a failed view was replaced");
    // Short of memory, the store takes back empty lends no put writes into: not this one.
    let hog = d.client();
    let mut held = Vec::new();
    for i in 0.. {
        match hog.put_and_view(&format!("hog{i}"), &[0xee; MIB], b"", Default::default()) {
            Ok(v) => held.push(v),
            Err(vovp::Error::OutOfMemory { .. }) => break,
            Err(e) => panic!("the hog's put failed otherwise: {e}"),
        }
        assert!(i < 128, "a 64 MiB store took 128 MiB");
    }
    for i in 0..4u32 {
        let data = pattern(128 << 10, 100 + i);
        let name = format!("after{i}");
        if c.put(&name, &data, b"", CreateOptions::default()).is_ok() {
            c.delete(&name).unwrap();
        }
    }
    assert_eq!(bytes(&failed), &mine[..], "the lend was taken back");
    drop(held);
    drop(failed);
    c.sync().unwrap();
    assert!(
        put_later(&c, "after", &pattern(128 << 10, 9)).is_some(),
        "a new lend once the failed view is gone"
    );
    c.sync().unwrap();
}

/// While its PUBLISH is unanswered a put still counts as writing into its lend, so the store,
/// short of memory at that moment, cannot take the lend back (it would free the range the
/// PUBLISH names). The store is stopped while another client's create that needs the lend's
/// memory is queued and then the put goes out: whichever the store applies first, the put is
/// stored and the create refused. Once the object is gone the same create succeeds (the
/// emptied lend is taken back), so the refusal was the lend's.
#[test]
fn an_unanswered_lend_put_keeps_its_lend_from_being_taken_back() {
    // 64 MiB: lends of 1 MiB, objects up to 256 KiB through them.
    let d = Daemon::start("64M");
    let c = d.client();
    let warm = put_later(&c, "warm", &pattern(128 << 10, 1)).expect("through the lend");
    warm.wait().unwrap();
    drop(warm);
    c.delete("warm").unwrap();
    // (The new lend's background populate counts as a writer for a moment.)
    std::thread::sleep(Duration::from_millis(300));
    let hog = d.client_with(vovp_client::ClientOptions {
        no_lend_puts: true,
        ..Default::default()
    });
    let big = 64 * MIB - MIB / 2;
    let stopped = vovp_tests::memfd::Stopped::new(d.child.id());
    let queued = {
        let hog = hog.clone();
        std::thread::spawn(move || {
            hog.create("big", big as u64, b"", CreateOptions::default())
                .map(drop)
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    let data = pattern(128 << 10, 2);
    let v = put_later(&c, "p", &data).expect("through the lend");
    drop(stopped);
    assert!(
        matches!(queued.join().unwrap(), Err(vovp::Error::OutOfMemory { .. })),
        "the lend was taken back under an unanswered put"
    );
    v.wait().expect("the put was stored");
    assert_eq!(hog.get_one("p", None).unwrap().bytes(), &data[..]);
    drop(v);
    c.delete("p").unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match hog.create("big", big as u64, b"", CreateOptions::default()) {
            Ok(_) => break,
            Err(vovp::Error::OutOfMemory { .. }) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => panic!("the emptied lend was not taken back: {e}"),
        }
    }
}

/// Two threads of one client put through its lend at once (each copy runs outside the
/// connection lock), and every object is stored whole; a put that finds the lend busy with
/// the other thread's goes the waiting way.
#[test]
fn two_threads_put_through_one_lend() {
    let d = Daemon::start("1G");
    let c = d.client();
    let threads: Vec<_> = (0..2u32)
        .map(|t| {
            let c = c.clone();
            std::thread::spawn(move || {
                for i in 0..30u32 {
                    let (name, data) = (format!("t{t}-{i}"), pattern(256 << 10, t * 64 + i));
                    match put_later(&c, &name, &data) {
                        Some(v) => v.wait().unwrap(),
                        None => drop(c.put_and_view(&name, &data, b"meta", Default::default())),
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    c.sync().unwrap();
    let other = d.client();
    for t in 0..2u32 {
        for i in 0..30u32 {
            let got = other.get_one(&format!("t{t}-{i}"), None).expect("stored");
            assert_eq!(got.bytes(), &pattern(256 << 10, t * 64 + i)[..]);
        }
    }
}

/// A daemon that dies with a kept lend put unanswered: its view reports the loss, and a
/// client that reconnects puts through a lend of the new daemon.
#[test]
fn a_reconnecting_client_puts_through_the_new_daemons_lend() {
    let mut first = Daemon::start("1G");
    let socket = first.socket.clone();
    let c = first.client_with(vovp_client::ClientOptions {
        reconnect: true,
        ..Default::default()
    });
    put_later(&c, "warm", &pattern(MIB, 1))
        .expect("through the lend")
        .wait()
        .unwrap();
    let stopped = vovp_tests::memfd::Stopped::new(first.child.id());
    let lost = put_later(&c, "lost", &pattern(MIB, 2)).expect("through the lend");
    // Killed while stopped: it never reads the PUBLISH. (No SIGCONT to a reaped pid.)
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    std::mem::forget(stopped);
    let second = Daemon::start_with_socket("1G", &socket);
    assert!(lost.wait().is_err(), "a put the old daemon never answered");
    assert!(!c.contains("lost").unwrap(), "the next call reconnects");
    let _ = c.sync(); // (reports the lost put, if not already)
    let data = pattern(MIB, 3);
    let v = put_later(&c, "after", &data).expect("through the new daemon's lend");
    v.wait().unwrap();
    assert_eq!(
        second.client().get_one("after", None).unwrap().bytes(),
        &data[..]
    );
    drop(lost);
}
