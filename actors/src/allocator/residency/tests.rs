//! The residency bound, tested on a whole allocator: pages kept warm and given back, backed at
//! create, never past the capacity and slack, and the kernel's own count within the
//! allocator's.

use std::sync::Arc;

use proptest::prelude::*;
use vovp_types::HolderId;

use crate::allocator::AllocFailure;
use crate::allocator::{
    actor_for_tests as actor, reserved_bytes, AllocatorActor, HostBlock, Writer,
};
use crate::segment::Segment;

#[test]
fn freed_pages_are_reused_warm_and_given_back_before_the_budget_is_passed() {
    let cap = 64 << 20;
    let mut a = actor(cap);
    let blocks: Vec<_> = (0..12)
        .map(|_| {
            a.allocate(4 << 20, Writer::Client(HolderId::from_raw(1)))
                .unwrap()
        })
        .collect();
    for b in blocks {
        a.free(b);
    }
    // 48 MiB freed but kept (the owner's next objects find them faulted in).
    assert_eq!(a.usage().resident, 48 << 20);
    let again = a
        .allocate(4 << 20, Writer::Client(HolderId::from_raw(1)))
        .unwrap();
    assert_eq!(a.usage().resident, 48 << 20, "reused, not newly resident");
    a.free(again);
    // Another client needs 40 MiB: the first client's freed pages are given back.
    let other: Vec<_> = (0..10)
        .map(|_| {
            a.allocate(4 << 20, Writer::Client(HolderId::from_raw(2)))
                .unwrap()
        })
        .collect();
    let u = a.usage();
    assert!(u.resident <= cap, "{u:?}");
    assert_eq!(u.used, 40 << 20);
    for b in other {
        a.free(b);
    }
}

#[test]
fn a_create_backs_its_pages_and_a_shared_page_stays_while_a_neighbour_lives() {
    let mut a = actor(16 << 20);
    let seg0 = a.segments[&0].segment.clone();
    let x = a.allocate(100, Writer::Store).unwrap();
    let y = a.allocate(100, Writer::Store).unwrap();
    assert_eq!(
        x.offset / 4096,
        y.offset / 4096,
        "two small objects share a page"
    );
    // Backed at create, before anyone touched it; and counted as the page it is.
    assert_eq!(seg0.allocated_bytes(), 4096);
    assert_eq!(a.usage().resident, 4096);
    a.free(x);
    assert_eq!(a.give_back(u64::MAX, 1), 0, "y still lives in that page");
    assert_eq!(seg0.allocated_bytes(), 4096);
    a.free(y);
    assert_eq!(a.give_back(u64::MAX, 1), 4096);
    assert_eq!(seg0.allocated_bytes(), 0);
    // An object is backed whole, to its last partly used page.
    let b = a
        .allocate((1 << 20) + 1, Writer::Client(HolderId::from_raw(1)))
        .unwrap();
    let arena = a.segments[&b.segment].segment.clone();
    assert_eq!(arena.allocated_bytes(), (1 << 20) + 4096);
    assert_eq!(a.usage().resident, (1 << 20) + 4096);
    // Freed, its pages stay warm: the next object there needs nothing new.
    a.free(b);
    let c = a
        .allocate(1 << 20, Writer::Client(HolderId::from_raw(1)))
        .unwrap();
    assert_eq!(c.offset, b.offset);
    assert_eq!(arena.allocated_bytes(), (1 << 20) + 4096);
    a.free(c);
}

#[test]
fn lazy_pages_are_counted_but_not_allocated_until_touched() {
    let seg = Arc::new(Segment::create(0, 16 << 20, false, false).unwrap());
    let mut a = AllocatorActor::new(seg.clone(), 16 << 20, 1 << 20, true).with_backing(false);
    let b = a.allocate(1 << 20, Writer::Store).unwrap();
    assert_eq!(seg.allocated_bytes(), 0);
    assert_eq!(a.usage().resident, 1 << 20);
    a.free(b);
}

