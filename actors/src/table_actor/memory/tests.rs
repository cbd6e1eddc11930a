//! The allocate-evict loop on live actors (allocator, GPU, table; no shared directory): a full
//! store evicts least recently used objects until a new one fits, never objects someone
//! holds, and a request that cannot fit fails before evicting anything.

use std::sync::Arc;

use kameo::actor::{ActorRef, Spawn};
use vovp_gpu_pool::GpuConfig;
use vovp_types::{Error, HolderId, ObjectName, ObjectRef};

use crate::allocator::{reserved_bytes, AllocatorActor};
use crate::gpu::GpuActor;
use crate::segment::Segment;
use crate::table_actor::{CheckInvariants, Contains, Get, ObjectTableActor, PutInline, Release};

const KIB: u64 = 1 << 10;
pub(crate) const HOLDER: HolderId = HolderId::from_raw(1);

/// A store of `capacity` bytes in segment 0 (no arenas), holding at most `max_objects`.
fn store(capacity: u64, max_objects: u32) -> ActorRef<ObjectTableActor> {
    store_with(capacity, max_objects, None)
}

/// [`store`], spilling to `spill` when given.
fn store_with(
    capacity: u64,
    max_objects: u32,
    spill: Option<&crate::spill::SpillConfig>,
) -> ActorRef<ObjectTableActor> {
    store_and_segment(capacity, max_objects, spill).0
}

/// [`store_with`], and its segment 0 (where its objects are).
pub(crate) fn store_and_segment(
    capacity: u64,
    max_objects: u32,
    spill: Option<&crate::spill::SpillConfig>,
) -> (ActorRef<ObjectTableActor>, Arc<Segment>) {
    let len = reserved_bytes(capacity).unwrap();
    let segment0 = Arc::new(Segment::create(0, len, false, false).unwrap());
    let allocator = AllocatorActor::spawn(AllocatorActor::new(
        segment0.clone(),
        capacity,
        max_objects,
        false,
    ));
    let gpu = GpuActor::spawn(GpuActor::new(GpuConfig::default()));
    let table = ObjectTableActor::new(
        allocator,
        gpu,
        Arc::from(vec![segment0.clone()]),
        None,
        spill,
        max_objects as usize,
    )
    .unwrap();
    (ObjectTableActor::spawn(table), segment0)
}

pub(crate) fn n(s: &str) -> ObjectName {
    ObjectName::new(s).unwrap()
}

pub(crate) async fn put(
    store: &ActorRef<ObjectTableActor>,
    name: &str,
    size: u64,
) -> Result<ObjectRef, Error> {
    let put = PutInline {
        holder: HOLDER,
        name: n(name),
        data: vec![7; size as usize],
        metadata: Arc::from(&[][..]),
        options: vovp_types::PutOptions::default(),
    };
    store.ask(put).await.map_err(|e| match e {
        kameo::error::SendError::HandlerError(e) => e,
        other => Error::Internal(other.to_string()),
    })
}

pub(crate) async fn contains(store: &ActorRef<ObjectTableActor>, name: &str) -> bool {
    store.ask(Contains { name: n(name) }).await.unwrap()
}

pub(crate) async fn check(store: &ActorRef<ObjectTableActor>) {
    store.ask(CheckInvariants).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_store_evicts_the_least_recently_used_until_the_new_object_fits() {
    let store = store(256 * KIB, 1024);
    for name in ["a", "b", "c", "d"] {
        put(&store, name, 60 * KIB).await.unwrap();
    }
    // 240 KiB used: the next 60 KiB need one object to go, the oldest.
    put(&store, "e", 60 * KIB).await.unwrap();
    assert!(!contains(&store, "a").await);
    for name in ["b", "c", "d", "e"] {
        assert!(contains(&store, name).await, "{name}");
    }
    check(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_objects_stay_and_a_hopeless_put_evicts_nothing() {
    let store = store(256 * KIB, 1024);
    for name in ["a", "b", "c", "d"] {
        put(&store, name, 60 * KIB).await.unwrap();
    }
    // Larger than the store: refused before anything is evicted.
    assert!(matches!(
        put(&store, "huge", 300 * KIB).await,
        Err(Error::OutOfMemory { .. })
    ));
    for name in ["a", "b", "c", "d"] {
        assert!(contains(&store, name).await, "{name}");
    }
    // Everything held: nothing can go, so the put fails.
    let get = Get {
        holder: HOLDER,
        names: ["a", "b", "c", "d"].map(n).to_vec(),
        newer_than: Vec::new(),
        wait: None,
    };
    let held = store.ask(get).await.unwrap().await.unwrap().unwrap();
    assert!(matches!(
        put(&store, "e", 60 * KIB).await,
        Err(Error::OutOfMemory { .. })
    ));
    let ids = held.into_iter().flatten().map(|r| r.id).collect();
    let release = Release {
        holder: HOLDER,
        ids,
    };
    assert_eq!(store.ask(release).await.unwrap(), None);
    put(&store, "e", 60 * KIB).await.unwrap();
    check(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_object_limit_evicts_one_object_per_slot_needed() {
    let store = store(256 * KIB, 3);
    for name in ["a", "b", "c"] {
        put(&store, name, KIB).await.unwrap();
    }
    // Bytes fit, slots do not: the oldest object goes for its slot.
    put(&store, "d", KIB).await.unwrap();
    assert!(!contains(&store, "a").await);
    assert!(contains(&store, "b").await);
    check(&store).await;
}
