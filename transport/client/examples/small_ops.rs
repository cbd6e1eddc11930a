//! Tight loop of small operations against a running daemon, for profiling the request path
//! (`perf record -p $(pidof vovp-engine)` while this runs). Not a benchmark: vovp-bench is.
//!
//!     cargo run --release -p vovp-client --example small_ops -- /tmp/vovp.sock 20000

use std::time::Instant;

use vovp_types::{CreateOptions, Store};

fn main() -> Result<(), vovp_types::Error> {
    let mut args = std::env::args().skip(1);
    let socket = args.next().unwrap_or_else(|| "/tmp/vovp.sock".into());
    let n: u32 = args.next().and_then(|s| s.parse().ok()).unwrap_or(20_000);
    let c = vovp_client::Client::connect(&socket)?;
    c.put("small-ops", &[1u8; 64], b"", CreateOptions::default())?;
    let time = |what: &str,
                f: &dyn Fn() -> Result<(), vovp_types::Error>|
     -> Result<(), vovp_types::Error> {
        let start = Instant::now();
        for _ in 0..n {
            f()?;
        }
        let us = start.elapsed().as_secs_f64() * 1e6 / n as f64;
        println!("{what}: {us:.1} µs/op");
        Ok(())
    };
    time("contains", &|| c.contains("small-ops").map(drop))?;
    time("get+release", &|| c.get_one("small-ops", None).map(drop))?;
    time("put+delete", &|| {
        c.put("small-ops-2", &[2u8; 64], b"", CreateOptions::default())?;
        c.delete("small-ops-2")
    })?;
    c.delete("small-ops")?;
    Ok(())
}
