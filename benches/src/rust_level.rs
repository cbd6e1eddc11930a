//! Rust-level workloads: the Rust client (over the daemon's socket) and the embedded engine,
//! against the machine's limits measured in the same repetitions ([`crate::limits`]).
//!
//! Repetitions interleave limit and stores (socket echo, client, engine; the order rotates each
//! repetition) so a slow patch of the machine hits all of them alike.

use std::time::Instant;

use vovp::{CreateOptions, Store};

use crate::limits::{
    allowed_cpus, copy_gbps, pinned_rtt_us, split_copy_gbps, ProcessEcho, SharedMapping, SocketEcho,
};
use crate::report::{Limit, Report, Row};
use crate::{pattern, same_bytes, size_label, SourceBuf, KIB, MIB};

/// How much each workload repeats.
#[derive(Debug, Clone)]
pub struct RustConfig {
    /// Objects per small-op batch (one sample = the mean over a batch).
    pub small_ops: usize,
    pub small_reps: usize,
    /// (object size, puts) for the large-object workload.
    pub large: Vec<(u64, usize)>,
    /// Timed gets after each large put.
    pub get_reps: usize,
}

impl RustConfig {
    pub fn quick() -> Self {
        RustConfig {
            small_ops: 2000,
            small_reps: 5,
            large: vec![(KIB, 20), (MIB, 20), (16 * MIB, 10), (256 * MIB, 5)],
            get_reps: 20,
        }
    }

    pub fn full() -> Self {
        RustConfig {
            small_ops: 5000,
            small_reps: 21,
            large: vec![
                (KIB, 50),
                (MIB, 50),
                (16 * MIB, 30),
                (256 * MIB, 15),
                (crate::GIB, 9),
            ],
            get_reps: 50,
        }
    }
}

type Res<T> = Result<T, String>;

fn err(what: &str) -> impl Fn(vovp::Error) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// Mean µs per op of put, contains, get+release and delete over `names`.
pub fn small_batch(store: &dyn Store, names: &[String], data: &[u8]) -> Res<[f64; 4]> {
    let per_op = |t: Instant| t.elapsed().as_secs_f64() * 1e6 / names.len() as f64;
    let opts = CreateOptions::default();
    let t = Instant::now();
    for n in names {
        store.put(n, data, &[], opts).map_err(err("put"))?;
    }
    let put = per_op(t);
    let t = Instant::now();
    for n in names {
        if !store.contains(n).map_err(err("contains"))? {
            return Err(format!("contains({n}) is false right after its put"));
        }
    }
    let contains = per_op(t);
    let t = Instant::now();
    for n in names {
        let view = store.get_one(n, None).map_err(err("get"))?;
        if view[0] != data[0] {
            return Err(format!("{n}: wrong first byte read back"));
        }
        // Dropping the view releases the reference (a RELEASE frame for the client).
    }
    let get = per_op(t);
    let t = Instant::now();
    for n in names {
        store.delete(n).map_err(err("delete"))?;
    }
    let delete = per_op(t);
    Ok([put, contains, get, delete])
}

/// The stores under test: the Rust socket client and the embedded engine.
pub struct Stores<'a> {
    pub client: &'a dyn Store,
    pub engine: &'a dyn Store,
}

impl Stores<'_> {
    fn each(&self) -> [(&'static str, &dyn Store); 2] {
        [("client", self.client), ("engine", self.engine)]
    }
}

fn label(which: &str) -> &'static str {
    match which {
        "client" => "Rust client",
        _ => "embedded Engine",
    }
}

