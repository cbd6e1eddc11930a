//! The table's life cycle as a whole: create, seal, get, release, abort, delete, replace,
//! ephemeral objects and departing holders, each step checked against every invariant.

use std::sync::Arc;

use tokio::sync::oneshot;
use vovp_types::{Error, NotificationKind, ObjectId};

use super::test_support::{
    block, insert, n, names, new_object, ok, put, refcount, replace, A, B, GPU0,
};
use super::{NewObject, ObjectTable};

#[test]
fn life_cycle_create_seal_get_release() {
    let mut t = ObjectTable::new();
    let r = insert(&mut t, "x", 100, false);
    assert_eq!(r.size, 100);
    ok(&t);
    // Unsealed: invisible to gets and contains, but its name is taken.
    assert!(!t.contains(&n("x")));
    assert!(t.get_now(&n("x"), 0, B).is_none());
    assert_eq!(
        t.check_name_free(&n("x"), false, A),
        Err(Error::AlreadyExists("x".into()))
    );
    let s = t.stats();
    assert_eq!(
        (s.objects, s.unsealed, s.sealed, s.references),
        (1, 1, 0, 1)
    );

    t.seal(&n("x"), A, None).unwrap();
    assert!(t.contains(&n("x")));
    let g = t.get_now(&n("x"), 0, B).unwrap();
    assert_eq!(g.id, r.id);
    assert_eq!(refcount(&t, "x"), 2);
    ok(&t);

    assert!(t.release(r.id, A).unwrap().is_none());
    assert!(t.release(g.id, B).unwrap().is_none());
    // Sealed and unreferenced: kept, and evictable.
    assert!(t.contains(&n("x")));
    assert_eq!(t.evictable_objects(GPU0), 1);
    assert_eq!(t.evictable_bytes(GPU0), 100);
    let s = t.stats();
    assert_eq!((s.sealed, s.references, s.holders, s.creates), (1, 0, 0, 1));
    ok(&t);
}

#[test]
fn only_the_creator_seals_or_aborts_and_only_once() {
    let mut t = ObjectTable::new();
    let r = insert(&mut t, "x", 8, false);
    assert_eq!(
        t.seal(&n("x"), B, None).err(),
        Some(Error::NotCreator("x".into()))
    );
    assert_eq!(
        t.abort(&n("x"), B, false).err(),
        Some(Error::NotCreator("x".into()))
    );
    // An id of another incarnation is not this object.
    let stale = ObjectId::from_raw(r.id.get() ^ (1 << 40));
    assert_eq!(
        t.seal(&n("x"), A, Some(stale)).err(),
        Some(Error::NotFound("x".into()))
    );
    t.seal(&n("x"), A, Some(r.id)).unwrap();
    assert_eq!(
        t.seal(&n("x"), A, None).err(),
        Some(Error::AlreadySealed("x".into()))
    );
    assert_eq!(
        t.abort(&n("x"), A, false).err(),
        Some(Error::AlreadySealed("x".into()))
    );
    assert_eq!(
        t.seal(&n("nope"), A, None).err(),
        Some(Error::NotFound("nope".into()))
    );
    ok(&t);
}

#[test]
fn abort_frees_now_or_with_the_creators_reference() {
    let mut t = ObjectTable::new();
    insert(&mut t, "now", 8, false);
    let freed = t.abort(&n("now"), A, false).unwrap().unwrap();
    assert_eq!(freed.name.as_str(), "now");
    assert!(t.is_empty());
    ok(&t);

    // keep_while_held: the name is free at once, the memory goes with the release.
    let r = insert(&mut t, "later", 8, false);
    assert!(t.abort(&n("later"), A, true).unwrap().is_none());
    assert!(t.check_name_free(&n("later"), false, A).is_ok());
    assert_eq!(t.len(), 1);
    ok(&t);
    let freed = t.release(r.id, A).unwrap().unwrap();
    assert_eq!(freed.name.as_str(), "later");
    assert!(t.is_empty());
    ok(&t);
}

