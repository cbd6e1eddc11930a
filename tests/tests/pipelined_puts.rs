//! Pipelined puts (issue 13's "publishing ... may be pipelined"): a small `put` returns once its
//! request is written. Real daemon, clients on separate connections and in other processes;
//! each test checks a promise that must survive the missing round trip: others find what was
//! put, failures are reported (once, by `sync`), nothing is lost when the putter exits at
//! once, and a client that lies about its count delays no one for long.

use std::time::{Duration, Instant};

use vovp::{CreateOptions, Store};
use vovp_tests::{Daemon, Raw};

fn client(d: &Daemon) -> vovp_client::Client {
    vovp_client::Client::connect(&d.socket).expect("connect")
}

fn put(c: &vovp_client::Client, name: &str, data: &[u8]) -> Result<(), vovp::Error> {
    c.put(name, data, b"", CreateOptions::default())
}

#[test]
fn a_small_put_returns_before_its_reply_and_sync_reads_it() {
    let d = Daemon::start("64M");
    let c = client(&d);
    put(&c, "p", b"pipelined").unwrap();
    assert_eq!(c.unread_replies(), 1, "the put did not wait for its reply");
    c.sync().unwrap();
    assert_eq!(c.unread_replies(), 0);
    let got = c.get_one("p", None).unwrap();
    assert_eq!(got.bytes(), b"pipelined");

    // Opted out: every put waits.
    let waiting = d.client_with(vovp_client::ClientOptions {
        no_pipelined_puts: true,
        ..Default::default()
    });
    put(&waiting, "w", b"waited").unwrap();
    assert_eq!(waiting.unread_replies(), 0);
}

/// The promise that makes pipelining safe: once `put` returned, another client that asks is
/// answered after the put was applied, however far behind the daemon is with the putter's
/// socket. Many puts in a burst, each checked by another connection with a non-waiting get
/// and a `contains` right after it returned.
#[test]
fn another_client_asking_after_put_returned_finds_the_object() {
    let d = Daemon::start("256M");
    let putter = client(&d);
    let asker = client(&d);
    let data = [7u8; 64];
    for i in 0..2000 {
        let name = format!("o{i}");
        put(&putter, &name, &data).unwrap();
        if i % 2 == 0 {
            let got = asker.get(&[name.as_str()], None).unwrap();
            assert!(
                got[0].is_some(),
                "{name} missing right after its put returned"
            );
        } else {
            assert!(asker.contains(&name).unwrap(), "{name} missing in contains");
        }
    }
    putter.sync().unwrap();
    // A name nobody put is missing at once: with every put applied, the miss makes no barrier
    // (a count in STATS, not a clock).
    let barriers = asker.stats().unwrap().put_barriers;
    assert!(asker.get(&["never"], None).unwrap()[0].is_none());
    assert_eq!(asker.stats().unwrap().put_barriers, barriers);
}

/// A put that fails in the store (the name is taken by an unsealed object, which the shared
/// directory does not show) is reported by `sync`, once; unrelated calls in between are not
/// failed for it.
#[test]
fn a_failed_put_is_reported_by_sync_and_not_by_unrelated_calls() {
    let d = Daemon::start("64M");
    let _taken = vovp_tests::taken_unsealed(&d, "taken");
    let c = client(&d);
    put(&c, "keep", b"k").unwrap();
    put(&c, "taken", b"mine").unwrap(); // sent; fails in the store
    put(&c, "after", b"a").unwrap();
    c.delete("keep").unwrap();
    assert!(!c.contains("keep").unwrap());
    match c.sync() {
        Err(vovp::Error::AlreadyExists(why)) => assert!(why.contains("taken"), "{why}"),
        other => panic!("expected the put's failure, got {other:?}"),
    }
    c.sync().unwrap();
    assert!(
        c.contains("after").unwrap(),
        "puts after the failed one were applied"
    );
    // A name already published fails at once, nothing sent; so does a name this client put
    // a moment ago whose answer is still owed (the second put waits for it).
    put(&c, "p", b"1").unwrap();
    c.sync().unwrap();
    assert!(matches!(
        put(&c, "p", b"2"),
        Err(vovp::Error::AlreadyExists(_))
    ));
    assert_eq!(c.unread_replies(), 0);
    for i in 0..200 {
        let name = format!("twice{i}");
        put(&c, &name, b"1").unwrap();
        assert!(
            matches!(put(&c, &name, b"2"), Err(vovp::Error::AlreadyExists(_))),
            "second put of {name}"
        );
    }
    c.sync().unwrap();
}

