//! `vovp::Session`, the engine's raw per-holder API (what each daemon connection runs on):
//! references as plain `ObjectRef`s, where a client session's objects go, what an abort frees,
//! the inline limit, and `release_all` (a connection's death).

use std::time::Duration;

use futures_executor::block_on;
use vovp::{
    Config, CreateOptions, Engine, EngineHandle, Error, Location, PutOptions, Store, MAX_INLINE_PUT,
};

fn engine() -> EngineHandle {
    Engine::spawn(Config::with_capacity(64 << 20)).expect("engine starts")
}

fn segment_of(location: Location) -> u32 {
    match location {
        Location::Host { segment, .. } => segment,
        Location::Cuda(_) => panic!("a host object was put on a GPU"),
    }
}

#[test]
fn client_sessions_write_their_own_arenas_and_embedded_ones_segment_0() {
    let e = engine();
    let client = e.client_session();
    let other = e.client_session();
    assert_ne!(client.holder(), other.holder());
    assert_ne!(client.holder(), e.holder());

    let r = block_on(client.create("c", 100, b"", CreateOptions::default())).unwrap();
    let arena = segment_of(r.location);
    assert_ne!(arena, 0, "a client's objects live in an arena of its own");
    // Only the creator may write its arena; every other session gets it read-only.
    assert!(block_on(client.segment(arena)).unwrap().writable);
    assert!(!block_on(other.segment(arena)).unwrap().writable);
    assert!(matches!(
        block_on(other.segment(9999)),
        Err(Error::NotFound(_))
    ));

    let mine = block_on(
        e.as_session()
            .create("e", 100, b"", CreateOptions::default()),
    )
    .unwrap();
    assert_eq!(segment_of(mine.location), 0);
    // Inline puts are copied in by the store itself: segment 0, whoever asks.
    let options = PutOptions {
        keep_reference: true,
        ..Default::default()
    };
    let inline = block_on(client.put_inline("i", vec![1; 10], b"", options)).unwrap();
    assert_eq!(segment_of(inline.location), 0);
    block_on(client.release(vec![inline.id])).unwrap();
    assert!(matches!(
        block_on(client.release(vec![inline.id])),
        Err(Error::NotHeld(_))
    ));
    e.shutdown();
}

#[test]
fn a_client_sessions_abort_frees_the_memory_at_once() {
    let e = engine();
    let client = e.client_session();
    block_on(client.create("c", 1 << 20, b"", CreateOptions::default())).unwrap();
    let used = e.stats().unwrap().used_bytes;
    block_on(client.abort("c")).unwrap();
    assert!(e.stats().unwrap().used_bytes < used);
    assert_eq!(e.stats().unwrap().references, 0);

    // The embedded session keeps it until its creator's reference goes (a buffer may still
    // point at it).
    let embedded = e.as_session();
    let r = block_on(embedded.create("e", 1 << 20, b"", CreateOptions::default())).unwrap();
    let used = e.stats().unwrap().used_bytes;
    block_on(embedded.abort("e")).unwrap();
    assert_eq!(e.stats().unwrap().used_bytes, used);
    block_on(embedded.release(vec![r.id])).unwrap();
    assert!(e.stats().unwrap().used_bytes < used);
    e.shutdown();
}

#[test]
fn inline_puts_above_the_limit_are_refused() {
    let e = engine();
    let s = e.client_session();
    let err = block_on(s.put_inline(
        "big",
        vec![0; MAX_INLINE_PUT + 1],
        b"",
        PutOptions::default(),
    ))
    .unwrap_err();
    assert!(matches!(err, Error::TooLarge(_)), "{err}");
    assert!(!e.contains("big").unwrap());
    block_on(s.put_inline("max", vec![0; MAX_INLINE_PUT], b"", PutOptions::default())).unwrap();
    assert!(e.contains("max").unwrap());
    e.shutdown();
}

#[test]
fn release_all_gives_back_everything_and_ends_a_waiting_get() {
    let e = engine();
    let s = e.client_session();
    e.put("held", b"bytes", b"", CreateOptions::default())
        .unwrap();
    let got = block_on(s.get(&["held", "held"], None)).unwrap();
    assert!(got.iter().all(Option::is_some));
    block_on(s.create("draft", 10, b"", CreateOptions::default())).unwrap();
    assert_eq!(e.stats().unwrap().references, 3);

    // A get waiting as this holder ends when the holder is released (a connection dying).
    let waiter = s.clone();
    let wait =
        std::thread::spawn(move || block_on(waiter.get(&["never"], Some(Duration::from_secs(60)))));
    // Released only once the GET waits in the table (a count, not a guessed sleep): else it
    // would start after the release and wait its whole 60 s.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while e.stats().unwrap().waiting_gets != 1 {
        assert!(std::time::Instant::now() < deadline, "the GET never waited");
        std::thread::sleep(Duration::from_millis(2));
    }
    s.release_all();
    assert!(matches!(wait.join().unwrap(), Err(Error::ShuttingDown)));
    let stats = e.stats().unwrap();
    assert_eq!((stats.references, stats.holders), (0, 0));
    // The unsealed object was aborted; the sealed one stays.
    assert!(!e.list().unwrap().iter().any(|i| i.name.as_str() == "draft"));
    assert!(e.contains("held").unwrap());
    // The session stays usable.
    assert!(block_on(s.get(&["held"], None)).unwrap()[0].is_some());
    drop(s);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while e.stats().unwrap().references != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "dropping the session released nothing"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    e.shutdown();
}
