//! Puts through a lend (issue 13's creates without a round trip): the store lends each client a
//! part of its own arena, the client writes an object there and one PUBLISH creates and seals
//! it. Real daemon, writers in other processes; each test checks what must not change: the
//! bytes and metadata readers get, the memory the store charges, a dead writer's objects, and
//! that a client can only publish ranges of its own lend.

use std::time::Duration;

use vovp::{CreateOptions, Store};
use vovp_client::CLIENT_LEND_MIN;
use vovp_tests::{pattern, read_line, wait_until, Daemon, Raw};

const T: Duration = Duration::from_secs(20);

/// A client that puts through lends (the default; `ClientOptions::no_lend_puts` opts out).
fn lender(d: &Daemon) -> vovp_client::Client {
    vovp_client::Client::connect(&d.socket).expect("connect")
}
const MIB: u64 = 1 << 20;

/// A client that puts with CREATE / PUT only.
fn opted_out(d: &Daemon) -> vovp_client::Client {
    d.client_with(vovp_client::ClientOptions {
        no_lend_puts: true,
        ..Default::default()
    })
}

/// `create` of `size` bytes, retried while the store answers OUT_OF_MEMORY for up to `T`: a
/// lend is taken back only while no put writes into it, and a new lend's background populate
/// counts as one for a few milliseconds after LEND (longer on a loaded machine).
fn create_once_lends_idle(
    c: &vovp_client::Client,
    name: &str,
    size: u64,
) -> Result<vovp::ObjectBuffer, vovp::Error> {
    let deadline = std::time::Instant::now() + T;
    loop {
        match c.create(name, size, b"", CreateOptions::default()) {
            Err(vovp::Error::OutOfMemory { .. }) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20))
            }
            other => return other,
        }
    }
}

#[test]
fn a_put_through_a_lend_is_one_message_and_other_clients_read_it() {
    let d = Daemon::start("256M");
    let writer = lender(&d);
    let a = pattern(300_000, 1);
    let b = pattern(CLIENT_LEND_MIN, 2);
    let before = writer.last_request_id();
    writer
        .put("a", &a, b"meta-a", CreateOptions::default())
        .unwrap();
    assert_eq!(
        writer.last_request_id(),
        before + 3,
        "LEND, SEGMENT (the writer's first arena), PUBLISH"
    );
    writer
        .put("b", &b, b"meta-b", CreateOptions::default())
        .unwrap();
    assert_eq!(
        writer.last_request_id(),
        before + 4,
        "one PUBLISH, no CREATE/SEAL"
    );

    let reader = d.client();
    let va = reader.get_one("a", None).unwrap();
    assert_eq!((&va[..], va.metadata()), (&a[..], &b"meta-a"[..]));
    let vb = reader.get_one("b", None).unwrap();
    assert_eq!((&vb[..], vb.metadata()), (&b[..], &b"meta-b"[..]));
    // Both live in the writer's lend: one arena, next to each other.
    assert_eq!(va.location().device(), vovp::Device::Cpu);

    // Same rules as any put: the name is taken, a second put of it fails and changes nothing.
    let err = writer
        .put("a", &b, b"", CreateOptions::default())
        .unwrap_err();
    assert!(matches!(err, vovp::Error::AlreadyExists(_)), "{err}");
    drop((va, vb));
    assert_eq!(&reader.get_one("a", None).unwrap()[..], &a[..]);
    let s = reader.stats().unwrap();
    assert_eq!((s.objects, s.sealed, s.references), (2, 2, 0));
}

#[test]
fn a_lend_is_charged_whole_and_given_back_with_its_last_object() {
    // 256 MiB: lends of 4 MiB, for objects up to 1 MiB; 8 objects of 500,032 bytes fill one.
    let d = Daemon::start("256M");
    let writer = lender(&d);
    for i in 0..9 {
        writer
            .put(
                &format!("o{i}"),
                &pattern(500_000, i),
                b"",
                CreateOptions::default(),
            )
            .unwrap();
    }
    let observer = d.client();
    let used = || observer.stats().unwrap().used_bytes;
    assert_eq!(used(), 8 * MIB, "two lends of 4 MiB, charged whole");
    // Deleting the first lend's objects gives it back (the writer has moved on to another).
    for i in 0..8 {
        observer.delete(&format!("o{i}")).unwrap();
    }
    wait_until(T, || used() == 4 * MIB);
    // The current lend stays while its owner is connected, then goes with its last object.
    drop(writer);
    assert_eq!(
        &observer.get_one("o8", None).unwrap()[..],
        &pattern(500_000, 8)[..]
    );
    observer.delete("o8").unwrap();
    wait_until(T, || used() == 0);
}