/// `vovp put` exits right after its put (the CLI syncs, but the daemon must not lose a put
/// whose client is gone either): a client dropped after a burst of puts, and a process that
/// exits without syncing, leave every object stored.
#[test]
fn puts_of_a_client_that_goes_away_at_once_are_all_stored() {
    let d = Daemon::start("256M");
    {
        let c = client(&d);
        for i in 0..500 {
            put(&c, &format!("gone{i}"), &[1u8; 100]).unwrap();
        }
    } // dropped with replies owed
    let other = client(&d);
    for i in 0..500 {
        assert!(other.contains(&format!("gone{i}")).unwrap(), "gone{i} lost");
    }
    // Through a raw connection that sends pipelined PUTs and closes without reading a reply.
    let mut raw = Raw::connect(&d);
    raw.hello();
    let mut frames = Vec::new();
    for i in 0..200u64 {
        let mut p = vovp_tests::name_payload(format!("raw{i}").as_bytes());
        p.extend(vovp_proto::PUT_PIPELINED.to_le_bytes()); // flags
        p.extend(0u32.to_le_bytes()); // metadata: none
        p.extend(8u64.to_le_bytes()); // data_size
        p.extend(i.to_le_bytes());
        frames.extend(Raw::frame(vovp_proto::VERSION, 0x05, 10 + i, &p));
    }
    raw.send(&frames);
    drop(raw);
    vovp_tests::wait_until(Duration::from_secs(10), || {
        other.contains("raw199").unwrap_or(false)
    });
    for i in 0..200 {
        assert!(other.contains(&format!("raw{i}")).unwrap(), "raw{i} lost");
    }
}

/// A client that counts puts it never sends only delays other clients' misses, by the store's
/// bound (200 ms when nothing is applied meanwhile), only while it is connected, and not at
/// all with a count no real client reaches.
#[test]
fn a_client_that_counts_puts_it_never_sends_delays_misses_boundedly() {
    let d = Daemon::start("64M");
    let mut liar = Raw::connect(&d);
    liar.hello();
    let holds = liar.shared(2, false);
    rustix::io::pwrite(&holds, &5u64.to_le_bytes(), 64).expect("write puts_sent");
    let c = client(&d);
    let barriers = || c.stats().unwrap().put_barriers;
    let before = barriers();
    let t = Instant::now();
    assert!(c.get(&["nothing"], None).unwrap()[0].is_none());
    let waited = t.elapsed();
    // It waited (a barrier was made), for the store's bound: a lower bound on the clock, which
    // a loaded machine only lengthens; the upper one only turns a hang into a failure.
    assert_eq!(barriers(), before + 1);
    assert!(
        waited >= Duration::from_millis(150) && waited < Duration::from_secs(20),
        "{waited:?}"
    );
    // A count beyond what any client keeps in flight is not believed: no barrier.
    rustix::io::pwrite(&holds, &1000u64.to_le_bytes(), 64).expect("write puts_sent");
    assert!(!c.contains("nothing").unwrap());
    assert_eq!(barriers(), before + 1);
    // Gone: once the store has dropped the liar's table, no barrier at all.
    rustix::io::pwrite(&holds, &5u64.to_le_bytes(), 64).expect("write puts_sent");
    drop(liar);
    vovp_tests::wait_until(Duration::from_secs(20), || {
        let b = barriers();
        let _ = c.contains("nothing");
        barriers() == b
    });
}
