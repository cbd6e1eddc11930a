//! Small puts that keep a reference and return before the store's answer
//! (`Client::put_view_later`, what the Python `put_tensor` of a small tensor does): the
//! caller gets the store's copy at once, written into its small lend; the id, version and
//! any failure come with the reply. Real daemon, clients on separate connections; each test
//! checks a promise that must survive the missing round trip: others find the object once
//! the put returned, a failure is reported and never frees the bytes under the caller's
//! view, and the reference goes back however early the view is dropped.

use std::time::Duration;

use vovp::{CreateOptions, Store};
use vovp_client::{Client, PipelinedView};
use vovp_tests::{put_later, view_bytes as bytes, Daemon};

fn client(d: &Daemon) -> Client {
    Client::connect(&d.socket).expect("connect")
}

/// The object's refcount as LIST reports it (None: not listed).
fn refcount(c: &Client, name: &str) -> Option<u32> {
    let all = c.list().unwrap();
    all.iter()
        .find(|o| o.name.as_str() == name)
        .map(|o| o.refcount)
}

#[test]
fn a_kept_small_put_returns_the_stores_copy_before_the_reply() {
    let d = Daemon::start("64M");
    let c = client(&d);
    let other = client(&d);
    let v = put_later(&c, "v", b"sixty-four bytes or so").expect("through the small lend");
    assert_eq!(c.unread_replies(), 1, "it did not wait for the reply");
    assert_eq!(bytes(&v), b"sixty-four bytes or so");
    // Another connection asking after the put returned finds it (the put was counted).
    let got = other
        .get_one("v", None)
        .expect("found right after the put returned");
    assert_eq!(got.bytes(), b"sixty-four bytes or so");
    assert_eq!(got.metadata(), b"meta");
    assert_eq!(got.location(), v.location(), "the same memory, zero-copy");
    // The reply: the object's id and version, and the reference the put keeps.
    v.wait().unwrap();
    let view = v.take_view().expect("the view, once answered");
    assert_eq!((view.version(), view.id()), (1, got.id()));
    assert_eq!(view.as_ptr(), v.as_ptr());
    assert_eq!(
        refcount(&other, "v"),
        Some(2),
        "the putter's and the getter's"
    );
    drop((view, got));
    vovp_tests::wait_until(Duration::from_secs(10), || refcount(&other, "v") == Some(0));
    // A name already published fails at once, nothing sent.
    assert!(matches!(
        c.put_view_later("v", b"again", b"", CreateOptions::default()),
        Err(vovp::Error::AlreadyExists(_))
    ));
    // Too big for the small lend: not this way (the caller puts the waiting way).
    assert!(put_later(&c, "big", &[1u8; 8192]).is_none());
}

/// Dropped before its reply was read, by a client that makes no other call: the reference
/// the reply grants still goes back (the client reads the reply on its own).
#[test]
fn a_view_dropped_before_its_reply_gives_the_reference_back() {
    let d = Daemon::start("64M");
    let watcher = client(&d);
    for delay in [None, Some(Duration::from_millis(2))] {
        let c = d.client_with(vovp_client::ClientOptions {
            release_delay: delay,
            ..Default::default()
        });
        let name = format!("dropped{}", delay.is_some());
        drop(put_later(&c, &name, b"x").expect("pipelined"));
        if delay.is_none() {
            // Without the release thread the reply is read by the client's next call (and
            // the release it causes, queued while that call held the connection, is sent by
            // the one after it, or by `flush`).
            assert!(c.contains(&name).unwrap());
            c.flush();
        }
        vovp_tests::wait_until(Duration::from_secs(10), || {
            refcount(&watcher, &name) == Some(0)
        });
        assert_eq!(c.get_one(&name, None).unwrap().bytes(), b"x");
    }
}

/// A put the store refuses (the name is taken by an unsealed object, which the shared
/// directory does not show) is reported by `wait` and `sync`; its bytes stay readable in the
/// view, and the small lend they are in is never given up while the view lives (the store
/// would free it): puts go the waiting way until the view is dropped.
#[test]
fn a_failed_put_keeps_its_bytes_and_its_lend_until_its_view_goes() {
    let d = Daemon::start("64M");
    let _taken = vovp_tests::taken_unsealed(&d, "taken");
    let c = client(&d);
    let failed = vovp_tests::refused_put_later(&c, "taken", b"mine");
    // Fill far more than one small lend (64 KiB holds 512 of these) while it lives.
    let mut kept = Vec::new();
    let mut waited = 0;
    for i in 0..2000 {
        let name = format!("fill{i}");
        match put_later(&c, &name, &[i as u8; 64]) {
            Some(v) => kept.push((name, v)),
            None => {
                waited += 1;
                c.put(&name, &[i as u8; 64], b"meta", CreateOptions::default())
                    .unwrap();
            }
        }
        assert_eq!(
            bytes(&failed),
            b"mine",
            "the failed put's bytes were reused"
        );
    }
    assert!(
        waited > 0,
        "a full small lend pinned by a failed view was given up"
    );
    c.sync().unwrap();
    for (name, v) in &kept {
        assert_eq!(c.get_one(name, None).unwrap().bytes(), bytes(v));
    }
    drop(failed);
    c.sync().unwrap();
    assert!(
        put_later(&c, "after", b"a").is_some(),
        "a new small lend once the failed view is gone"
    );
    c.sync().unwrap();
    for i in 0..2000 {
        let got = c.get_one(&format!("fill{i}"), None).unwrap();
        assert_eq!(got.bytes(), &[i as u8; 64]);
    }
}