#[test]
fn a_killed_writer_leaves_its_published_objects_whole_and_its_lend_goes_with_them() {
    let d = Daemon::start("256M");
    let mut child = d.fixture_spawn(&["put-hold", "k", "12", "200000"]);
    let line = read_line(&mut child);
    assert!(line.starts_with("put "), "{line}");
    let observer = d.client();
    assert_eq!(
        observer.stats().unwrap().references,
        12,
        "the writer holds each object"
    );
    child.kill().unwrap();
    child.wait().unwrap();
    wait_until(T, || observer.stats().unwrap().references == 0);
    for i in 0..12u8 {
        let v = observer.get_one(&format!("k{i}"), None).unwrap();
        assert!(v.iter().all(|&x| x == i), "k{i} was changed");
        assert_eq!(v.metadata(), format!("m{i}").as_bytes());
    }
    for i in 0..12 {
        observer.delete(&format!("k{i}")).unwrap();
    }
    wait_until(T, || observer.stats().unwrap().used_bytes == 0);
}

#[test]
fn puts_through_lends_evict_older_objects_when_the_store_is_full() {
    // 64 MiB: lends of 1 MiB, for objects up to 256 KiB. 3x the capacity in 200 KB objects.
    let d = Daemon::start("64M");
    let writer = lender(&d);
    let n = 1000;
    for i in 0..n {
        writer
            .put(
                &format!("e{i}"),
                &pattern(200_000, i),
                b"",
                CreateOptions::default(),
            )
            .unwrap_or_else(|e| panic!("put {i}: {e}"));
    }
    let s = writer.stats().unwrap();
    assert!(s.used_bytes <= 64 * MIB, "{s:?}");
    assert!(s.evicted_objects > 0);
    for i in n - 100..n {
        let v = writer.get_one(&format!("e{i}"), None).unwrap();
        assert_eq!(&v[..], &pattern(200_000, i)[..], "e{i}");
    }
    assert!(!writer.contains("e0").unwrap(), "the oldest were evicted");
}

#[test]
fn a_store_that_lends_nothing_still_takes_every_put() {
    // Under 64 MiB the store lends nothing (eviction could only give back whole lends); with
    // --prefault there are no client arenas. Puts go inline or through CREATE as before.
    for extra in [&[][..], &["--prefault"][..]] {
        let memory = if extra.is_empty() { "16M" } else { "128M" };
        let d = Daemon::start_with(memory, extra);
        let c = lender(&d);
        for i in 0..3 {
            let data = pattern(300_000, i);
            c.put(&format!("p{i}"), &data, b"m", CreateOptions::default())
                .unwrap();
            assert_eq!(&c.get_one(&format!("p{i}"), None).unwrap()[..], &data[..]);
        }
    }
}

// -- hostile PUBLISH ----------------------------------------------------------------------------

fn lend(raw: &mut Raw, id: u64, at_least: u64) -> (u8, Vec<u8>) {
    lend_of_kind(raw, id, at_least, 0)
}

/// LEND with `flags` (`LEND_SMALL`: the small-object lend).
fn lend_of_kind(raw: &mut Raw, id: u64, at_least: u64, flags: u32) -> (u8, Vec<u8>) {
    let mut p = at_least.to_le_bytes().to_vec();
    p.extend(flags.to_le_bytes());
    raw.send(&Raw::frame(vovp_proto::VERSION, 0x11, id, &p));
    let (op, rid, p) = raw.reply_payload().expect("LEND reply");
    assert_eq!((op, rid), (0x91, id));
    (p[0], p)
}

