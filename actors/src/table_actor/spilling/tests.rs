//! Spilling on live actors with the real IO worker and files: a store several times over
//! full gives every object back bit-exact, a damaged or missing file is a typed error naming
//! the object, and `--spill-max` falls back to eviction.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kameo::actor::ActorRef;
use vovp_types::{Error, Location, ObjectRef, StoreStats};

use crate::segment::Segment;
use crate::spill::file::path_of;
use crate::spill::SpillConfig;
use crate::table_actor::memory::tests::{check, contains, n, store_and_segment, HOLDER};
use crate::table_actor::{Get, ObjectTableActor, PutInline, Release, Stats};

const KIB: u64 = 1 << 10;

fn dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vovp-spill-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// The bytes of object `i`: different in every object and every position.
fn pattern(i: u64, size: u64) -> Vec<u8> {
    (0..size)
        .map(|j| (j.wrapping_mul(31) ^ i.wrapping_mul(0x9e37)) as u8)
        .collect()
}

async fn put(store: &ActorRef<ObjectTableActor>, i: u64, size: u64) {
    let put = PutInline {
        holder: HOLDER,
        name: n(&format!("o{i}")),
        data: pattern(i, size),
        metadata: Arc::from(&b"meta"[..]),
        options: vovp_types::PutOptions::default(),
    };
    store.ask(put).await.unwrap();
}

async fn get(store: &ActorRef<ObjectTableActor>, i: u64) -> Result<Option<ObjectRef>, Error> {
    let get = Get {
        holder: HOLDER,
        names: vec![n(&format!("o{i}"))],
        newer_than: Vec::new(),
        wait: None,
    };
    let rx = store.ask(get).await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(20), rx)
        .await
        .expect("a get of a spilled object ends")
        .unwrap();
    got.map(|mut v| v.pop().flatten())
}

fn bytes_of(segment: &Segment, r: &ObjectRef) -> Vec<u8> {
    let Location::Host { segment: 0, offset } = r.location else {
        panic!("{:?} not in segment 0", r.location);
    };
    let p = segment.ptr(offset, r.size).unwrap();
    // SAFETY: a sealed object this holder references, inside the mapping.
    unsafe { std::slice::from_raw_parts(p, r.size as usize) }.to_vec()
}

async fn release(store: &ActorRef<ObjectTableActor>, r: &ObjectRef) {
    let m = Release {
        holder: HOLDER,
        ids: vec![r.id],
    };
    assert_eq!(store.ask(m).await.unwrap(), None);
}

async fn stats(store: &ActorRef<ObjectTableActor>) -> StoreStats {
    store.ask(Stats).await.unwrap()
}

