//! criterion micro-benchmarks of the engine's hot paths:
//!
//! * the allocator alone (`SegmentAllocator`: TLSF-style offset allocation, no actor), empty and
//!   with 10,000 live blocks of mixed sizes;
//! * one actor round trip: `contains` on an embedded `EngineHandle` (the cheapest message);
//! * a sealed object's get+release, which the shared directory serves with no message;
//! * the embedded life cycle of a small object: create + write + seal + get + release, 64 B.
//!
//!     cargo bench -p vovp-bench --bench engine

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use vovp::{Config, CreateOptions, Engine, Store};
use vovp_actors::SegmentAllocator;

const MIB: u64 = 1 << 20;

fn allocator(c: &mut Criterion) {
    let mut g = c.benchmark_group("allocator");
    for (label, size) in [("64B", 64u64), ("1MiB", MIB)] {
        let mut a = SegmentAllocator::new(1 << 30);
        g.bench_function(format!("allocate+free {label}, empty"), |b| {
            b.iter(|| {
                let (_, reserved, alloc) = a.allocate(black_box(size)).expect("fits");
                a.free(alloc, reserved);
            })
        });
    }
    // A store in use: many live blocks of mixed sizes, so the free lists are not trivial.
    let mut a = SegmentAllocator::new(1 << 30);
    let mut x = 12345u64;
    let mut live = Vec::new();
    for _ in 0..10_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let size = 64 + x % (64 * 1024);
        live.push(a.allocate(size).expect("fits"));
    }
    // Free every other block to leave holes.
    for (i, (_, reserved, alloc)) in live.into_iter().enumerate() {
        if i % 2 == 0 {
            a.free(alloc, reserved);
        }
    }
    g.bench_function("allocate+free 4KiB, 5000 live blocks", |b| {
        b.iter(|| {
            let (_, reserved, alloc) = a.allocate(black_box(4096)).expect("fits");
            a.free(alloc, reserved);
        })
    });
    g.finish();
}

fn engine(c: &mut Criterion) {
    let h = Engine::spawn(Config::with_capacity(256 * MIB)).expect("engine");
    let mut g = c.benchmark_group("engine");
    h.put("present", b"x", &[], CreateOptions::default())
        .expect("put");
    g.bench_function("contains (one actor round trip)", |b| {
        b.iter(|| black_box(h.contains(black_box("present")).expect("contains")))
    });
    // A sealed object's get+release: the shared directory and a hold, no actor message.
    g.bench_function("get+release 64B (shared directory)", |b| {
        b.iter(|| {
            let got = h.get_one(black_box("present"), None).expect("get");
            black_box(got[0]);
        })
    });
    // Ephemeral, so dropping the last view deletes the object and the same name can be created
    // again in the next iteration (the release is queued ahead of the next create).
    let opts = CreateOptions {
        ephemeral: true,
        ..Default::default()
    };
    let data = [7u8; 64];
    g.bench_function("create+seal+get+release 64B", |b| {
        b.iter(|| {
            let mut buf = h.create("obj", 64, &[], opts).expect("create");
            buf.as_mut_slice().copy_from_slice(&data);
            let sealed = buf.seal().expect("seal");
            let got = h.get_one("obj", None).expect("get");
            black_box(got[0]);
            drop(got);
            drop(sealed);
        })
    });
    g.bench_function("put 64B inline + delete", |b| {
        b.iter_batched(
            || (),
            |()| {
                h.put("p", &data, &[], CreateOptions::default())
                    .expect("put");
                h.delete("p").expect("delete");
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
    h.shutdown();
}

criterion_group!(benches, allocator, engine);
criterion_main!(benches);