/// A raw connection with a lend: (connection, [lend id, offset, size, max object]).
fn raw_with_lend(d: &Daemon) -> (Raw, [u64; 4]) {
    let mut raw = Raw::connect(d);
    raw.hello();
    raw.shared(10, true);
    let (status, p) = lend(&mut raw, 2, 4096);
    assert_eq!(status, 0);
    let u64_at = |i: usize| u64::from_le_bytes(p[i..i + 8].try_into().unwrap());
    (raw, [u64_at(1), u64_at(13), u64_at(21), u64_at(29)])
}

/// PUBLISH's fields after the lend, flags 0 and no metadata (PUBLISH_MANY's items too).
fn publish_fields(p: &mut Vec<u8>, offset: u64, name: &str, size: u64) {
    p.extend(offset.to_le_bytes());
    p.extend(vovp_tests::name_payload(name.as_bytes()));
    p.extend(0u32.to_le_bytes()); // flags
    p.extend(0u32.to_le_bytes()); // metadata: empty bytes
    p.extend(size.to_le_bytes());
}

fn publish(raw: &mut Raw, id: u64, lend: u64, offset: u64, name: &str, size: u64) -> u8 {
    let mut p = lend.to_le_bytes().to_vec();
    publish_fields(&mut p, offset, name, size);
    raw.send(&Raw::frame(vovp_proto::VERSION, 0x12, id, &p));
    let (op, rid, status) = raw.reply().expect("PUBLISH reply");
    assert_eq!((op, rid), (0x92, id));
    status
}

#[test]
fn a_client_can_publish_only_unused_aligned_ranges_of_its_own_lend() {
    const NOT_FOUND: u8 = 1;
    const MALFORMED: u8 = 12;
    const TOO_LARGE: u8 = 15;
    let d = Daemon::start("256M");
    let (mut raw, [id, offset, size, max]) = raw_with_lend(&d);
    assert_eq!((size, max), (4 * MIB, MIB));

    assert_eq!(publish(&mut raw, 3, id + 1, offset, "x", 10), NOT_FOUND);
    assert_eq!(
        publish(&mut raw, 4, id, offset + 1, "x", 10),
        MALFORMED,
        "unaligned"
    );
    assert_eq!(
        publish(&mut raw, 5, id, u64::MAX - 63, "x", 10),
        MALFORMED,
        "overflow"
    );
    assert_eq!(
        publish(&mut raw, 6, id, offset + size - 64, "x", 65),
        MALFORMED,
        "past"
    );
    assert_eq!(
        publish(&mut raw, 7, id, offset, "x", u64::MAX - 10),
        MALFORMED
    );
    assert_eq!(publish(&mut raw, 8, id, offset + 64, "x", 100), 0);
    assert_eq!(
        publish(&mut raw, 9, id, offset, "y", 100),
        MALFORMED,
        "overlaps x"
    );
    assert_eq!(
        publish(&mut raw, 10, id, offset + 128, "y", 1),
        MALFORMED,
        "inside x"
    );
    assert_eq!(
        publish(&mut raw, 11, id, offset + 192, "x", 1),
        2,
        "the name is taken"
    );
    assert_eq!(publish(&mut raw, 12, id, offset + 192, "y", 1), 0);
    assert_eq!(lend(&mut raw, 13, max + 1).0, TOO_LARGE);

    // The small lend (LEND_SMALL) is a second one beside the big one, which stays current.
    let (status, small) = lend_of_kind(&mut raw, 14, 128, vovp_proto::LEND_SMALL);
    assert_eq!(status, 0);
    let s_at = |i: usize| u64::from_le_bytes(small[i..i + 8].try_into().unwrap());
    assert_eq!((s_at(21), s_at(29)), (64 << 10, 16 << 10));
    assert_ne!(s_at(1), id);
    assert_eq!(publish(&mut raw, 15, s_at(1), s_at(13), "small", 64), 0);
    assert_eq!(publish(&mut raw, 16, id, offset + 256, "big", 64), 0);

    // Another client cannot publish into this client's lend.
    let mut other = Raw::connect(&d);
    other.hello();
    assert_eq!(
        publish(&mut other, 2, id, offset + 1024, "z", 10),
        NOT_FOUND
    );

    // And the store serves everyone as before.
    let c = lender(&d);
    assert_eq!(c.get_one("y", None).unwrap().len(), 1);
    assert_eq!(c.get_one("x", None).unwrap().len(), 100);
    c.put("after", &pattern(100_000, 9), b"", CreateOptions::default())
        .unwrap();
    assert!(c.contains("after").unwrap());
}