/// Waits until every spill in flight landed (spilled + evicted instead add up to `want`).
async fn settled(store: &ActorRef<ObjectTableActor>, want: u64) -> StoreStats {
    for _ in 0..2000 {
        let s = stats(store).await;
        if s.spills + s.spill_failures >= want {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("spills did not land: {:?}", stats(store).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_three_times_over_full_gives_every_object_back_bit_exact() {
    let d = dir("full");
    let config = SpillConfig {
        dir: d.clone(),
        max_bytes: None,
    };
    let (store, segment) = store_and_segment(256 * KIB, 1024, Some(&config));
    let size = 60 * KIB;
    for i in 0..13 {
        put(&store, i, size).await;
    }
    // Nothing was lost: every name is still there, most of them on disk.
    for i in 0..13 {
        assert!(contains(&store, &format!("o{i}")).await, "o{i}");
    }
    let s = stats(&store).await;
    assert!(s.spilled_objects >= 9, "{s:?}");
    assert_eq!((s.evicted_objects, s.spill_failures), (0, 0), "{s:?}");
    assert!(s.used_bytes <= s.capacity);
    check(&store).await;
    // Read back in another order, each restore spilling others to make room.
    for i in (0..13).rev().chain([3, 7]) {
        let r = get(&store, i).await.unwrap().expect("restored");
        assert_eq!(r.metadata.as_ref(), b"meta");
        assert!(bytes_of(&segment, &r) == pattern(i, size), "o{i} bit-exact");
        release(&store, &r).await;
    }
    let s = stats(&store).await;
    assert!(s.restores >= 9, "{s:?}");
    assert_eq!(s.restore_failures, 0);
    assert!(s.used_bytes <= s.capacity);
    check(&store).await;
    let _ = store.stop_gracefully().await;
    store.wait_for_shutdown().await;
    std::fs::remove_dir_all(&d).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_or_missing_file_is_an_error_naming_the_object_never_its_bytes() {
    let d = dir("damaged");
    let config = SpillConfig {
        dir: d.clone(),
        max_bytes: None,
    };
    let (store, _segment) = store_and_segment(256 * KIB, 1024, Some(&config));
    for i in 0..8 {
        put(&store, i, 60 * KIB).await;
    }
    settled(&store, 4).await;
    // o0 and o1 are the oldest: on disk. Flip a data byte of one, remove the other's file.
    let ids: Vec<u64> = std::fs::read_dir(&d)
        .unwrap()
        .filter_map(|e| {
            e.ok()?
                .file_name()
                .to_str()?
                .strip_suffix(".spill")
                .map(String::from)
        })
        .filter_map(|h| u64::from_str_radix(&h, 16).ok())
        .collect();
    assert!(ids.len() >= 2, "{ids:?}");
    let mut sorted = ids.clone();
    sorted.sort_by_key(|id| id >> 32);
    let (first, second) = (sorted[0], sorted[1]);
    let f = path_of(&d, first);
    let mut bytes = std::fs::read(&f).unwrap();
    bytes[4096 + 1000] ^= 1;
    std::fs::write(&f, bytes).unwrap();
    std::fs::remove_file(path_of(&d, second)).unwrap();
    for i in [0, 1] {
        match get(&store, i).await {
            Err(Error::SpillDamaged(m)) => assert!(m.contains(&format!("\"o{i}\"")), "{m}"),
            other => panic!("o{i}: {other:?}"),
        }
        // Gone since: a later get finds nothing.
        assert_eq!(get(&store, i).await, Ok(None));
    }
    assert_eq!(stats(&store).await.restore_failures, 2);
    check(&store).await;
    let _ = store.stop_gracefully().await;
    store.wait_for_shutdown().await;
    let _ = std::fs::remove_dir_all(&d);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_spill_max_victims_are_evicted_and_every_put_still_succeeds() {
    let d = dir("max");
    let config = SpillConfig {
        dir: d.clone(),
        // Room for two files of 60 KiB objects.
        max_bytes: Some(2 * (4096 + 60 * KIB)),
    };
    let (store, _segment) = store_and_segment(256 * KIB, 1024, Some(&config));
    for i in 0..10 {
        put(&store, i, 60 * KIB).await;
    }
    let s = settled(&store, 6).await;
    assert_eq!(s.spilled_objects, 2, "{s:?}");
    assert!(
        s.spill_failures >= 4 && s.evicted_objects == s.spill_failures,
        "{s:?}"
    );
    check(&store).await;
    // The stop removes the files (a stopped store has no objects), then the lock goes.
    let _ = store.stop_gracefully().await;
    store.wait_for_shutdown().await;
    for _ in 0..200 {
        if std::fs::read_dir(&d)
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .is_ok_and(|e| e.file_name().to_string_lossy().ends_with(".spill"))
            })
            .count()
            == 0
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let left = std::fs::read_dir(&d)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.file_name().to_string_lossy().ends_with(".spill"))
        })
        .count();
    assert_eq!(left, 0);
    std::fs::remove_dir_all(&d).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_object_keeps_its_file_and_goes_back_to_disk_without_a_write() {
    let d = dir("kept");
    let config = SpillConfig {
        dir: d.clone(),
        max_bytes: None,
    };
    let (store, segment) = store_and_segment(256 * KIB, 1024, Some(&config));
    for i in 0..6 {
        put(&store, i, 60 * KIB).await;
    }
    settled(&store, 2).await;
    let r = get(&store, 0).await.unwrap().expect("restored");
    release(&store, &r).await;
    let file = path_of(&d, r.id.get());
    let written = std::fs::metadata(&file).expect("kept").modified().unwrap();
    let before = stats(&store).await;
    // New objects push o0 out again: on disk only at once, its file not written again.
    for i in 10..16 {
        put(&store, i, 60 * KIB).await;
    }
    settled(&store, before.spills + 4).await;
    assert_eq!(
        std::fs::metadata(&file).unwrap().modified().unwrap(),
        written
    );
    let r = get(&store, 0).await.unwrap().expect("restored again");
    assert!(
        bytes_of(&segment, &r) == pattern(0, 60 * KIB),
        "o0 bit-exact"
    );
    release(&store, &r).await;
    let after = stats(&store).await;
    assert_eq!(after.restores, before.restores + 1, "{after:?}");
    check(&store).await;
    // A delete takes the kept file with it.
    store
        .ask(crate::table_actor::Delete { name: n("o0") })
        .await
        .unwrap();
    for _ in 0..200 {
        if !file.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(!file.exists());
    let _ = store.stop_gracefully().await;
    store.wait_for_shutdown().await;
    let _ = std::fs::remove_dir_all(&d);
}
