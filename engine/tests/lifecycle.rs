//! The object life cycle of the embedded engine: refcounts, deferred delete, ephemeral objects,
//! LRU eviction, out-of-memory, abort, waiting gets, duplicate names.

use std::time::Duration;

use vovp::{
    Config, CreateOptions, CudaStore, DType, Engine, EngineHandle, Error, Store, TensorView,
};

fn engine(capacity: u64) -> EngineHandle {
    Engine::spawn(Config::with_capacity(capacity)).expect("engine starts")
}

fn put(e: &EngineHandle, name: &str, len: usize, fill: u8) {
    e.put(name, &vec![fill; len], b"meta", CreateOptions::default())
        .unwrap();
}

#[test]
fn create_write_seal_get_release() {
    let e = engine(1 << 20);
    let mut buf = e.create("a", 100, b"md", CreateOptions::default()).unwrap();
    buf.as_mut_slice().copy_from_slice(&[7u8; 100]);
    // Not visible before seal.
    assert!(!e.contains("a").unwrap());
    assert!(e.get(&["a"], None).unwrap()[0].is_none());
    let sealed = buf.seal().unwrap();
    assert!(e.contains("a").unwrap());
    let other = e.session();
    let v = other.get_one("a", None).unwrap();
    assert_eq!(&v[..], &[7u8; 100][..]);
    assert_eq!(v.metadata(), b"md");
    // Same physical memory, not a copy.
    assert_eq!(v.as_ptr(), sealed.as_ptr());
    assert_eq!(v.as_ptr() as usize % 64, 0);
    let info = &e.list().unwrap()[0];
    assert_eq!((info.refcount, info.sealed, info.size), (2, true, 100));
    drop(v);
    drop(sealed);
    wait_for(|| e.stats().unwrap().references == 0);
    assert_eq!(e.stats().unwrap().objects, 1);
    e.shutdown();
}