/// PUBLISH_MANY of `(offset, name, size)` items from `lend`, as raw bytes: the statuses of
/// the reply (its own, then one per item).
fn publish_many(raw: &mut Raw, id: u64, lend: u64, items: &[(u64, &str, u64)]) -> Vec<u8> {
    let mut p = lend.to_le_bytes().to_vec();
    p.extend((items.len() as u32).to_le_bytes());
    for &(offset, name, size) in items {
        publish_fields(&mut p, offset, name, size);
    }
    raw.send(&Raw::frame(vovp_proto::VERSION, 0x14, id, &p));
    let (op, rid, reply) = raw.reply_payload().expect("PUBLISH_MANY reply");
    assert_eq!((op, rid), (0x94, id));
    let names: Vec<&str> = items.iter().map(|i| i.1).collect();
    match vovp_proto::Reply::decode(0x14, &reply, &names).expect("a well-formed reply") {
        vovp_proto::Reply::Published(results) => std::iter::once(0)
            .chain(
                results
                    .iter()
                    .map(|r| r.as_ref().map_or_else(|f| f.status.code(), |_| 0)),
            )
            .collect(),
        vovp_proto::Reply::Failure(f) => vec![f.status.code()],
        other => panic!("{other:?}"),
    }
}

#[test]
fn publish_many_checks_each_object_as_publish_does_and_fails_only_the_bad_ones() {
    const INVALID_NAME: u8 = 7;
    const MALFORMED: u8 = 12;
    const TOO_LARGE: u8 = 15;
    let d = Daemon::start("256M");
    let (mut raw, [id, offset, ..]) = raw_with_lend(&d);
    let statuses = publish_many(
        &mut raw,
        3,
        id,
        &[
            (offset, "m0", 100),
            (offset + 64, "m1", 10),   // inside m0
            (offset + 192, "", 10),    // no name
            (offset + 192, "m0", 10),  // taken (by the first item)
            (offset + 192, "m3", 100), // what the refused ones left free
            (offset + 1, "m5", 10),    // unaligned
        ],
    );
    let already_exists = 2;
    assert_eq!(
        statuses,
        [0, 0, MALFORMED, INVALID_NAME, already_exists, 0, MALFORMED]
    );
    // Empty, and over the limit (the whole request refused, the connection still served).
    assert_eq!(publish_many(&mut raw, 4, id, &[]), [0]);
    let many: Vec<(u64, String, u64)> = (0..=vovp_proto::MAX_PUBLISH_MANY as u64)
        .map(|i| (offset + 4096 + 64 * i, format!("x{i}"), 1))
        .collect();
    let many: Vec<(u64, &str, u64)> = many.iter().map(|(o, n, s)| (*o, n.as_str(), *s)).collect();
    assert_eq!(publish_many(&mut raw, 5, id, &many), [TOO_LARGE]);
    assert_eq!(publish_many(&mut raw, 6, id, &many[1..]).len(), 1 + 64);
    // What was published is there, whole, for another client.
    let c = lender(&d);
    assert_eq!(c.get_one("m0", None).unwrap().len(), 100);
    assert_eq!(c.get_one("m3", None).unwrap().len(), 100);
    assert_eq!(c.get_one("x64", None).unwrap().len(), 1);
    assert!(!c.contains("m1").unwrap());
    assert!(
        !c.contains("x0").unwrap(),
        "the refused request published nothing"
    );
}

#[test]
fn a_get_keeps_every_arena_it_needs_mapped_while_it_maps_more() {
    // Objects from 33 writers live in 33 arenas. A reader (over the socket, so every get maps
    // what it needs) keeps the last 32 foreign arenas it mapped; a GET of an object in the
    // oldest of them and one in a 33rd must not lose the first while mapping the second (it
    // did: "unknown segment", first seen in the soak once puts went into lends).
    let d = Daemon::start("256M");
    let writers: Vec<_> = (0..33).map(|_| lender(&d)).collect();
    for (i, w) in writers.iter().enumerate() {
        w.put(
            &format!("w{i}"),
            &pattern(100_000, i as u32),
            b"",
            CreateOptions::default(),
        )
        .unwrap();
    }
    let reader = d.client_with(vovp_client::ClientOptions {
        no_shared_reads: true,
        ..Default::default()
    });
    for i in 0..32 {
        drop(reader.get_one(&format!("w{i}"), None).unwrap());
    }
    let got = reader.get(&["w0", "w32"], None).unwrap();
    for (v, i) in got.iter().zip([0u32, 32]) {
        let v = v.as_ref().expect("found");
        assert_eq!(&v[..], &pattern(100_000, i)[..], "w{i}");
    }
}

