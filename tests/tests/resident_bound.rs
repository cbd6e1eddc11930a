//! `-m` bounds the memory the store holds, not only its objects' bytes (RELIABILITY.md): the
//! kernel's pages of the daemon's segments stay within `-m` + 64 pages while clients fill the
//! store past full, objects move between their arenas through eviction and deletion, and a
//! writer is killed. Checked two ways against a real daemon: the kernel's count read with the
//! daemon stopped (`vovp_tests::memfd`), often; and the daemon's own audit
//! (`VOVP_AUDIT_PAGES`), which after every allocator message finds each page the kernel holds
//! inside the pages it counts.

use std::process::Child;
use std::time::{Duration, Instant};

use vovp::Store;
use vovp_tests::{memfd, Daemon};

/// The allocator's `RESIDENT_SLACK_PAGES` of 4 KiB: partly used pages at objects' ends.
const SLACK: u64 = 64 * 4096;

#[test]
fn pages_stay_within_the_limit_while_objects_move_between_arenas() {
    const CAP: u64 = 32 << 20;
    let d = Daemon::start_audited("32M", &[]);
    let pid = d.child.id();
    let monitor = d.client();
    // Each writer replaces its own 12 names with objects of 1-4 MiB, 30 MiB each on average:
    // together about three times the store, so it evicts all the time.
    let hammer = |seed: &str, seconds: &str| {
        d.fixture_spawn(&["churn", "--seconds", seconds, "--seed", seed])
    };
    let mut writers: Vec<Child> = vec![hammer("1", "8"), hammer("2", "8"), hammer("3", "8")];
    let started = Instant::now();
    let (mut max, mut samples, mut killed) = (0u64, 0u64, false);
    while writers
        .iter_mut()
        .any(|c| c.try_wait().ok().flatten().is_none())
    {
        max = max.max(memfd::object_memfd_bytes(pid));
        samples += 1;
        if !killed && started.elapsed() > Duration::from_secs(3) {
            // A writer killed mid-run (whatever it was doing: writing a create, a lend, ...),
            // and another in its place.
            let _ = writers[0].kill();
            let _ = writers[0].wait();
            writers.push(hammer("4", "4"));
            killed = true;
        }
        std::thread::sleep(Duration::from_millis(2));
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "writers never ended"
        );
    }
    for w in writers.drain(1..) {
        let out = w.wait_with_output().expect("writer");
        assert!(
            out.status.success(),
            "writer failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    eprintln!(
        "segments peaked at {:+} KiB against -m ({samples} samples)",
        (max as i64 - CAP as i64) / 1024
    );
    let stats = monitor.stats().expect("stats");
    // The bound was tested: the store was full and evicted.
    assert!(stats.evicted_objects > 0, "never full: {stats:?}");
    assert!(
        max >= CAP / 2,
        "pages peaked at {max} bytes: the store never filled ({samples} samples)"
    );
    assert!(
        max <= CAP + SLACK,
        "the daemon's segments held {max} bytes, {} KiB past -m (bound {} KiB; {samples} samples)",
        (max - CAP) / 1024,
        SLACK / 1024
    );
    let log = d.log();
    assert!(
        !log.contains("uncounted pages"),
        "pages the accounting does not count:\n{log}"
    );
}