/// Many small puts through a succession of small lends, dropped and deleted, leave no memory
/// behind beyond the current small lend; a client that goes away with replies owed leaves
/// every object stored (its requests are carried out) and none referenced.
#[test]
fn small_lends_come_back_and_a_putter_that_goes_away_loses_nothing() {
    let d = Daemon::start("64M");
    let watcher = client(&d);
    let idle = watcher.stats().unwrap().used_bytes;
    let kept;
    {
        let c = client(&d);
        for round in 0..3 {
            for i in 0..1500 {
                let name = format!("r{round}-{i}");
                let v = put_later(&c, &name, &[7u8; 100]);
                assert!(v.is_some(), "{name} went the waiting way");
            }
            c.sync().unwrap();
            for i in 0..1500 {
                c.delete(&format!("r{round}-{i}")).unwrap();
            }
        }
        // At most the client's small lend (64 KiB) and its current objects' memory.
        let used = watcher.stats().unwrap().used_bytes;
        assert!(used <= idle + (64 << 10), "{used} bytes used, {idle} idle");
        for i in 0..300 {
            drop(put_later(&c, &format!("gone{i}"), &[9u8; 64]));
        }
        kept = put_later(&c, "kept", &[5u8; 64]).expect("pipelined");
    } // dropped with replies owed, one view still held
    for i in 0..300 {
        let got = watcher.get_one(&format!("gone{i}"), None).expect("stored");
        assert_eq!(got.bytes(), &[9u8; 64]);
    }
    // A view outlives its client's handle: it keeps the connection, so its reference, so its
    // bytes are still the store's object.
    vovp_tests::wait_until(Duration::from_secs(10), || {
        refcount(&watcher, "kept") == Some(1)
    });
    assert_eq!(watcher.connections().unwrap(), 2);
    assert_eq!(bytes(&kept), &[5u8; 64]);
    drop(kept);
    // Then the putter's connection closes (the replies it owed do not keep it alive), and none
    // of its references is left.
    vovp_tests::wait_until(Duration::from_secs(10), || {
        watcher.connections().unwrap() == 1
    });
    vovp_tests::wait_until(Duration::from_secs(10), || {
        watcher.list().unwrap().iter().all(|o| o.refcount == 0)
    });
    // Dropped at once after a burst whose views are gone too, replies still on their way:
    // nothing keeps the client (its owed replies must not), so its connection closes.
    {
        let c = client(&d);
        for i in 0..100 {
            drop(put_later(&c, &format!("burst{i}"), &[3u8; 64]));
        }
    }
    vovp_tests::wait_until(Duration::from_secs(10), || {
        watcher.connections().unwrap() == 1
    });
    assert!(watcher.contains("burst99").unwrap());
}

/// A batch of kept puts (`put_views_later`, what `put_tensors` does) goes out as one
/// PUBLISH_MANY with one reply owed; a put in it that the store refuses (a name taken by an
/// unsealed object) fails alone: the others are stored, found by other clients, and answered
/// with their own ids, and `sync` reports the one failure.
#[test]
fn a_batch_of_kept_puts_is_one_message_and_one_refused_put_fails_no_other() {
    let d = Daemon::start("64M");
    let _taken = vovp_tests::taken_unsealed(&d, "b-taken");
    let c = client(&d);
    let other = client(&d);
    let names = ["b-0", "b-1", "b-taken", "b-3"];
    let data: Vec<Vec<u8>> = (0..names.len()).map(|i| vec![i as u8 + 1; 64]).collect();
    let puts: Vec<_> = names
        .iter()
        .zip(&data)
        .map(|(n, d)| (*n, &d[..], &b"meta"[..], CreateOptions::default()))
        .collect();
    // A first put takes the small lend and maps its segment (round trips of their own).
    let warm = put_later(&c, "b-warm", b"w").expect("through the small lend");
    c.sync().unwrap();
    let before = c.last_request_id();
    let views: Vec<PipelinedView> = c
        .put_views_later(&puts)
        .into_iter()
        .map(|a| a.expect("through the small lend").expect("sent"))
        .collect();
    assert_eq!(c.unread_replies(), 1, "one reply owed for the batch");
    assert_eq!(c.last_request_id() - before, 1, "one PUBLISH_MANY");
    for (i, v) in views.iter().enumerate() {
        assert_eq!(bytes(v), &data[i][..]);
    }
    for i in [0, 1, 3] {
        let got = other.get_one(names[i], None).expect("stored");
        assert_eq!(got.bytes(), &data[i][..]);
        assert_eq!(got.location(), views[i].location(), "zero-copy");
    }
    match views[2].wait() {
        Err(vovp::Error::AlreadyExists(why)) => assert!(why.contains("b-taken"), "{why}"),
        other => panic!("expected the refused put's failure, got {other:?}"),
    }
    for i in [0, 1, 3] {
        views[i].wait().unwrap();
        let view = views[i].take_view().expect("answered");
        let got = other.get_one(names[i], None).unwrap();
        assert_eq!((view.id(), view.version()), (got.id(), 1), "{}", names[i]);
    }
    assert!(matches!(c.sync(), Err(vovp::Error::AlreadyExists(_))));
    c.sync().unwrap();
    drop(warm);
}