#[test]
fn a_first_put_too_big_for_any_lend_takes_none() {
    // 256 MiB: lends of 4 MiB, for objects up to 1 MiB. A client learns that from its first
    // lend; before one, the store's capacity tells it, so a first put of 2 MiB (waiting, kept
    // or async) asks for no lend: only the object is charged, and nothing once it is deleted.
    let d = Daemon::start("256M");
    let observer = d.client();
    let used = || observer.stats().unwrap().used_bytes;
    let big = pattern(2 << 20, 3);
    let writer = lender(&d);
    writer
        .put("w", &big, b"", CreateOptions::default())
        .unwrap();
    assert_eq!(used(), 2 * MIB, "the object alone, no lend beside it");
    let kept = lender(&d);
    let later = kept.put_view_later("k", &big, b"", CreateOptions::default());
    assert!(later.unwrap().is_none(), "too big to be answered later");
    let view = kept
        .put_and_view("k", &big, b"", CreateOptions::default())
        .unwrap();
    assert_eq!(&view[..], &big[..]);
    assert_eq!(used(), 4 * MIB);
    vovp_tests::runtime().block_on(async {
        use vovp::AsyncStore;
        let c = vovp_client::AsyncClient::connect(&d.socket).await.unwrap();
        c.put("a", &big, b"", CreateOptions::default())
            .await
            .unwrap();
        // Read while the async client is connected (its lend would go with it).
        assert_eq!(used(), 6 * MIB, "the async client's object alone");
    });
    drop(view);
    for name in ["w", "k", "a"] {
        observer.delete(name).unwrap();
    }
    wait_until(T, || used() == 0);
    // The writers are still connected: no lend is held for them.
    assert_eq!(writer.stats().unwrap().objects, 0);
}

#[test]
fn the_async_client_puts_through_its_lend_too() {
    use vovp::AsyncStore;
    let d = Daemon::start("256M");
    let observer = d.client();
    vovp_tests::runtime().block_on(async {
        let c = vovp_client::AsyncClient::connect(&d.socket).await.unwrap();
        for i in 0..10u32 {
            c.put(
                &format!("a{i}"),
                &pattern(200_000, i),
                b"m",
                CreateOptions::default(),
            )
            .await
            .unwrap();
        }
        // One lend of 4 MiB took all ten (no CREATE: each object its own allocation would
        // charge 200,000 bytes rounded up, not a share of one lend).
        assert_eq!(observer.stats().unwrap().used_bytes, 4 * MIB);
        let err = c
            .put("a3", &pattern(100_000, 0), b"", CreateOptions::default())
            .await
            .unwrap_err();
        assert!(matches!(err, vovp::Error::AlreadyExists(_)), "{err}");
    });
    for i in 0..10u32 {
        let v = observer.get_one(&format!("a{i}"), None).unwrap();
        assert_eq!(
            (&v[..], v.metadata()),
            (&pattern(200_000, i)[..], &b"m"[..])
        );
    }
}

#[test]
fn threads_sharing_one_client_never_write_over_each_other() {
    // Four threads put through one client's lend at once: reservations must not overlap, a
    // lend is replaced only when no put writes into it, and every object reads back whole.
    let d = Daemon::start("256M");
    let c = lender(&d);
    std::thread::scope(|s| {
        for t in 0..4u32 {
            let c = c.clone();
            s.spawn(move || {
                for i in 0..50u32 {
                    let seed = t * 1000 + i;
                    c.put(
                        &format!("t{t}-{i}"),
                        &pattern(100_000 + i as usize * 64, seed),
                        &seed.to_le_bytes(),
                        CreateOptions::default(),
                    )
                    .unwrap();
                }
            });
        }
    });
    let reader = d.client();
    for t in 0..4u32 {
        for i in 0..50u32 {
            let seed = t * 1000 + i;
            let v = reader.get_one(&format!("t{t}-{i}"), None).unwrap();
            assert_eq!(v.metadata(), seed.to_le_bytes());
            assert!(
                v[..] == pattern(100_000 + i as usize * 64, seed)[..],
                "t{t}-{i}"
            );
        }
    }
}