/// Small objects: per-op latency of the Rust client and the engine, and the socket round trip.
pub fn small_ops(cfg: &RustConfig, stores: &Stores<'_>, report: &mut Report) -> Res<()> {
    let mut echo = SocketEcho::start().map_err(|e| format!("socket echo: {e}"))?;
    let mut proc_echo = ProcessEcho::start().map_err(|e| format!("process echo: {e}"))?;
    let names: Vec<String> = (0..cfg.small_ops)
        .map(|i| format!("rs-small-{i}"))
        .collect();
    let data = pattern(64, 11);
    let mut rtt = Vec::new();
    let mut proc_rtt = Vec::new();
    // Round trips with both ends pinned on one CPU and on two different CPUs: the two
    // placements the scheduler chooses between for a client and its daemon.
    let cpus = allowed_cpus();
    let placements: Vec<(&str, usize, usize)> = match cpus.as_slice() {
        [] => vec![],
        [one] => vec![("same", *one, *one)],
        [a, b, ..] => vec![("same", *a, *a), ("cross", *a, *b)],
    };
    let mut pinned: Vec<Vec<f64>> = vec![Vec::new(); placements.len()];
    // [store][op] -> samples
    let mut samples = vec![vec![Vec::new(); 4]; 2];
    // Repetition -1 warms up connections, caches and the echo thread; it is not recorded.
    for rep in -1..cfg.small_reps as i64 {
        let mut order: Vec<usize> = vec![0, 1, 2];
        order.rotate_left(rep.rem_euclid(3) as usize);
        for step in order {
            if step == 2 {
                let us = echo
                    .batch_us(cfg.small_ops)
                    .map_err(|e| format!("socket echo: {e}"))?;
                let proc_us = proc_echo
                    .batch_us(cfg.small_ops)
                    .map_err(|e| format!("process echo: {e}"))?;
                if rep >= 0 {
                    proc_rtt.push(proc_us);
                }
                for (i, &(_, a, b)) in placements.iter().enumerate() {
                    let us = pinned_rtt_us(a, b, cfg.small_ops / 2)
                        .map_err(|e| format!("pinned socket echo: {e}"))?;
                    if rep >= 0 {
                        pinned[i].push(us);
                    }
                }
                if rep >= 0 {
                    rtt.push(us);
                }
                continue;
            }
            let (which, store) = stores.each()[step];
            let ops = small_batch(store, &names, &data).map_err(|e| format!("{which}: {e}"))?;
            if rep >= 0 {
                for (s, v) in samples[step].iter_mut().zip(ops) {
                    s.push(v);
                }
            }
        }
    }
    report.limits.push(Limit {
        key: "limit.socket_rtt".into(),
        name:
            "Unix-socket round trip, 64 B echo over a socketpair (placement left to the scheduler)"
                .into(),
        unit: "µs".into(),
        size: None,
        samples: rtt.clone(),
    });
    report.limits.push(Limit {
        key: "limit.socket_rtt.process".into(),
        name: "Unix-socket round trip to another process (64 B echo, forked child)".into(),
        unit: "µs".into(),
        size: None,
        samples: proc_rtt.clone(),
    });
    for ((which, a, b), samples) in placements.iter().zip(pinned) {
        report.limits.push(Limit {
            key: format!("limit.socket_rtt.{which}_cpu"),
            name: format!("Unix-socket round trip, ends pinned to CPUs {a} and {b}"),
            unit: "µs".into(),
            size: None,
            samples,
        });
    }
    for (i, (which, _)) in stores.each().iter().enumerate() {
        for (j, (op, what)) in [
            ("put", "put 64 B"),
            ("contains", "contains"),
            ("get", "get+release 64 B"),
            ("delete", "delete"),
        ]
        .iter()
        .enumerate()
        {
            report.rows.push(Row {
                key: format!("rust.{which}.{op}.64"),
                group: "Rust: small objects (per op)".into(),
                name: format!("{} {what}", label(which)),
                unit: "µs".into(),
                higher_is_better: false,
                size: Some(64),
                vovp: samples[i][j].clone(),
                base_label: "socket round trip".into(),
                base: rtt.clone(),
            });
        }
    }
    Ok(())
}