#[test]
fn resident_pages_never_pass_the_capacity_and_slack() {
    // 64-byte objects a page apart (the fillers between them freed) cost a page each for 64
    // bytes charged. A create whose bytes fit but whose pages would pass the budget is
    // refused (the table then evicts) rather than let the pages pass it.
    let cap = 1 << 20;
    let mut a = actor(cap);
    let mut small = Vec::new();
    let mut fillers = Vec::new();
    while let Ok(s) = a.allocate(64, Writer::Store) {
        small.push(s);
        match a.allocate(4096 - 64, Writer::Store) {
            Ok(f) => fillers.push(f),
            Err(_) => break,
        }
    }
    for f in fillers {
        a.free(f);
    }
    let u = a.usage();
    assert!(
        u.used <= 64 * small.len() as u64 && u.resident >= cap - 4096,
        "{u:?}"
    );
    // (a few fillers may have landed where no small object shares their pages)
    let given = a.give_back(u64::MAX, 1);
    assert!(
        given <= 4 * 4096,
        "pages shared with live objects stay: {given}"
    );
    assert_eq!(
        a.allocate(cap / 2, Writer::Client(HolderId::from_raw(1)))
            .err(),
        Some(AllocFailure::NoSpace),
        "bytes fit, pages do not"
    );
    assert!(a.usage().resident <= cap + a.residency.slack);
    for s in small {
        a.free(s);
    }
    assert!(
        a.allocate(cap / 2, Writer::Client(HolderId::from_raw(1)))
            .is_ok(),
        "pages given back"
    );
    assert!(a.usage().resident <= cap + a.residency.slack);
}

proptest! {
    /// The kernel's own count of the segments' pages (st_blocks), with every page of every
    /// live object written as a client would, never passes the allocator's resident figure,
    /// and that never passes capacity + slack — whatever the mix of sizes, writers, frees
    /// and departed owners. (Counting bytes, the allocator let partly used pages pile up
    /// past `-m`: the soak saw 744 KiB over 64 MiB.)
    #[test]
    fn kernel_pages_stay_within_the_budget(
        ops in proptest::collection::vec((0u64..3_000, 0u8..4, 0u8..8, 0u16..1000), 1..250),
        backing in any::<bool>(),
    ) {
        let cap = 4 << 20;
        let seg = Arc::new(Segment::create(0, reserved_bytes(cap).unwrap(), false, false).unwrap());
        let mut a = AllocatorActor::new(seg, cap, 1 << 20, true).with_backing(backing);
        let mut live: Vec<HostBlock> = Vec::new();
        for (size, who, op, pick) in ops {
            match op {
                // Mostly small and unaligned objects, some up to 768 KiB.
                0..=3 => {
                    let size = if size < 2_500 { size } else { (size - 2_400) * 1024 * 8 };
                    let writer = if who == 0 { Writer::Store } else { Writer::Client(HolderId::from_raw(who as u64)) };
                    if let Ok(b) = a.allocate(size, writer) {
                        let p = a.segments[&b.segment].segment.ptr(b.offset, b.charged).unwrap();
                        // Touch every page of the object, and its last byte.
                        for off in (0..b.charged).step_by(4096).chain([b.charged - 1]) {
                            unsafe { *p.add(off as usize) = 1 };
                        }
                        live.push(b);
                    }
                }
                4..=6 if !live.is_empty() => {
                    let b = live.swap_remove(pick as usize % live.len());
                    a.free(b);
                }
                _ => {
                    let gone = 1 + pick as u64 % 3;
                    a.owner_gone(HolderId::from_raw(gone));
                }
            }
            let kernel: u64 = a.segments.values().map(|s| s.segment.allocated_bytes()).sum();
            let u = a.usage();
            prop_assert!(kernel <= u.resident, "kernel {} > counted {}", kernel, u.resident);
            prop_assert!(u.resident <= cap + a.residency.slack, "resident {} over {}", u.resident, cap + a.residency.slack);
            if u.resident > cap {
                // Past the capacity only with no freed page left to give back.
                let freed: u64 = a.segments.values().map(|s| s.pages.freed.bytes()).sum();
                prop_assert_eq!(a.give_back(u64::MAX, u32::MAX), 0, "freed {}", freed);
            }
            let charged: u64 = live.iter().map(|b| b.charged).sum();
            prop_assert_eq!(u.used, charged);
        }
        for b in live.drain(..) {
            a.free(b);
        }
        for h in 1..4 {
            a.owner_gone(HolderId::from_raw(h));
        }
        a.give_back(u64::MAX, 0);
        let kernel: u64 = a.segments.values().map(|s| s.segment.allocated_bytes()).sum();
        prop_assert_eq!(kernel, 0, "pages left after everything was freed and given back");
        prop_assert_eq!(a.usage().resident, 0);
    }
}