#[test]
fn lends_are_the_default_and_a_client_can_opt_out() {
    let d = Daemon::start("256M");
    let c = d.client();
    let before = c.last_request_id();
    c.put("lent", &pattern(100_000, 1), b"", CreateOptions::default())
        .unwrap();
    assert_eq!(
        c.last_request_id(),
        before + 3,
        "LEND, SEGMENT (the client's arena), PUBLISH"
    );
    assert_eq!(
        c.stats().unwrap().used_bytes,
        4 * MIB,
        "one lend, charged whole"
    );
    // An opted-out client puts inline (PUT) or with CREATE + SEAL, each object charged alone.
    let o = opted_out(&d);
    let before = o.last_request_id();
    o.put(
        "inline",
        &pattern(100_000, 2),
        b"",
        CreateOptions::default(),
    )
    .unwrap();
    assert_eq!(o.last_request_id(), before + 1, "one inline PUT");
    assert_eq!(o.stats().unwrap().used_bytes, 4 * MIB + 100_032);
}

#[test]
fn a_connection_without_a_hold_table_gets_no_lend() {
    // A lend is taken back through the hold table, so without shared reads there is none.
    let d = Daemon::start_with("256M", &["--no-shared-reads"]);
    let c = d.client();
    let before = c.last_request_id();
    c.put("p", &pattern(100_000, 1), b"", CreateOptions::default())
        .unwrap();
    assert_eq!(c.last_request_id(), before + 1, "one inline PUT, no LEND");
    assert_eq!(c.stats().unwrap().used_bytes, 100_032, "no lend charged");
    // Asked anyway (by hand), the store refuses, saying why.
    let mut raw = Raw::connect(&d);
    raw.hello();
    let (status, body) = lend(&mut raw, 2, 0);
    assert_ne!(status, 0, "lent without a hold table");
    assert!(
        String::from_utf8_lossy(&body).contains("hold table"),
        "{}",
        String::from_utf8_lossy(&body)
    );
}

#[test]
fn a_connection_that_does_not_count_its_puts_gets_no_lend() {
    // A hold table alone is not enough: a client that never counts its puts into its lend
    // (an older client, one that did not map the table) would have the lend freed under
    // them, so the store lends only once the client has declared it takes part.
    let d = Daemon::start("256M");
    let mut raw = Raw::connect(&d);
    raw.hello();
    raw.shared(2, false);
    let (status, _) = lend(&mut raw, 3, 0);
    assert_ne!(status, 0, "lent to a client that does not take part");
    let mut raw = Raw::connect(&d);
    raw.hello();
    raw.shared(2, true);
    assert_eq!(lend(&mut raw, 3, 0).0, 0, "declared: lent");
}

#[test]
fn the_store_takes_back_an_idle_lend_when_short_of_memory() {
    // 64 MiB: lends of 1 MiB. A's current lend is empty but charged whole.
    let d = Daemon::start("64M");
    let a = lender(&d);
    a.put("x", &pattern(100_000, 1), b"", CreateOptions::default())
        .unwrap();
    a.delete("x").unwrap();
    let b = opted_out(&d);
    assert_eq!(b.stats().unwrap().used_bytes, MIB, "A's idle lend");
    // B's object fits only in memory A's lend holds: the store takes the lend back.
    let big = 64 * MIB - MIB / 2;
    let mut buf = create_once_lends_idle(&b, "big", big)
        .unwrap_or_else(|e| panic!("the idle lend was not taken back: {e}"));
    buf.as_mut_slice()[..4].copy_from_slice(b"big!");
    let view = buf.seal().unwrap();
    let s = b.stats().unwrap();
    assert_eq!(s.used_bytes, big, "A's lend is gone: {s:?}");
    // A's next put finds its lend taken back and puts another way (no room for a new lend
    // while B holds its object), and nothing of B's is touched.
    a.put("y", &pattern(100_000, 2), b"", CreateOptions::default())
        .unwrap();
    assert_eq!(&a.get_one("y", None).unwrap()[..], &pattern(100_000, 2)[..]);
    assert_eq!(&b.get_one("big", None).unwrap()[..4], b"big!");
    // Once B lets go, A's puts go through a lend again (after the client's pause between
    // LENDs the store could not grant: 100 ms).
    drop(view);
    b.delete("big").unwrap();
    std::thread::sleep(Duration::from_millis(150));
    let before = a.last_request_id();
    a.put("z", &pattern(100_000, 3), b"", CreateOptions::default())
        .unwrap();
    assert_eq!(a.last_request_id(), before + 2, "LEND, PUBLISH");
    assert_eq!(&b.get_one("z", None).unwrap()[..], &pattern(100_000, 3)[..]);
}