/// Large objects: put throughput against the parallel memcpy bandwidth into a warm shared
/// mapping of the same size, and get latency, for the Rust client and the engine.
pub fn large_objects(cfg: &RustConfig, stores: &Stores<'_>, report: &mut Report) -> Res<()> {
    let rtt = report
        .limit("limit.socket_rtt")
        .map(|l| l.samples.clone())
        .unwrap_or_default();
    let max = cfg.large.iter().map(|l| l.0).max().unwrap_or(0) as usize;
    let src = SourceBuf::new(max, 13).map_err(|e| format!("source buffer: {e}"))?;
    let opts = CreateOptions::default();
    for &(size, reps) in &cfg.large {
        let data = &src[..size as usize];
        let mut memcpy = Vec::new();
        let mut split = Vec::new();
        let threads = allowed_cpus().len().max(1);
        let mut put = [Vec::new(), Vec::new()];
        let mut get = [Vec::new(), Vec::new()];
        let mut intact = [true, true];
        let mut mapping =
            SharedMapping::new(size as usize).map_err(|e| format!("memfd mapping: {e}"))?;
        // The mapping is warmed by the first (discarded) copy, like the stores' memory by the
        // discarded first put: both then run on resident pages.
        for rep in -1..reps as i64 {
            // Below 16 MiB thread starts would dominate the split copy: skip it there.
            let mut order: Vec<usize> = if size >= 16 * MIB {
                vec![0, 1, 2, 3]
            } else {
                vec![0, 1, 2]
            };
            let n = order.len();
            order.rotate_left(rep.rem_euclid(n as i64) as usize);
            for step in order {
                if step >= 2 {
                    let dst = mapping.as_mut_slice();
                    let (gbps, into) = if step == 2 {
                        (copy_gbps(dst, data), &mut memcpy)
                    } else {
                        (split_copy_gbps(dst, data, threads), &mut split)
                    };
                    if rep >= 0 {
                        into.push(gbps);
                    }
                    continue;
                }
                let (which, store) = stores.each()[step];
                let name = format!("rs-large-{size}-{rep}");
                let t = Instant::now();
                store
                    .put(&name, data, &[], opts)
                    .map_err(|e| format!("{which}: put {}: {e}", size_label(size)))?;
                let secs = t.elapsed().as_secs_f64();
                {
                    let view = store
                        .get_one(&name, None)
                        .map_err(|e| format!("{which}: get: {e}"))?;
                    intact[step] &= same_bytes(&view, data);
                }
                let mut lat = Vec::with_capacity(cfg.get_reps);
                for _ in 0..cfg.get_reps {
                    let t = Instant::now();
                    let view = store
                        .get_one(&name, None)
                        .map_err(|e| format!("{which}: get: {e}"))?;
                    std::hint::black_box(view[0]);
                    drop(view);
                    lat.push(t.elapsed().as_secs_f64() * 1e6);
                }
                store
                    .delete(&name)
                    .map_err(|e| format!("{which}: delete: {e}"))?;
                if rep >= 0 {
                    put[step].push(size as f64 / secs / 1e9);
                    get[step].extend(lat);
                }
            }
        }
        drop(mapping);
        let sl = size_label(size);
        report.limits.push(Limit {
            key: format!("limit.memcpy.{size}"),
            name: format!("vovp::parallel_copy into a warm shared mapping, {sl}"),
            unit: "GB/s".into(),
            size: Some(size),
            samples: memcpy.clone(),
        });
        if !split.is_empty() {
            report.limits.push(Limit {
                key: format!("limit.memcpy_split.{size}"),
                name: format!(
                    "memcpy, one contiguous part per CPU, into a warm shared mapping, {sl}"
                ),
                unit: "GB/s".into(),
                size: Some(size),
                samples: split,
            });
        }
        for (i, (which, _)) in stores.each().iter().enumerate() {
            report.check(
                format!("{}: {sl} objects read back intact", label(which)),
                intact[i],
                "",
            );
            if size >= MIB {
                report.rows.push(Row {
                    key: format!("rust.{which}.put.{size}"),
                    group: "Rust: large objects".into(),
                    name: format!("{} put {sl}", label(which)),
                    unit: "GB/s".into(),
                    higher_is_better: true,
                    size: Some(size),
                    vovp: put[i].clone(),
                    base_label: "parallel memcpy".into(),
                    base: memcpy.clone(),
                });
            }
            report.rows.push(Row {
                key: format!("rust.{which}.get.{size}"),
                group: "Rust: large objects".into(),
                name: format!("{} get+release latency {sl}", label(which)),
                unit: "µs".into(),
                higher_is_better: false,
                size: Some(size),
                vovp: get[i].clone(),
                base_label: "socket round trip".into(),
                base: rtt.clone(),
            });
        }
        eprintln!("vovp-bench: Rust large objects: {sl} done");
    }
    Ok(())
}