#[test]
fn releasing_the_creators_reference_of_an_unsealed_object_aborts_it() {
    let mut t = ObjectTable::new();
    let r = insert(&mut t, "x", 8, false);
    let freed = t.release(r.id, A).unwrap().unwrap();
    assert_eq!(freed.name.as_str(), "x");
    assert!(t.check_name_free(&n("x"), false, A).is_ok());
    ok(&t);
}

#[test]
fn references_count_per_holder_and_per_get() {
    let mut t = ObjectTable::new();
    let r = put(&mut t, "x", 64);
    let a1 = t.get_now(&n("x"), 0, A).unwrap();
    let a2 = t.get_now(&n("x"), 0, A).unwrap();
    let b1 = t.get_now(&n("x"), 0, B).unwrap();
    assert_eq!(refcount(&t, "x"), 3);
    assert_eq!(t.stats().holders, 2);
    // Referenced: out of the LRU.
    assert_eq!(t.evictable_objects(GPU0), 0);
    assert!(t.evict(GPU0, u64::MAX).is_empty());
    ok(&t);

    t.release(a1.id, A).unwrap();
    // B holds one reference; a second release of it is refused and changes nothing.
    t.release(b1.id, B).unwrap();
    assert_eq!(t.release(b1.id, B).err(), Some(Error::NotHeld(r.id.get())));
    assert_eq!(refcount(&t, "x"), 1);
    assert_eq!(t.stats().holders, 1);
    ok(&t);
    t.release(a2.id, A).unwrap();
    assert_eq!(t.release(a2.id, A).err(), Some(Error::NotHeld(r.id.get())));
    assert_eq!(refcount(&t, "x"), 0);
    assert_eq!(t.evictable_objects(GPU0), 1);
    // An id that never existed.
    let bogus = ObjectId::from_raw(0xdead_0000_0042);
    assert_eq!(t.release(bogus, A).err(), Some(Error::NotHeld(bogus.get())));
    ok(&t);
}

#[test]
fn delete_while_held_frees_the_name_now_and_the_memory_at_the_last_release() {
    let mut t = ObjectTable::new();
    t.set_recording(true);
    let old = put(&mut t, "x", 64);
    let held = t.get_now(&n("x"), 0, B).unwrap();
    t.take_events();
    assert!(t.delete(&n("x")).unwrap().is_none());
    assert!(!t.contains(&n("x")));
    assert_eq!(t.delete(&n("x")).err(), Some(Error::NotFound("x".into())));
    let s = t.stats();
    assert_eq!((s.objects, s.pending_delete), (0, 1));
    ok(&t);

    // The name is free for a new object with a new id; the old reference still counts.
    let new = put(&mut t, "x", 32);
    assert_ne!(new.id, old.id);
    assert_eq!(t.get_now(&n("x"), 0, A).unwrap().id, new.id);
    ok(&t);
    let freed = t.release(held.id, B).unwrap().unwrap();
    assert_eq!((freed.name.as_str(), freed.size), ("x", 64));
    assert_eq!(t.stats().pending_delete, 0);
    assert!(t.contains(&n("x")));
    // One Deleted notification, at the delete (none at the memory's release).
    let kinds: Vec<_> = t.take_events().iter().map(|e| e.kind).collect();
    assert_eq!(kinds, [NotificationKind::Deleted, NotificationKind::Sealed]);
    ok(&t);

    // Unsealed objects cannot be deleted; unreferenced ones go at once.
    insert(&mut t, "u", 8, false);
    assert_eq!(t.delete(&n("u")).err(), Some(Error::NotSealed("u".into())));
    put(&mut t, "free", 8);
    assert_eq!(t.delete(&n("free")).unwrap().unwrap().name.as_str(), "free");
    ok(&t);
}