#[test]
fn evicting_the_objects_of_an_idle_lend_gives_its_memory_back() {
    // 64 MiB: lends of 1 MiB. A's current lend holds one object nobody references.
    let d = Daemon::start("64M");
    let a = lender(&d);
    a.put("x", &pattern(100_000, 1), b"", CreateOptions::default())
        .unwrap();
    let b = opted_out(&d);
    // Only A's lend can make room: evicting x alone frees nothing while the lend is current,
    // but leaves it empty, and the store then takes it back. (Just over what is free: the
    // store's estimate of what eviction can free counts x's bytes, not the rest of its lend.)
    let big = 63 * MIB + 64 * 1024;
    let buf = create_once_lends_idle(&b, "big", big)
        .unwrap_or_else(|e| panic!("evicting x did not give A's lend back: {e}"));
    assert!(!b.contains("x").unwrap(), "x was evicted");
    assert_eq!(b.stats().unwrap().used_bytes, big);
    drop(buf);
}

#[test]
fn an_active_lend_is_left_alone_when_eviction_finds_room_elsewhere() {
    let d = Daemon::start("64M");
    let b = opted_out(&d);
    for i in 0..10 {
        b.put(
            &format!("old{i}"),
            &pattern(4 << 20, i),
            b"",
            CreateOptions::default(),
        )
        .unwrap();
    }
    let a = lender(&d);
    a.put("x", &pattern(100_000, 1), b"", CreateOptions::default())
        .unwrap();
    // B's create evicts B's older objects; A's lend (with x in it) stays A's.
    let buf = b
        .create("big", 30 * MIB, b"", CreateOptions::default())
        .unwrap();
    assert!(!b.contains("old0").unwrap(), "the oldest were evicted");
    assert!(b.contains("x").unwrap());
    let before = a.last_request_id();
    a.put("y", &pattern(100_000, 2), b"", CreateOptions::default())
        .unwrap();
    assert_eq!(
        a.last_request_id(),
        before + 1,
        "one PUBLISH into the same lend"
    );
    drop(buf);
}

#[test]
fn with_prefault_clients_write_their_creates_in_segment_0_and_private_views_stay_private() {
    // --prefault: no client arenas, every object in segment 0, which the daemon hands its own
    // uid's clients read-write (as Plasma's store did) so that a CREATE of any size can be
    // written. A writable view of someone else's object is still a private copy-on-write one.
    let d = Daemon::start_with("128M", &["--prefault"]);
    let a = d.client();
    let data = pattern(300_000, 3);
    a.put("big", &data, b"", CreateOptions::default()).unwrap();
    let b = d.client();
    let v = b.get_one("big", None).unwrap();
    let mine = b.private_view(&v).unwrap().expect("a host object");
    // SAFETY: the private mapping covers the object's bytes and is kept by `mine`.
    unsafe { std::ptr::write_bytes(mine.ptr, 0xEE, 1000) };
    assert_eq!(&v[..], &data[..], "the write stayed in the private mapping");
    let c = d.client();
    assert_eq!(&c.get_one("big", None).unwrap()[..], &data[..]);
}

