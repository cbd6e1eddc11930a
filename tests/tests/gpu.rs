//! CUDA objects through the real daemon, across processes.
//!
//! * Everywhere: the CUDA subcommands of the test fixture fail cleanly (`vovp-fixture: <message>`, exit 1)
//!   on missing names, host objects and, without a driver, with the daemon's GpuUnavailable.
//! * With `VOVP_GPU_TESTS=1` (a machine with an NVIDIA GPU: `bash gpu/check.sh`; or the fake
//!   driver: `scripts/gpu-fake-test.sh`): process A (this test, `vovp_client::Client`) and
//!   processes B (the `vovp-fixture` binary) share one device allocation; references are released when B
//!   exits or dies; eviction of device objects is least-recently-used and never touches
//!   referenced ones; a big device put is timed against the raw device-to-device copy.
//!
//! This process writes and reads device memory with raw driver calls (`vovp_tests::cuda`), as a
//! framework such as PyTorch would with the pointers the client hands out.

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use vovp::{CreateOptions, DType, Device, Error, Location, Store};
use vovp_tests::{cuda, gpu_tests_enabled, read_line, wait_until, Daemon};

const MIB: u64 = 1 << 20;
const T: Duration = Duration::from_secs(20);

/// GPU tests run one at a time: each reserves device memory and one measures bandwidth.
static GPU: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    GPU.lock().unwrap_or_else(|e| e.into_inner())
}

fn cuda0() -> CreateOptions {
    CreateOptions {
        device: Some(Device::Cuda(0)),
        ..Default::default()
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 24) as u8 ^ seed.wrapping_mul(0x3b))
        .collect()
}

/// What `vovp-fixture get-cuda` prints for these bytes.
fn summary(b: &[u8]) -> String {
    let show = |x: Option<&u8>| x.map_or_else(|| "none".to_string(), u8::to_string);
    format!(
        "len={} first={} last={} sum={}",
        b.len(),
        show(b.first()),
        show(b.last()),
        b.iter().map(|&x| u64::from(x)).sum::<u64>()
    )
}

/// `summary` of `len` bytes all equal to `fill`, without building them.
fn fill_summary(len: u64, fill: u8) -> String {
    if len == 0 {
        return summary(&[]);
    }
    format!(
        "len={len} first={fill} last={fill} sum={}",
        len * u64::from(fill)
    )
}

