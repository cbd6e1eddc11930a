//! Tight loop of small operations against a running daemon: the blocking client's small-op
//! costs (µs per op, the median of `rounds` timed rounds), and a loop to profile the request
//! path under (`perf record -p $(pidof vovp-engine)` while this runs). Not a benchmark
//! (vovp-bench is): a before/after check of the client's own overhead on one machine. One
//! row's own instructions: `SMALL_OPS_ROW=put valgrind --tool=callgrind` at two `n`, the
//! difference divided (a row that gets through the shared directory does not run under
//! valgrind: its vDSO clock read faults there).
//!
//!     cargo run --release -p vovp-client --example small_ops -- /tmp/vovp.sock 20000 5

use std::time::Instant;

use vovp_types::tensor::{DType, TensorView};
use vovp_types::{CreateOptions, Store};

fn main() -> Result<(), vovp_types::Error> {
    let mut args = std::env::args().skip(1);
    let socket = args.next().unwrap_or_else(|| "/tmp/vovp.sock".into());
    let n: u32 = args.next().and_then(|s| s.parse().ok()).unwrap_or(20_000);
    let rounds: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(5);
    // SMALL_OPS_ROW: run only the row whose name starts with it (see the module doc).
    let only = std::env::var("SMALL_OPS_ROW").ok();
    let c = vovp_client::Client::connect(&socket)?;
    c.put("small-ops", &[1u8; 64], b"", CreateOptions::default())?;
    c.sync()?;
    let time = |what: &str,
                f: &mut dyn FnMut(u32) -> Result<(), vovp_types::Error>|
     -> Result<(), vovp_types::Error> {
        if only.as_deref().is_some_and(|o| !what.starts_with(o)) {
            return Ok(());
        }
        let mut per_round = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            let start = Instant::now();
            for i in 0..n {
                f(i)?;
            }
            per_round.push(start.elapsed().as_secs_f64() * 1e6 / n as f64);
            c.sync()?;
        }
        per_round.sort_by(f64::total_cmp);
        let median = per_round[per_round.len() / 2];
        let (lo, hi) = (per_round[0], per_round[per_round.len() - 1]);
        println!("{what:<28} {median:7.2} µs/op  ({lo:.2}-{hi:.2})");
        Ok(())
    };
    let data = [2u8; 64];
    let shape = [16i64];
    let tensor = TensorView::new(DType::F32, &shape, &data)?;
    let opts = CreateOptions {
        replace: true,
        ..Default::default()
    };
    // Names cycled through, so that no put waits for this client's unanswered put of the
    // same name (a pipelined put of a name whose put is owed goes the waiting way).
    let names: Vec<String> = (0..4096).map(|i| format!("small-ops-n{i}")).collect();
    let name = |i: u32| names[i as usize % names.len()].as_str();
    time("contains", &mut |_| c.contains("small-ops").map(drop))?;
    time("get_one+release", &mut |_| {
        c.get_one("small-ops", None).map(drop)
    })?;
    time("put 64 B (replace)", &mut |i| {
        c.put(name(i), &data, b"", opts)
    })?;
    time("put_tensor 64 B (replace)", &mut |i| {
        c.put(name(i), tensor.data, &tensor.meta().encode(), opts)
    })?;
    time("put_and_view 64 B (replace)", &mut |i| {
        c.put_and_view(name(i), &data, b"", opts).map(drop)
    })?;
    time("put_view_later 64 B", &mut |i| {
        match c.put_view_later(name(i), &data, b"", opts)? {
            Some(v) => drop(v),
            None => drop(c.put_and_view(name(i), &data, b"", opts)?),
        }
        Ok(())
    })?;
    time("put+delete 64 B", &mut |_| {
        c.put("small-ops-2", &data, b"", CreateOptions::default())?;
        c.delete("small-ops-2")
    })?;
    c.delete("small-ops")?;
    Ok(())
}