/// A client may owe 64 replies (`MAX_UNREAD`): a batch of 64 kept puts goes out whole, 8
/// flights, without waiting for the store halfway (with 32 it waited at the fifth flight,
/// and client and store no longer overlapped). Here the store is stopped and answers
/// nothing, so a client that waited would hang until it is resumed.
#[test]
fn a_batch_of_64_goes_out_without_waiting_for_the_store() {
    let d = Daemon::start("64M");
    let c = client(&d);
    let other = client(&d);
    let warm = put_later(&c, "warm", b"w").expect("through the small lend");
    c.sync().unwrap();
    let names: Vec<String> = (0..64).map(|i| format!("n{i}")).collect();
    let data: Vec<Vec<u8>> = (0..64u8).map(|i| vec![i; 64]).collect();
    let stopped = vovp_tests::memfd::Stopped::new(d.child.id());
    let (tx, rx) = std::sync::mpsc::channel();
    let batch = std::thread::spawn(move || {
        let puts: Vec<_> = names
            .iter()
            .zip(&data)
            .map(|(n, d)| (n.as_str(), &d[..], &b"m"[..], CreateOptions::default()))
            .collect();
        let views: Vec<PipelinedView> = c
            .put_views_later(&puts)
            .into_iter()
            .map(|a| a.expect("through the small lend").expect("sent"))
            .collect();
        let owed = c.unread_replies();
        let _ = tx.send(owed);
        (c, views)
    });
    let owed = rx.recv_timeout(Duration::from_secs(10));
    drop(stopped);
    let (c, views) = batch.join().unwrap();
    assert_eq!(
        owed,
        Ok(8),
        "the batch waited for the stopped store (or went out in other than 8 frames)"
    );
    for (i, v) in views.iter().enumerate() {
        v.wait().unwrap();
        let got = other.get_one(&format!("n{i}"), None).expect("stored");
        assert_eq!(got.bytes(), &[i as u8; 64][..]);
    }
    c.sync().unwrap();
    drop(warm);
}

/// Puts of a batch whose write fails (the daemon died) are never answered as stored: a put
/// is answered with a view only once its frame went out (a flight of 8), and then its reply
/// is owed; a put whose flight's write failed gets the connection's error.
#[test]
fn a_batch_whose_write_fails_answers_unsent_puts_with_the_error() {
    let mut d = Daemon::start("64M");
    let c = client(&d);
    let warm = put_later(&c, "warm", b"w").expect("through the small lend");
    c.sync().unwrap();
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    // Its socket is closed a moment after the process (with its io_uring).
    std::thread::sleep(Duration::from_millis(200));
    let names: Vec<String> = (0..12).map(|i| format!("lost{i}")).collect();
    let data = [7u8; 64];
    let puts: Vec<_> = names
        .iter()
        .map(|n| (n.as_str(), &data[..], &b"m"[..], CreateOptions::default()))
        .collect();
    let mut viewed: usize = 0;
    for (i, answer) in c.put_views_later(&puts).into_iter().enumerate() {
        match answer {
            Some(Ok(_)) => viewed += 1,
            Some(Err(vovp::Error::Connection(_))) => {}
            other => panic!("put {i}: {:?}", other.map(|a| a.map(|_| ()))),
        }
    }
    // Every view handed out is of a flight that went out (if the dead daemon's socket still
    // took a write): the first 8 puts are one, the last 4 another.
    assert!(viewed == 0 || viewed == 8 || viewed == 12, "{viewed} views");
    assert_eq!(
        c.unread_replies(),
        viewed.div_ceil(8),
        "a view of a put never sent"
    );
    drop(warm);
}