/// Polls `f` every 2 ms until it holds. The limit only turns a hang into a failure: on a
/// loaded 2-CPU machine 1 s (the old limit) was not always enough for a release to land.
fn wait_for(mut f: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(
            std::time::Instant::now() < deadline,
            "condition not reached in 20 s"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn duplicate_create_is_refused() {
    let e = engine(1 << 20);
    put(&e, "x", 10, 1);
    assert_eq!(
        e.create("x", 5, b"", CreateOptions::default()).unwrap_err(),
        Error::AlreadyExists("x".into())
    );
    let _unsealed = e.create("y", 5, b"", CreateOptions::default()).unwrap();
    assert!(matches!(
        e.put("y", b"abc", b"", CreateOptions::default()),
        Err(Error::AlreadyExists(_))
    ));
}

#[test]
fn bad_names_and_metadata_are_typed_errors() {
    let e = engine(1 << 20);
    assert!(matches!(
        e.put("", b"a", b"", CreateOptions::default()),
        Err(Error::InvalidName(_))
    ));
    let long = "n".repeat(257);
    assert!(matches!(
        e.get(&[long.as_str()], None),
        Err(Error::InvalidName(_))
    ));
    let big = vec![0u8; vovp::MAX_METADATA_LEN + 1];
    assert!(matches!(
        e.put("m", b"a", &big, CreateOptions::default()),
        Err(Error::MetadataTooLarge { .. })
    ));
    assert!(matches!(e.delete("nope"), Err(Error::NotFound(_))));
}

#[test]
fn abort_frees_and_only_unsealed_can_be_aborted() {
    let e = engine(1 << 20);
    let buf = e.create("a", 1000, b"", CreateOptions::default()).unwrap();
    assert!(matches!(e.session().abort("a"), Err(Error::NotCreator(_))));
    e.abort("a").unwrap();
    drop(buf); // its release of an aborted object is harmless
    wait_for(|| e.stats().unwrap().used_bytes == 0);
    assert!(!e.contains("a").unwrap());
    put(&e, "a", 10, 0);
    assert!(matches!(e.abort("a"), Err(Error::AlreadySealed(_))));
    // Dropping an unsealed buffer aborts it.
    drop(e.create("b", 64, b"", CreateOptions::default()).unwrap());
    wait_for(|| e.list().unwrap().len() == 1);
}

/// Regression (found by the `request_sequence` fuzz target): sealing a buffer whose object had been aborted
/// sealed the newer object its session had since created under the same name, and handed back
/// a view of the aborted object. Now the buffer's seal is refused and the newer object untouched.
#[test]
fn buffer_of_an_aborted_object_does_not_seal_a_newer_one() {
    let e = engine(1 << 20);
    let old = e.create("a", 64, b"", CreateOptions::default()).unwrap();
    e.abort("a").unwrap();
    let new = e.create("a", 64, b"", CreateOptions::default()).unwrap();
    assert!(matches!(old.seal(), Err(Error::NotFound(_))));
    assert!(
        !e.contains("a").unwrap(),
        "the newer object must stay unsealed"
    );
    let sealed = new.seal().unwrap();
    assert_eq!(e.get_one("a", None).unwrap().id(), sealed.id());
}

/// Regression (found with the `request_sequence` fuzz target's harness): abort(name) freed the memory under
/// the creator's still-alive buffer, so safe code writing that buffer wrote into the next object
/// given the memory, sealed or not. Now the memory goes with the buffer.
#[test]
fn a_buffer_kept_after_abort_cannot_write_into_another_object() {
    let e = engine(1 << 20);
    let mut old = e.create("a", 64, b"", CreateOptions::default()).unwrap();
    e.abort("a").unwrap();
    assert!(!e.contains("a").unwrap());
    let mut b = e.create("b", 64, b"", CreateOptions::default()).unwrap();
    b.as_mut_slice().fill(2);
    let b = b.seal().unwrap();
    assert_ne!(old.location(), b.location());
    old.as_mut_slice().fill(1);
    assert!(b.iter().all(|&x| x == 2));
    assert_eq!(e.stats().unwrap().pending_delete, 1);
    drop(old);
    wait_for(|| e.stats().unwrap().pending_delete == 0);
    // The name was free at once.
    put(&e, "a", 10, 0);
}

#[test]
fn delete_is_deferred_while_referenced() {
    let e = engine(1 << 20);
    put(&e, "d", 4096, 3);
    let v = e.get_one("d", None).unwrap();
    e.delete("d").unwrap();
    // The name is gone at once and can be reused...
    assert!(!e.contains("d").unwrap());
    put(&e, "d", 10, 9);
    // ...while the old bytes stay intact for their holder.
    assert!(v.iter().all(|&b| b == 3));
    let s = e.stats().unwrap();
    assert_eq!((s.objects, s.pending_delete), (1, 1));
    let used_with_old = s.used_bytes;
    drop(v);
    wait_for(|| e.stats().unwrap().pending_delete == 0);
    assert!(e.stats().unwrap().used_bytes < used_with_old);
}

#[test]
fn ephemeral_objects_go_with_their_last_reference() {
    let e = engine(1 << 20);
    let opts = CreateOptions {
        ephemeral: true,
        ..Default::default()
    };
    let mut buf = e.create("eph", 100, b"", opts).unwrap();
    buf.as_mut_slice().fill(1);
    let mine = buf.seal().unwrap();
    let theirs = e.session().get_one("eph", None).unwrap();
    drop(mine);
    wait_for(|| e.stats().unwrap().references == 1);
    assert!(e.contains("eph").unwrap());
    drop(theirs);
    wait_for(|| !e.contains("eph").unwrap());
    assert_eq!(e.stats().unwrap().used_bytes, 0);
}

#[test]
fn lru_eviction_order_and_referenced_objects_survive() {
    let e = engine(1 << 20);
    let quarter = (1 << 18) - 64;
    put(&e, "o1", quarter, 1);
    put(&e, "o2", quarter, 2);
    put(&e, "o3", quarter, 3);
    put(&e, "o4", quarter, 4);
    // Touch o1 so o2 is the least recently used; hold o3 so it cannot go.
    drop(e.get_one("o1", None).unwrap());
    let held = e.get_one("o3", None).unwrap();
    wait_for(|| e.stats().unwrap().references == 1);
    put(&e, "o5", quarter, 5);
    assert!(!e.contains("o2").unwrap(), "LRU object evicted first");
    assert!(e.contains("o1").unwrap() && e.contains("o4").unwrap());
    put(&e, "o6", quarter, 6);
    assert!(!e.contains("o4").unwrap());
    assert!(e.contains("o3").unwrap() && held.iter().all(|&b| b == 3));
    assert_eq!(e.stats().unwrap().evicted_objects, 2);
}

#[test]
fn out_of_memory_when_everything_is_referenced() {
    let e = engine(1 << 20);
    let a = e
        .create("a", 600_000, b"", CreateOptions::default())
        .unwrap();
    match e.create("b", 600_000, b"", CreateOptions::default()) {
        Err(Error::OutOfMemory {
            requested,
            available,
        }) => {
            assert_eq!(requested, 600_000);
            assert!(available < 600_000);
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    assert!(matches!(
        e.create("huge", 10 << 20, b"", CreateOptions::default()),
        Err(Error::OutOfMemory { .. })
    ));
    drop(a);
    // Once released (and so aborted) the room is back.
    wait_for(|| {
        e.create("b", 600_000, b"", CreateOptions::default())
            .is_ok()
    });
}

#[test]
fn get_waits_for_a_seal_from_another_thread() {
    let e = engine(1 << 20);
    let writer = e.session();
    let t = std::thread::spawn(move || {
        // Once the get below waits, not before.
        wait_for(|| writer.stats().unwrap().waiting_gets == 1);
        let mut b = writer
            .create("late", 3, b"", CreateOptions::default())
            .unwrap();
        b.as_mut_slice().copy_from_slice(b"abc");
        b.seal().unwrap()
    });
    // Long enough for the writer to be scheduled on a loaded machine; the get ends at it.
    let got = e
        .get(&["late", "never"], Some(Duration::from_secs(3)))
        .unwrap();
    // "late" arrived while waiting; "never" did not, so the get returned at its timeout.
    assert_eq!(&got[0].as_ref().unwrap()[..], b"abc");
    assert!(got[1].is_none());
    let _ = t.join().unwrap();
    let got = e
        .get(&["late", "never"], Some(Duration::from_millis(50)))
        .unwrap();
    assert_eq!(&got[0].as_ref().unwrap()[..], b"abc");
    assert!(got[1].is_none());
}

#[test]
fn get_returns_as_soon_as_all_are_sealed() {
    let e = engine(1 << 20);
    let writer = e.session();
    let start = std::time::Instant::now();
    let t = std::thread::spawn(move || {
        wait_for(|| writer.stats().unwrap().waiting_gets == 1);
        writer
            .put("w", b"xyz", b"", CreateOptions::default())
            .unwrap();
    });
    let v = e.get_one("w", Some(Duration::from_secs(30))).unwrap();
    assert!(start.elapsed() < Duration::from_secs(10));
    assert_eq!(&v[..], b"xyz");
    t.join().unwrap();
    // And a timeout with nothing sealed comes back empty-handed.
    assert!(matches!(
        e.get_one("nothing", Some(Duration::from_millis(20))),
        Err(Error::NotFound(_))
    ));
}

#[test]
fn large_put_copies_every_byte() {
    let e = engine(64 << 20);
    let data: Vec<u8> = (0..(24 << 20)).map(|i: usize| (i % 253) as u8).collect();
    e.put("big", &data, b"", CreateOptions::default()).unwrap();
    let v = e.get_one("big", None).unwrap();
    assert!(v[..] == data[..]);
}

#[test]
fn tensors_by_name() {
    let e = engine(1 << 20);
    let vals: Vec<f32> = (0..6).map(|i| i as f32).collect();
    let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    e.put_tensor("t", &TensorView::new(DType::F32, &[2, 3], &bytes).unwrap())
        .unwrap();
    let t = e.get_tensor("t", None).unwrap();
    assert_eq!(t.shape(), &[2, 3]);
    assert_eq!(t.as_slice::<f32>().unwrap(), &vals[..]);
    assert!(t.as_slice::<i32>().is_err());
    put(&e, "raw", 8, 0);
    assert!(matches!(e.get_tensor("raw", None), Err(Error::Tensor(_))));
}

#[test]
fn dropping_a_session_releases_everything_it_held() {
    let e = engine(1 << 20);
    put(&e, "s", 100, 1);
    let s = e.session();
    let v1 = s.get_one("s", None).unwrap();
    let unsealed = s.create("u", 100, b"", CreateOptions::default()).unwrap();
    // The handle goes first; its views keep the session (and their bytes) alive.
    drop(s);
    assert_eq!(v1[0], 1);
    assert_eq!(e.stats().unwrap().references, 2);
    drop(unsealed);
    drop(v1);
    wait_for(|| {
        let st = e.stats().unwrap();
        st.references == 0 && st.unsealed == 0
    });
}

#[test]
fn shutdown_makes_calls_fail_cleanly() {
    let e = engine(1 << 20);
    put(&e, "z", 10, 1);
    e.shutdown();
    assert_eq!(e.stats().unwrap_err(), Error::ShuttingDown);
}

#[test]
fn cuda_objects_without_a_gpu_fail_cleanly_and_host_objects_still_work() {
    if vovp_gpu::cuda_available().is_ok() {
        eprintln!("skipping: this machine has a CUDA driver (see gpu/check.sh)");
        return;
    }
    let e = engine(1 << 20);
    let cuda = CreateOptions {
        device: Some(vovp::Device::Cuda(0)),
        ..Default::default()
    };
    match e.create("g", 1024, b"", cuda) {
        Err(Error::GpuUnavailable(reason)) => assert!(!reason.is_empty()),
        other => panic!("expected GpuUnavailable, got {other:?}"),
    }
    assert!(matches!(
        e.put_cuda_tensor("gt", DType::F32, &[4], 0, 0),
        Err(Error::GpuUnavailable(_))
    ));
    put(&e, "host", 10, 1);
    // 10 data bytes padded to 64, then the 4 metadata bytes: two 64-byte units.
    assert_eq!(e.stats().unwrap().used_bytes, 128);
}

/// Regression (D1): a create of a size near 2^64 used to wrap the reservation to 0 and spin the
/// table actor forever in evict-and-retry whenever an unreferenced sealed object existed.
#[test]
fn creates_of_absurd_sizes_fail_at_once_and_evict_nothing() {
    let e = engine(1 << 20);
    put(&e, "cached", 100, 3);
    for size in [
        u64::MAX,
        u64::MAX - 63,
        0xF000_0000_0000_0001,
        1 << 63,
        1 << 40,
    ] {
        let start = std::time::Instant::now();
        match e.create("huge", size, b"", CreateOptions::default()) {
            Err(Error::OutOfMemory { requested, .. }) => assert_eq!(requested, size),
            other => panic!("create of {size:#x}: expected OutOfMemory, got {other:?}"),
        }
        assert!(start.elapsed() < std::time::Duration::from_secs(2));
    }
    // Nothing was evicted for a hopeless request, and the store still serves.
    assert!(e.contains("cached").unwrap());
    assert_eq!(e.stats().unwrap().evicted_objects, 0);
    put(&e, "after", 10, 1);
}

/// Regression (D4): metadata is counted against the capacity, so many objects with large
/// metadata fill the store (and then evict) instead of growing the daemon's heap unbounded.
#[test]
fn metadata_counts_against_capacity() {
    let e = engine(1 << 20);
    let meta = vec![7u8; vovp::MAX_METADATA_LEN];
    let mut stored = 0;
    for i in 0..64 {
        match e.put(&format!("m{i}"), b"", &meta, CreateOptions::default()) {
            Ok(_) => stored += 1,
            Err(other) => panic!("put {i}: {other:?}"),
        }
    }
    let s = e.stats().unwrap();
    // 1 MiB holds at most 16 objects of 64 KiB metadata: the older ones were evicted.
    assert!(stored == 64 && s.objects <= 16, "{s:?}");
    assert!(
        s.used_bytes <= s.capacity && s.evicted_objects >= 48,
        "{s:?}"
    );
    // Held objects cannot be evicted: then it is OutOfMemory, not unbounded growth.
    let held: Vec<_> = e
        .get(
            &e.list()
                .unwrap()
                .iter()
                .map(|i| i.name.as_str())
                .collect::<Vec<_>>(),
            None,
        )
        .unwrap();
    assert!(matches!(
        e.put("one-more", b"", &meta, CreateOptions::default()),
        Err(Error::OutOfMemory { .. })
    ));
    drop(held);
}

/// Regression (D11): at the object limit the error says so (it used to be an OutOfMemory
/// claiming gigabytes could be freed); unreferenced objects are evicted to make a slot.
#[test]
fn the_object_limit_is_its_own_error() {
    let mut config = vovp::Config::with_capacity(1 << 20);
    config.max_objects = 8;
    let e = vovp::Engine::spawn(config).unwrap();
    for i in 0..8 {
        put(&e, &format!("o{i}"), 8, 1);
    }
    // Full of slots but not of bytes: the least recently used object makes room.
    put(&e, "o8", 8, 1);
    assert!(!e.contains("o0").unwrap() && e.contains("o8").unwrap());
    let names: Vec<String> = e
        .list()
        .unwrap()
        .iter()
        .map(|i| i.name.to_string())
        .collect();
    let held = e
        .get(&names.iter().map(String::as_str).collect::<Vec<_>>(), None)
        .unwrap();
    match e.put("o9", b"x", b"", CreateOptions::default()) {
        Err(Error::TooManyObjects { limit }) => assert_eq!(limit, 8),
        other => panic!("expected TooManyObjects, got {other:?}"),
    }
    drop(held);
    put(&e, "o9", 8, 1);
}

/// One object as large as the whole store fits in an empty store (the allocator's rounding up
/// to its bins is not charged against the capacity).
#[test]
fn an_object_as_large_as_the_store_fits() {
    let cap = 100_000_000u64;
    let e = engine(cap);
    let mut b = e.create("all", cap, b"", CreateOptions::default()).unwrap();
    b.as_mut_slice()[cap as usize - 1] = 1;
    let held = b.seal().unwrap();
    assert_eq!(e.stats().unwrap().used_bytes, cap.next_multiple_of(64));
    // Held, so not evictable: nothing else fits.
    assert!(matches!(
        e.create("more", 64, b"", CreateOptions::default()),
        Err(Error::OutOfMemory { .. })
    ));
    drop(held);
}

/// A view got through the shared directory keeps its session, as any view does: dropping the
/// session handle must not release the hold under it (else the delete below would free the
/// bytes and the puts after it reuse them).
#[test]
fn a_view_outlives_its_session_handle_and_keeps_its_hold() {
    let e = engine(1 << 20);
    put(&e, "a", 1000, 5);
    let reader = e.session();
    let v = reader.get_one("a", None).unwrap();
    drop(reader);
    assert_eq!(e.stats().unwrap().shared_holds, 1);
    e.delete("a").unwrap();
    for i in 0..20 {
        put(&e, &format!("b{i}"), 1000, 9);
    }
    let s = e.stats().unwrap();
    assert_eq!((s.shared_holds, s.pending_delete), (1, 1), "{s:?}");
    assert!(v.iter().all(|&b| b == 5));
    drop(v);
    wait_for(|| e.stats().unwrap().pending_delete == 0);
    assert_eq!(e.stats().unwrap().shared_holds, 0);
    e.shutdown();
}

/// The embedded engine's gets of sealed host objects come from the shared directory (a hold
/// in the session's own table, no actor message) and count as references all the same; a
/// delete while held waits for the release; `Config::shared_reads = false` turns it off.
#[test]
fn embedded_gets_through_the_shared_directory() {
    let e = engine(1 << 20);
    put(&e, "a", 1000, 5);
    let reader = e.session();
    let v = reader.get_one("a", None).unwrap();
    assert!(v.iter().all(|&b| b == 5) && v.metadata() == b"meta");
    let s = e.stats().unwrap();
    assert_eq!((s.shared_holds, s.references), (1, 1));
    e.delete("a").unwrap();
    assert_eq!(e.stats().unwrap().pending_delete, 1);
    // The held memory is not handed to new objects while held.
    for i in 0..20 {
        put(&e, &format!("b{i}"), 1000, 9);
    }
    assert!(v.iter().all(|&b| b == 5));
    drop(v);
    wait_for(|| e.stats().unwrap().pending_delete == 0);
    assert_eq!(e.stats().unwrap().shared_holds, 0);
    futures_executor::block_on(e.check_invariants()).unwrap();
    e.shutdown();

    let mut config = Config::with_capacity(1 << 20);
    config.shared_reads = false;
    let e = Engine::spawn(config).unwrap();
    put(&e, "a", 10, 1);
    let v = e.session().get_one("a", None).unwrap();
    let s = e.stats().unwrap();
    assert_eq!((s.shared_holds, s.references), (0, 1));
    drop(v);
    e.shutdown();
}