/// Bytes equal to `byte` in the daemon's client arenas (every memfd `vovp-segment-N` but segment
/// 0, read through /proc/PID/fd).
fn bytes_in_arenas(daemon: u32, byte: u8) -> usize {
    let mut found = 0;
    let Ok(fds) = std::fs::read_dir(format!("/proc/{daemon}/fd")) else {
        return 0;
    };
    for fd in fds.flatten() {
        let target = std::fs::read_link(fd.path()).unwrap_or_default();
        let target = target.to_string_lossy();
        let Some(rest) = target.strip_prefix("/memfd:vovp-segment-") else {
            continue;
        };
        // Each arena is there twice (read-write and read-only fds): count the read-only one.
        let read_only = fd
            .path()
            .symlink_metadata()
            .is_ok_and(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o200 == 0);
        if rest.starts_with("0 ") || !read_only {
            continue;
        }
        if let Ok(bytes) = std::fs::read(fd.path()) {
            found += bytes.iter().filter(|&&b| b == byte).count();
        }
    }
    found
}

#[test]
fn a_writer_killed_in_the_middle_of_a_lend_write_leaves_nothing_half_made() {
    // 64 MiB: lends of 1 MiB. `lend-write-die` puts 200,000 bytes of 0xC3 through its lend
    // from a source whose middle page is unreadable: the copy into the lend stops there, and
    // the process waits, its put announced in its hold table, its PUBLISH never sent.
    const SIZE: usize = 200_000;
    let half = SIZE.next_multiple_of(4096) / 2 / 4096 * 4096;
    let d = Daemon::start("64M");
    let daemon = d.child.id();
    let observer = opted_out(&d);
    observer
        .put("before", &[7u8; 100_000], b"", CreateOptions::default())
        .unwrap();
    let before = observer.get_one("before", None).unwrap();
    let used = observer.stats().unwrap().used_bytes;
    assert_eq!(used, 100_032);

    let mut writer = d.fixture_spawn(&["lend-write-die", "half", &SIZE.to_string()]);
    assert_eq!(read_line(&mut writer), "writing");
    // Its lend is charged whole; no object (sealed or not) exists for the put.
    let s = observer.stats().unwrap();
    assert_eq!(
        (s.used_bytes, s.objects, s.unsealed),
        (used + MIB, 1, 0),
        "{s:?}"
    );
    // What it wrote is in its arena: a part of the object's bytes, none past the bad page.
    let written = bytes_in_arenas(daemon, 0xC3);
    assert!(written > 0 && written <= half, "{written} bytes written");
    // The store cannot take back a lend a put is writing into: a create that needs its
    // memory is refused.
    match observer.create("big", 63 * MIB, b"", CreateOptions::default()) {
        Err(vovp::Error::OutOfMemory { .. }) => {}
        other => panic!("a lend being written was taken back: {:?}", other.map(drop)),
    }

    writer.kill().unwrap(); // SIGKILL
    writer.wait().unwrap();
    // The daemon frees the lend (and the writer's arena with it): only `before` is left.
    wait_until(T, || {
        let s = observer.stats().unwrap();
        (s.used_bytes, s.objects, s.unsealed, s.references, s.holders) == (used, 1, 0, 1, 1)
    });
    wait_until(T, || bytes_in_arenas(daemon, 0xC3) == 0);
    assert!(!observer.contains("half").unwrap());
    assert!(observer.get(&["half"], None).unwrap()[0].is_none());
    let names: Vec<String> = observer
        .list()
        .unwrap()
        .iter()
        .map(|i| i.name.to_string())
        .collect();
    assert_eq!(names, ["before"]);
    // Its memory is the store's again: the create that was refused fits now.
    let buf = observer
        .create("big", 63 * MIB, b"", CreateOptions::default())
        .unwrap();
    drop(buf);
    // Other clients were served throughout, and the name is free: a new put of it is whole.
    let c = lender(&d);
    let data = pattern(SIZE, 5);
    c.put("half", &data, b"m", CreateOptions::default())
        .unwrap();
    let v = d.client().get_one("half", None).unwrap();
    assert_eq!((&v[..], v.metadata()), (&data[..], &b"m"[..]));
    assert!(before.iter().all(|&b| b == 7));
    drop((v, before));
    observer.delete("half").unwrap();
    observer.delete("before").unwrap();
    drop(c);
    wait_until(T, || {
        let s = observer.stats().unwrap();
        (s.used_bytes, s.objects, s.references, s.unsealed) == (0, 0, 0, 0)
    });
}