#[test]
fn ephemeral_objects_go_at_their_last_release() {
    let mut t = ObjectTable::new();
    t.set_recording(true);
    let r = insert(&mut t, "e", 8, true);
    t.seal(&n("e"), A, None).unwrap();
    let other = t.get_now(&n("e"), 0, B).unwrap();
    assert!(t.release(r.id, A).unwrap().is_none());
    // Never in the LRU, even when unreferenced for a moment.
    assert_eq!(t.evictable_objects(GPU0), 0);
    t.take_events();
    let freed = t.release(other.id, B).unwrap().unwrap();
    assert_eq!(freed.name.as_str(), "e");
    assert!(!t.contains(&n("e")));
    assert!(t.is_empty());
    let kinds: Vec<_> = t.take_events().iter().map(|e| e.kind).collect();
    assert_eq!(kinds, [NotificationKind::Deleted]);
    ok(&t);
}

#[test]
fn releasing_a_holder_drops_everything_it_held() {
    let mut t = ObjectTable::new();
    put(&mut t, "kept", 8);
    let _k1 = t.get_now(&n("kept"), 0, B).unwrap();
    let _k2 = t.get_now(&n("kept"), 0, B).unwrap();
    let _k3 = t.get_now(&n("kept"), 0, A).unwrap();
    // B created an unsealed object and waits for a name nobody has sealed yet.
    t.insert(NewObject {
        metadata: Arc::from(&[][..]),
        ..new_object("draft", 8, block(1 << 20, 8), false, false, B)
    })
    .unwrap();
    let (tx, mut rx) = oneshot::channel();
    t.begin_get(B, vec![n("kept"), n("never")], Vec::new(), true, tx)
        .ok()
        .unwrap();
    assert_eq!(refcount(&t, "kept"), 4);
    ok(&t);

    let freed = t.release_holder(B);
    assert_eq!(names(&freed), ["draft"]);
    assert!(t.check_name_free(&n("draft"), false, A).is_ok());
    assert_eq!(refcount(&t, "kept"), 1);
    assert_eq!(t.stats().holders, 1);
    // The waiting get is gone: its reply is dropped, and a later seal wakes nobody.
    assert!(matches!(
        rx.try_recv(),
        Err(oneshot::error::TryRecvError::Closed)
    ));
    insert(&mut t, "never", 8, false);
    assert!(t.seal(&n("never"), A, None).unwrap().done.is_empty());
    ok(&t);
    // Nothing left to release: a second call is a no-op.
    assert!(t.release_holder(B).is_empty());
    ok(&t);
}

#[test]
fn a_replace_takes_the_name_at_its_seal_and_readers_keep_the_old_version() {
    let mut t = ObjectTable::new();
    t.set_recording(true);
    let v1 = put(&mut t, "w", 64);
    let held = t.get_now(&n("w"), 0, B).unwrap();
    assert_eq!(held.version, 1);
    // Without `replace` the name is taken, as before.
    assert_eq!(
        t.check_name_free(&n("w"), false, A).err(),
        Some(Error::AlreadyExists("w".into()))
    );
    let r = replace(&mut t, "w", 128, A).unwrap();
    assert_eq!(r.version, 0);
    ok(&t);
    // Until the seal every get is the old version; the replacement is nowhere by name.
    assert_eq!(t.get_now(&n("w"), 0, B).unwrap().id, v1.id);
    assert_eq!(t.list().len(), 1);
    assert_eq!((t.stats().objects, t.stats().unsealed), (2, 1));
    // One replacement of a name at a time per creator; another creator may write one.
    assert!(replace(&mut t, "w", 8, A).is_err());
    t.take_events();
    let sealed = t.seal(&n("w"), A, Some(r.id)).unwrap();
    assert_eq!(sealed.version, 2);
    // B still holds v1 (twice): nothing is freed, the name is v2's.
    assert!(sealed.freed.is_none());
    let events = t.take_events();
    assert_eq!(events.len(), 1);
    assert_eq!(
        (events[0].kind, events[0].version),
        (NotificationKind::Replaced, 2)
    );
    let now = t.get_now(&n("w"), 0, B).unwrap();
    assert_eq!((now.id, now.version, now.size), (r.id, 2, 128));
    assert!(t.get_now(&n("w"), 2, B).is_none());
    assert_eq!(t.stats().pending_delete, 1);
    ok(&t);
    // v1 goes with its last holder's release (B got it twice).
    assert!(t.release(held.id, B).unwrap().is_none());
    let freed = t.release(v1.id, B).unwrap().expect("v1's memory");
    assert_eq!(freed.size, 64);
    assert_eq!(t.stats().pending_delete, 0);
    ok(&t);
}

