//! Versions of a name against a real daemon (PROTOCOL.md, "Versions"): a replace takes the name
//! at its seal in one step, readers keep the version they hold, a get can wait for a version
//! newer than the one it has, and a writer that dies before its seal leaves the name as it was.

use std::time::{Duration, Instant};

use vovp::{CreateOptions, Error, NotificationKind, Store};
use vovp_tests::{read_line, wait_until, Daemon};

const T: Duration = Duration::from_secs(20);

fn replace() -> CreateOptions {
    CreateOptions {
        replace: true,
        ..CreateOptions::default()
    }
}

/// Puts `fill` × `len` under `name` as a replace; the version it became.
fn put_version(c: &vovp_client::Client, name: &str, len: usize, fill: u8) -> u64 {
    c.put_and_view(name, &vec![fill; len], &[fill], replace())
        .unwrap()
        .version()
}

/// Each way a put goes (inline, through the lend, through CREATE): the name moves to the new
/// version at once, a view of the old one keeps its bytes, and its memory goes with it.
#[test]
fn a_replace_moves_the_name_and_readers_keep_what_they_hold() {
    let d = Daemon::start("256M");
    let writer = d.client();
    let reader = d.client();
    for (name, len) in [("inline", 1_000), ("lent", 200_000), ("created", 3 << 20)] {
        assert_eq!(put_version(&writer, name, len, 1), 1, "{name}");
        // Without `replace` the name stays taken.
        assert!(
            matches!(
                writer.put(name, &[9], b"", CreateOptions::default()),
                Err(Error::AlreadyExists(_))
            ) || writer.sync().is_err()
        );
        let v1 = reader.get_one(name, None).unwrap();
        assert_eq!((v1.version(), v1[0], v1.len()), (1, 1, len), "{name}");
        for v in 2..=4u8 {
            assert_eq!(put_version(&writer, name, len, v), u64::from(v), "{name}");
            let now = reader.get_one(name, None).unwrap();
            assert_eq!(
                (now.version(), now[0], now.metadata()),
                (u64::from(v), v, &[v][..])
            );
        }
        // v1 is still whole, and held: the store keeps it, nameless.
        assert!(v1.iter().all(|&b| b == 1), "{name}");
        let listed = reader.list().unwrap();
        let row = listed.iter().find(|i| i.name.as_str() == name).unwrap();
        assert_eq!(row.version, 4, "{name}");
        assert!(reader.stats().unwrap().pending_delete >= 1);
        drop(v1);
    }
    // Every old version is gone with its last holder; what is left is the last versions.
    wait_until(T, || {
        let s = reader.stats().unwrap();
        (s.objects, s.pending_delete, s.references) == (3, 0, 0)
    });
}

/// `get_newer`: at once when the store has a newer version, else it waits for the next seal,
/// else it times out with NotFound; a plain get never waits for a name that exists.
#[test]
fn a_get_newer_than_waits_for_the_next_version() {
    let d = Daemon::start("64M");
    let writer = d.client();
    let reader = d.client();
    put_version(&writer, "w", 64, 1);
    put_version(&writer, "w", 64, 2);
    assert_eq!(reader.get_newer("w", 1, None).unwrap().version(), 2);
    assert_eq!(reader.get_newer("w", 0, None).unwrap().version(), 2);
    let started = Instant::now();
    assert!(matches!(
        reader.get_newer("w", 2, Some(Duration::from_millis(200))),
        Err(Error::NotFound(_))
    ));
    assert!(started.elapsed() >= Duration::from_millis(200));

    // A waiter in another process: it is counted as waiting before the replace is made.
    let mut waiter = d.fixture_spawn(&["read-newer", "w", "2"]);
    wait_until(T, || reader.stats().unwrap().waiting_gets == 1);
    assert_eq!(put_version(&writer, "w", 64, 3), 3);
    assert_eq!(read_line(&mut waiter), "w version=3 first=3");
    assert!(waiter.wait().unwrap().success());
}

/// A replacement dies with its writer: killed before its seal, the name keeps its version,
/// and a waiter for a newer one goes on waiting.
#[test]
fn a_writer_killed_before_its_seal_leaves_the_previous_version() {
    let d = Daemon::start("64M");
    let c = d.client();
    put_version(&c, "w", 4096, 7);
    let mut creator = d.fixture_spawn(&["create-hold", "w", "4096", "--replace"]);
    assert_eq!(read_line(&mut creator), "created");
    // Unsealed, the replacement is nowhere by name.
    let s = c.stats().unwrap();
    assert_eq!((s.objects, s.unsealed), (2, 1));
    assert_eq!(c.get_one("w", None).unwrap().version(), 1);
    assert_eq!(c.list().unwrap().len(), 1);
    creator.kill().unwrap();
    creator.wait().unwrap();
    wait_until(T, || c.stats().unwrap().unsealed == 0);
    let v = c.get_one("w", None).unwrap();
    assert_eq!((v.version(), v[0]), (1, 7));
    assert_eq!(put_version(&c, "w", 4096, 8), 2);
}

/// Subscribers see a replace as one "replaced" notification carrying the new version.
#[test]
fn subscribers_see_a_replace_as_such() {
    let d = Daemon::start("64M");
    let c = d.client();
    let mut sub = c.subscribe().unwrap();
    put_version(&c, "w", 64, 1);
    put_version(&c, "w", 64, 2);
    let first = sub.next(Some(T)).unwrap().unwrap();
    let second = sub.next(Some(T)).unwrap().unwrap();
    assert_eq!((first.kind, first.version), (NotificationKind::Sealed, 1));
    assert_eq!(
        (second.kind, second.version),
        (NotificationKind::Replaced, 2)
    );
    assert!(sub
        .next(Some(Duration::from_millis(100)))
        .unwrap()
        .is_none());
}