/// Runs the test fixture, asserts success, returns its trimmed stdout.
fn fixture_ok(d: &Daemon, args: &[&str]) -> String {
    let out = d.fixture(args);
    assert!(
        out.status.success(),
        "vovp-fixture {args:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Runs the test fixture, asserts a clean failure (exit 1, one `vovp-fixture: ` message, no
/// panic); returns stderr.
fn fixture_fails(d: &Daemon, args: &[&str]) -> String {
    let out = d.fixture(args);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(
        out.status.code(),
        Some(1),
        "vovp-fixture {args:?}: expected exit 1, got {}; stderr: {err}",
        out.status
    );
    assert!(
        err.starts_with("vovp-fixture: "),
        "vovp-fixture {args:?}: stderr {err:?}"
    );
    assert!(
        !err.contains("panicked"),
        "vovp-fixture {args:?} panicked: {err}"
    );
    assert!(
        out.stdout.is_empty(),
        "vovp-fixture {args:?} printed on failure"
    );
    err
}

/// `key=value` from a CLI line such as `bytes=1 seconds=2 gbps=3`.
fn field(line: &str, key: &str) -> f64 {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
}

// ---------------------------------------------------------------------------------------------
// Runs everywhere.

#[test]
fn cuda_cli_fails_cleanly_on_missing_host_and_gpu_less_objects() {
    let d = Daemon::start("8M");
    let c = d.client();
    c.put("host-object", b"abc", b"", CreateOptions::default())
        .unwrap();

    let err = fixture_fails(&d, &["get-cuda", "missing"]);
    assert!(err.contains("not found"), "{err}");
    let err = fixture_fails(&d, &["get-cuda", "missing", "--timeout-ms", "50"]);
    assert!(err.contains("not found"), "{err}");
    let err = fixture_fails(&d, &["hold-cuda", "missing"]);
    assert!(err.contains("not found"), "{err}");
    let err = fixture_fails(&d, &["put-cuda-d2d", "copy", "missing"]);
    assert!(err.contains("not found"), "{err}");
    let err = fixture_fails(&d, &["get-cuda", "host-object"]);
    assert!(err.contains("not a CUDA object"), "{err}");
    let err = fixture_fails(&d, &["put-cuda-d2d", "copy", "host-object"]);
    assert!(err.contains("not a CUDA object"), "{err}");
    let err = fixture_fails(&d, &["cuda-bandwidth", "--bytes", "0"]);
    assert!(err.contains("at least 1"), "{err}");

    match c.create("probe", 4096, b"", cuda0()) {
        Err(Error::GpuUnavailable(reason)) => {
            assert!(!reason.is_empty());
            // The CLI reports the daemon's reason and leaves nothing behind.
            for args in [
                &["put-cuda", "t", "--bytes", "1M", "--fill", "7"][..],
                &["put-cuda", "t", "--bytes", "4096", "--fill", "7", "--device", "3"],
                &["cuda-bandwidth", "--bytes", "1M"],
            ] {
                let err = fixture_fails(&d, args);
                assert!(err.contains("GPU unavailable"), "vovp-fixture {args:?}: {err}");
            }
            println!("without a GPU: {reason}");
        }
        Ok(_) => println!(
            "a CUDA driver is present: the GpuUnavailable half is skipped (GPU tests: VOVP_GPU_TESTS=1)"
        ),
        Err(other) => panic!("expected GpuUnavailable, got {other:?}"),
    }
    assert!(!c.contains("t").unwrap() && !c.contains("probe").unwrap());
    // The daemon keeps serving, and nothing is held.
    assert_eq!(&c.get_one("host-object", None).unwrap()[..], b"abc");
    wait_until(T, || c.stats().unwrap().references == 0);
}

// ---------------------------------------------------------------------------------------------
// VOVP_GPU_TESTS=1.

#[test]
fn gpu_object_is_one_allocation_shared_across_processes_and_released() {
    if !gpu_tests_enabled("gpu_object_is_one_allocation_shared_across_processes_and_released") {
        return;
    }
    let _serial = serial();
    let d = Daemon::start_with("64M", &["--gpu-memory", "0:256M"]);
    let c = d.client();
    let n = 4 * MIB as usize + 123;
    let (p1, p2) = (pattern(1, n), pattern(2, n));
    assert_ne!(summary(&p1), summary(&p2));

    // A creates a device object and fills it with pattern 1 through its own pointer.
    let mut buf = c
        .create("shared", n as u64, b"", cuda0())
        .expect("CUDA create");
    assert!(buf.as_mut_slice().is_empty(), "no host bytes");
    let Location::Cuda(block) = buf.location() else {
        panic!("a CUDA create came back as {:?}", buf.location());
    };
    assert_eq!((block.device, block.size), (0, n as u64));
    assert_eq!(block.offset % 256, 0);
    let ptr = buf.cuda_ptr().expect("device pointer");
    cuda::h2d(ptr, &p1).expect("A writes pattern 1");
    let view = buf.seal().expect("seal");
    assert_eq!(
        view.cuda_ptr(),
        Some(ptr),
        "the sealed view keeps A's pointer"
    );

    // B, another process, reads pattern 1.
    assert_eq!(fixture_ok(&d, &["get-cuda", "shared"]), summary(&p1));

    // B' gets the object and holds its view, reporting what it sees on request.
    let mut holder = d.fixture_interactive(&["hold-cuda", "shared", "--report"]);
    assert_eq!(holder.line(), "holding");
    assert_eq!(holder.ask("read"), summary(&p1));
    assert_eq!(c.stats().unwrap().references, 2, "A's view and B's");

    // A writes pattern 2 through its pointer after B's get: B's view sees it (one allocation,
    // nothing copied at get), and so does a fresh get in a third process.
    cuda::h2d(ptr, &p2).expect("A writes pattern 2");
    assert_eq!(holder.ask("read"), summary(&p2));
    assert_eq!(fixture_ok(&d, &["get-cuda", "shared"]), summary(&p2));
    let mut back = vec![0u8; n];
    cuda::d2h(&mut back, ptr).expect("A reads back");
    assert!(back == p2);

    // B exits: its reference goes; then A's.
    let (status, err) = holder.finish();
    assert!(status.success(), "hold-cuda: {status} {err}");
    wait_until(T, || c.stats().unwrap().references == 1);
    drop(view);
    wait_until(T, || c.stats().unwrap().references == 0);

    // A killed holder releases too.
    let mut killed = d.fixture_spawn(&["hold-cuda", "shared"]);
    assert_eq!(read_line(&mut killed), "holding");
    assert_eq!(c.stats().unwrap().references, 1);
    killed.kill().unwrap();
    let _ = killed.wait();
    wait_until(T, || c.stats().unwrap().references == 0);

    // Deleting frees the device block: the whole pool fits again.
    c.delete("shared").unwrap();
    let whole = c
        .create("whole-pool", 256 * MIB, b"", cuda0())
        .expect("the whole pool after the delete");
    drop(whole);
    wait_until(T, || c.stats().unwrap().objects == 0);

    // The CLI's own put: written through B's mapping, read by A through its mapping.
    fixture_ok(
        &d,
        &["put-cuda", "from-cli", "--bytes", "1M", "--fill", "201"],
    );
    let v = c.get_one("from-cli", None).unwrap();
    let t = vovp::Tensor::from_view(v).expect("put-cuda stores a uint8 tensor");
    assert_eq!((t.dtype(), t.shape()), (DType::U8, &[MIB as i64][..]));
    let mut got = vec![0u8; MIB as usize];
    cuda::d2h(&mut got, t.cuda_ptr().expect("device pointer")).unwrap();
    assert!(got.iter().all(|&b| b == 201));
}

#[test]
fn gpu_eviction_is_lru_and_spares_referenced_objects() {
    if !gpu_tests_enabled("gpu_eviction_is_lru_and_spares_referenced_objects") {
        return;
    }
    let _serial = serial();
    const POOL: u64 = 256 * MIB;
    const S: u64 = 32 * MIB;
    let d = Daemon::start_with("64M", &["--gpu-memory", "0:256M"]);
    let c = d.client();

    // A pins one object (first in the pool) by holding its view.
    let pinned_bytes = pattern(3, S as usize);
    let buf = c.create("pinned", S, b"", cuda0()).expect("create");
    let pinned_ptr = buf.cuda_ptr().expect("device pointer");
    cuda::h2d(pinned_ptr, &pinned_bytes).unwrap();
    let pinned = buf.seal().unwrap();

    // Other processes fill the rest with sealed objects nobody holds.
    for i in 0..7u8 {
        let fill = (10 + i).to_string();
        fixture_ok(
            &d,
            &[
                "put-cuda",
                &format!("e{i}"),
                "--bytes",
                "32M",
                "--fill",
                &fill,
            ],
        );
    }
    let s = c.stats().unwrap();
    assert_eq!(
        (s.evicted_objects, s.objects, s.references),
        (0, 8, 1),
        "8 x 32 MiB fill the 256 MiB pool without eviction: {s:?}"
    );

    // e0 is used again (a get and its release), so e1 becomes the least recently used.
    assert_eq!(fixture_ok(&d, &["get-cuda", "e0"]), fill_summary(S, 10));
    fixture_ok(&d, &["put-cuda", "extra", "--bytes", "32M", "--fill", "99"]);
    let present = |n: &str| c.contains(n).unwrap();
    assert!(!present("e1"), "the least recently used object is evicted");
    for n in ["pinned", "e0", "e2", "e3", "e4", "e5", "e6", "extra"] {
        assert!(present(n), "{n} must survive");
    }
    assert_eq!(c.stats().unwrap().evicted_objects, 1);

    // A create that needs every unreferenced byte evicts all of those, never the pinned one.
    let big = c
        .create("big", POOL - S, b"", cuda0())
        .expect("room made by evicting every unreferenced object");
    for n in ["e0", "e2", "e3", "e4", "e5", "e6", "extra"] {
        assert!(!present(n), "{n} should have been evicted");
    }
    assert!(present("pinned"));
    assert_eq!(c.stats().unwrap().evicted_objects, 8);
    let mut back = vec![0u8; S as usize];
    cuda::d2h(&mut back, pinned_ptr).unwrap();
    assert!(back == pinned_bytes, "the pinned object's bytes are intact");
    assert_eq!(
        fixture_ok(&d, &["get-cuda", "pinned"]),
        summary(&pinned_bytes)
    );

    // Everything is referenced (A's view, A's unsealed buffer): no room, a typed error.
    match c.create("no-room", S, b"", cuda0()) {
        Err(Error::OutOfMemory { requested, .. }) => assert_eq!(requested, S),
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    let err = fixture_fails(
        &d,
        &["put-cuda", "no-room", "--bytes", "32M", "--fill", "1"],
    );
    assert!(err.contains("out of memory"), "{err}");

    // Bigger than the pool: OutOfMemory (not a driver error), whatever is free.
    drop(big);
    fixture_ok(
        &d,
        &["put-cuda", "bystander", "--bytes", "1M", "--fill", "5"],
    );
    match c.create("too-big", 2 * POOL, b"", cuda0()) {
        Err(Error::OutOfMemory { requested, .. }) => assert_eq!(requested, 2 * POOL),
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    // A hopeless create evicts nothing.
    assert!(
        present("bystander"),
        "a create bigger than the pool must not evict"
    );
    let err = fixture_fails(&d, &["put-cuda", "too-big", "--bytes", "1G", "--fill", "1"]);
    assert!(err.contains("out of memory"), "{err}");
    assert!(present("pinned"));
    drop(pinned);
    wait_until(T, || c.stats().unwrap().references == 0);
}

#[test]
fn gpu_big_put_against_raw_device_copy_bandwidth() {
    if !gpu_tests_enabled("gpu_big_put_against_raw_device_copy_bandwidth") {
        return;
    }
    let _serial = serial();
    let fake = cuda::is_fake();
    let bytes = match std::env::var("VOVP_GPU_BIG_BYTES") {
        Ok(v) => vovp::parse_size(&v).expect("VOVP_GPU_BIG_BYTES is a size such as 1G"),
        Err(_) if fake => 128 * MIB,
        Err(_) => 1 << 30,
    };
    // Room for the source, the copy and cuda-bandwidth's two scratch objects.
    let pool = format!("0:{}", 4 * bytes + 64 * MIB);
    let d = Daemon::start_with("64M", &["--gpu-memory", &pool]);
    let c = d.client();
    let size = bytes.to_string();

    fixture_ok(
        &d,
        &["put-cuda", "big-src", "--bytes", &size, "--fill", "7"],
    );
    // A holds the source (never evicted while held).
    let src = c.get_one("big-src", None).unwrap();

    let raw = fixture_ok(&d, &["cuda-bandwidth", "--bytes", &size]);
    let put = fixture_ok(&d, &["put-cuda-d2d", "big-dst", "big-src"]);
    let (raw_gbps, put_gbps) = (field(&raw, "gbps"), field(&put, "gbps"));
    assert_eq!(field(&put, "bytes"), bytes as f64);
    println!(
        "{} MiB device put (put_cuda_tensor: create + device-to-device copy + seal, in another \
         process): {put_gbps:.1} GB/s; raw copy_d2d between two store objects: {raw_gbps:.1} GB/s; \
         put/raw = {:.2}{}",
        bytes / MIB,
        put_gbps / raw_gbps,
        if fake {
            " (FAKE driver: host memcpy, the numbers say nothing about GPUs)"
        } else {
            ""
        }
    );

    // Correct bytes, and the copy is a uint8 tensor on cuda:0.
    assert_eq!(
        fixture_ok(&d, &["get-cuda", "big-dst"]),
        fill_summary(bytes, 7)
    );
    let t = c.get_tensor("big-dst", None).unwrap();
    assert_eq!((t.dtype(), t.shape()), (DType::U8, &[bytes as i64][..]));
    let dst_ptr = t.cuda_ptr().expect("device pointer");
    let sample = MIB.min(bytes);
    for at in [0, bytes / 2 - sample / 2, bytes - sample] {
        let mut got = vec![0u8; sample as usize];
        cuda::d2h(&mut got, dst_ptr + at).unwrap();
        assert!(got.iter().all(|&b| b == 7), "big-dst differs near {at}");
    }
    assert_ne!(src.cuda_ptr(), t.cuda_ptr(), "a copy, not an alias");
    drop((src, t));
    wait_until(T, || c.stats().unwrap().references == 0);
    // cuda-bandwidth's scratch objects are gone with it.
    let names: Vec<String> = c
        .list()
        .unwrap()
        .into_iter()
        .map(|i| i.name.to_string())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
}