#[test]
fn an_unheld_old_version_is_freed_at_the_replacing_seal() {
    let mut t = ObjectTable::new();
    put(&mut t, "w", 64);
    let r = replace(&mut t, "w", 64, A).unwrap();
    let sealed = t.seal(&n("w"), A, None).unwrap();
    assert_eq!(sealed.version, 2);
    assert!(sealed.freed.is_some());
    assert!(t.release(r.id, A).unwrap().is_none());
    assert_eq!(t.len(), 1);
    ok(&t);
    // An aborted replacement leaves the current version in place.
    let r = replace(&mut t, "w", 64, A).unwrap();
    assert!(t.abort(&n("w"), A, false).unwrap().is_some());
    assert_eq!(t.get_now(&n("w"), 0, B).unwrap().version, 2);
    // So does a replacer that goes away before its seal.
    let r2 = replace(&mut t, "w", 64, B).unwrap();
    assert!(r2.id != r.id);
    let freed = t.release_holder(B);
    assert_eq!(freed.len(), 1);
    assert_eq!(t.len(), 1);
    ok(&t);
}

#[test]
fn explicit_versions_seal_as_asked_and_never_go_back() {
    let mut t = ObjectTable::new();
    let at = |version: u64, replace: bool, by| NewObject {
        version: Some(version),
        ..new_object("w", 8, block(version * 4096, 8), false, replace, by)
    };
    // A first object sealed as version 5 (a cluster's number), waiters for "above 4" answered.
    let first = t.insert(at(5, false, A)).unwrap();
    assert_eq!(t.seal(&n("w"), A, Some(first.id)).unwrap().version, 5);
    assert_eq!(t.get_now(&n("w"), 4, B).unwrap().version, 5);
    assert!(t.get_now(&n("w"), 5, B).is_none());
    // Not above the present version: refused at insert, before any memory is asked for.
    let stale = Error::StaleVersion {
        name: "w".into(),
        current: 5,
        requested: 5,
    };
    assert_eq!(t.check_version(&n("w"), Some(5)), Err(stale.clone()));
    assert_eq!(t.insert(at(5, true, A)).err(), Some(stale));
    assert!(matches!(
        t.check_version(&n("w"), Some(0)),
        Err(Error::Protocol(_))
    ));
    // Two replacements racing: version 9 seals first, then 7 is stale at its seal and stays
    // unsealed for its creator to abort; the name stays at 9.
    let seven = t.insert(at(7, true, A)).unwrap();
    let nine = t.insert(at(9, true, B)).unwrap();
    assert_eq!(t.seal(&n("w"), B, Some(nine.id)).unwrap().version, 9);
    assert_eq!(
        t.seal(&n("w"), A, Some(seven.id)).err(),
        Some(Error::StaleVersion {
            name: "w".into(),
            current: 9,
            requested: 7
        })
    );
    assert!(t.abort(&n("w"), A, false).unwrap().is_some());
    assert_eq!(t.get_now(&n("w"), 0, B).unwrap().id, nine.id);
    // Without an explicit version the next replace goes on from the cluster's number.
    let next = replace(&mut t, "w", 8, A).unwrap();
    assert_eq!(t.seal(&n("w"), A, Some(next.id)).unwrap().version, 10);
    ok(&t);
}
