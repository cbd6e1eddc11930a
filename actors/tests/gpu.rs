//! Tests of the GPU actor over the GPU crate (`vovp-gpu`).
//!
//! * Everywhere: nothing panics, and without a driver every entry point answers
//!   `GpuUnavailable(reason)`.
//! * With `VOVP_GPU_TESTS=1` on a machine with an NVIDIA GPU (see `gpu/check.sh`): pools,
//!   out-of-memory, CUDA IPC into a child process, and 1 GiB device-to-device copy bandwidth.
//!
//! The child process is this test binary again, run with `--exact child_process_entry` and the
//! blocks to open in `VOVP_GPU_CHILD` (a process cannot open its own CUDA IPC handles).

use std::process::Command;
use std::time::Instant;

use kameo::actor::{ActorRef, Spawn};
use kameo::error::SendError;
use vovp_actors::gpu::{AllocateDevice, BlockPtr, FreeDevice, GpuActor, GpuUsage};
use vovp_gpu::{cuda_available, ipc, probe, DeviceBlock, GpuError};
use vovp_gpu_pool::{GpuConfig, BLOCK_ALIGN, DEFAULT_FREE_FRACTION_PERCENT};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;
/// The test pattern repeats with this period, so any range can be checked without 1 GiB of host
/// memory.
const PERIOD: usize = 16 << 20;

/// GPU tests run one at a time: they measure bandwidth and each reserves its own pool.
/// (An async mutex: the guard is held across awaits; each test has its own runtime, which this
/// mutex does not mind.)
static GPU_LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn gpu_tests_enabled(test: &str) -> bool {
    let on = std::env::var("VOVP_GPU_TESTS").is_ok_and(|v| v == "1");
    if !on {
        println!("{test}: skipped (set VOVP_GPU_TESTS=1 on a machine with an NVIDIA GPU)");
    }
    on
}

fn pattern(i: usize) -> u8 {
    let i = (i % PERIOD) as u32;
    (i.wrapping_mul(2_654_435_761) >> 24) as u8 ^ (i >> 8) as u8
}

fn pattern_range(start: usize, len: usize) -> Vec<u8> {
    (start..start + len).map(pattern).collect()
}

async fn ask_alloc(
    gpu: &ActorRef<GpuActor>,
    device: u32,
    size: u64,
) -> Result<DeviceBlock, GpuError> {
    match gpu.ask(AllocateDevice { device, size }).await {
        Ok(b) => Ok(b),
        Err(SendError::HandlerError(e)) => Err(e),
        Err(e) => panic!("the GPU actor is gone: {e:?}"),
    }
}

async fn ask_ptr(gpu: &ActorRef<GpuActor>, block: DeviceBlock) -> Result<u64, GpuError> {
    match gpu.ask(BlockPtr(block)).await {
        Ok(p) => Ok(p),
        Err(SendError::HandlerError(e)) => Err(e),
        Err(e) => panic!("the GPU actor is gone: {e:?}"),
    }
}

fn fake_block() -> DeviceBlock {
    DeviceBlock {
        device: 0,
        pool: 0,
        ipc_handle: [7; 64],
        offset: 0,
        size: 4096,
    }
}

fn expect_unavailable<T: std::fmt::Debug>(what: &str, r: Result<T, GpuError>) {
    match r {
        Err(GpuError::GpuUnavailable(reason)) => {
            assert!(!reason.is_empty(), "{what}: empty reason");
            println!("{what}: GpuUnavailable({reason})");
        }
        other => panic!("{what}: expected GpuUnavailable, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Tests for every machine.

#[test]
fn probe_answers_without_panicking() {
    match probe() {
        Ok(info) => {
            assert!(!info.devices.is_empty());
            assert!(cuda_available().is_ok());
            for d in &info.devices {
                assert!(!d.name.is_empty());
                assert!(d.total_memory > 0 && d.free_memory <= d.total_memory);
            }
            println!("probe: {info:?}");
        }
        Err(e) => {
            expect_unavailable("probe", Err::<(), _>(e.clone()));
            assert_eq!(cuda_available(), Err(e), "cuda_available agrees with probe");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actor_without_gpu_answers_unavailable() {
    if cuda_available().is_ok() {
        println!("actor_without_gpu_answers_unavailable: skipped (this machine has a GPU)");
        return;
    }
    let gpu = GpuActor::spawn(GpuActor::new(GpuConfig {
        capacities: vec![(0, GIB)],
    }));
    expect_unavailable("AllocateDevice", ask_alloc(&gpu, 0, MIB).await);
    expect_unavailable("AllocateDevice on cuda:3", ask_alloc(&gpu, 3, 1).await);
    // Freeing or resolving a block the actor never made is harmless.
    gpu.tell(FreeDevice(fake_block())).await.expect("tell");
    assert!(ask_ptr(&gpu, fake_block()).await.is_err());
    assert!(gpu.ask(GpuUsage).await.expect("usage").is_empty());
    // Still alive and still answering the same.
    expect_unavailable("AllocateDevice again", ask_alloc(&gpu, 0, 0).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_capacity_keeps_the_store_off_a_device() {
    // Decided before any driver call, so the answer is the same with or without a GPU.
    let gpu = GpuActor::spawn(GpuActor::new(GpuConfig {
        capacities: vec![(0, 0)],
    }));
    match ask_alloc(&gpu, 0, 1).await {
        Err(GpuError::GpuUnavailable(r)) => assert!(r.contains("--gpu-memory"), "{r}"),
        other => panic!("expected GpuUnavailable, got {other:?}"),
    }
}

#[test]
fn client_helpers_without_gpu_answer_unavailable() {
    if cuda_available().is_ok() {
        println!("client_helpers_without_gpu_answer_unavailable: skipped (this machine has a GPU)");
        return;
    }
    expect_unavailable("ipc::open", ipc::open(&fake_block()).map(|v| v.ptr()));
    expect_unavailable("ipc::copy_d2d", ipc::copy_d2d(0x1000, 0x2000, 16));
    expect_unavailable("ipc::copy_h2d", ipc::copy_h2d(0x1000, &[1, 2, 3]));
    expect_unavailable("ipc::copy_d2h", ipc::copy_d2h(&mut [0; 3], 0x1000));
    expect_unavailable("ipc::copy_d2d_on", ipc::copy_d2d_on(0, 0x1000, 0x2000, 16));
    expect_unavailable("ipc::copy_h2d_on", ipc::copy_h2d_on(0, 0x1000, &[1]));
    expect_unavailable("ipc::copy_d2h_on", ipc::copy_d2h_on(0, &mut [0; 3], 0x1000));
    expect_unavailable("ipc::device_of", ipc::device_of(0x1000));
    expect_unavailable("ipc::mem_alloc", ipc::mem_alloc(0, 16));
    expect_unavailable("ipc::mem_free", ipc::mem_free(0, 0x1000));
    expect_unavailable("ipc::sync_stream", ipc::sync_stream(1));
    expect_unavailable("device_count", vovp_gpu::device_count());
    expect_unavailable("check_device", vovp_gpu::check_device(-1));
    assert_eq!(ipc::open_pools(), 0);
}

// ---------------------------------------------------------------------------------------------
// GPU tests (VOVP_GPU_TESTS=1).

#[test]
fn gpu_probe() {
    if !gpu_tests_enabled("gpu_probe") {
        return;
    }
    let info = probe().expect("probe on a GPU machine");
    println!(
        "driver supports CUDA {}.{}",
        info.driver_version / 1000,
        info.driver_version % 1000 / 10
    );
    for d in &info.devices {
        println!(
            "cuda:{} {}: {:.1} GiB total, {:.1} GiB free",
            d.ordinal,
            d.name,
            d.total_memory as f64 / GIB as f64,
            d.free_memory as f64 / GIB as f64
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_pool_allocates_frees_and_reports_oom() {
    if !gpu_tests_enabled("gpu_pool_allocates_frees_and_reports_oom") {
        return;
    }
    let _serial = GPU_LOCK.lock().await;
    let gpu = GpuActor::spawn(GpuActor::new(GpuConfig {
        capacities: vec![(0, 64 * MIB)],
    }));
    let a = ask_alloc(&gpu, 0, 1000).await.expect("small block");
    let b = ask_alloc(&gpu, 0, 10 * MIB).await.expect("10 MiB block");
    assert_eq!((a.device, a.pool, b.pool), (0, 0, 0));
    assert_eq!(a.ipc_handle, b.ipc_handle, "one IPC handle per pool");
    assert_ne!(a.offset, b.offset);
    assert_eq!(a.offset % BLOCK_ALIGN, 0);
    assert_eq!(b.offset % BLOCK_ALIGN, 0);
    let usage = gpu.ask(GpuUsage).await.expect("usage");
    assert_eq!(usage.len(), 1);
    assert_eq!(usage[0].capacity, 64 * MIB);
    assert!(usage[0].used >= 10 * MIB + 1000);

    // Too big for the pool: OutOfMemory, so that the caller evicts.
    match ask_alloc(&gpu, 0, 128 * MIB).await {
        Err(GpuError::OutOfMemory {
            device: 0,
            requested,
            available,
        }) => {
            assert_eq!(requested, 128 * MIB);
            assert!(available < 64 * MIB);
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    // Fill the pool, see OOM, free, and fit again.
    let mut held = Vec::new();
    while let Ok(blk) = ask_alloc(&gpu, 0, 4 * MIB).await {
        held.push(blk);
    }
    assert!(held.len() >= 8, "a 64 MiB pool holds several 4 MiB blocks");
    gpu.tell(FreeDevice(held[0])).await.expect("tell");
    ask_alloc(&gpu, 0, 4 * MIB)
        .await
        .expect("fits after a free");

    // Round trip through the daemon-side pointer.
    let p = ask_ptr(&gpu, a).await.expect("pointer of a live block");
    let data = pattern_range(0, 1000);
    ipc::copy_h2d(p, &data).expect("h2d");
    let mut back = vec![0u8; 1000];
    ipc::copy_d2h(&mut back, p).expect("d2h");
    assert_eq!(back, data);

    // Freed blocks have no pointer; double frees are harmless; other devices are refused.
    gpu.tell(FreeDevice(a)).await.expect("tell");
    gpu.tell(FreeDevice(a)).await.expect("tell");
    assert!(ask_ptr(&gpu, a).await.is_err());
    expect_unavailable("cuda:99", ask_alloc(&gpu, 99, 1).await);
}

/// The current context of the calling thread (null: none).
fn current_context() -> cudarc::driver::sys::CUcontext {
    let mut c: cudarc::driver::sys::CUcontext = std::ptr::null_mut();
    // SAFETY: writes one handle; the driver is loaded (the caller checked cuda_available).
    let rc = unsafe { cudarc::driver::sys::cuCtxGetCurrent(&mut c) };
    assert_eq!(rc, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
    c
}

#[test]
fn gpu_client_buffers_device_of_and_context_restored() {
    if !gpu_tests_enabled("gpu_client_buffers_device_of_and_context_restored") {
        return;
    }
    // A fresh thread has no current context; every client call must leave it that way (the
    // caller's framework owns what is current on its threads).
    std::thread::spawn(|| {
        assert!(current_context().is_null(), "a fresh thread has no context");
        let n = 3 * MIB as usize + 17;
        let a = ipc::mem_alloc(0, n).expect("mem_alloc");
        assert!(
            current_context().is_null(),
            "mem_alloc restored the context"
        );
        let b = ipc::mem_alloc(0, n).expect("mem_alloc");
        assert_eq!(ipc::device_of(a).expect("device_of"), 0);
        assert_eq!(ipc::device_of(b + n as u64 - 1).expect("device_of end"), 0);
        assert!(
            current_context().is_null(),
            "device_of restored the context"
        );
        let data = pattern_range(5, n);
        ipc::copy_h2d_on(0, a, &data).expect("h2d_on");
        ipc::copy_d2d_on(0, b, a, n).expect("d2d_on");
        let mut back = vec![0u8; n];
        ipc::copy_d2h_on(0, &mut back, b).expect("d2h_on");
        assert!(back == data, "bytes survive h2d, d2d, d2h");
        ipc::copy_d2d(a, b, 1).expect("d2d");
        assert!(current_context().is_null(), "copies restored the context");
        ipc::sync_stream(1).expect("sync the legacy default stream");
        // Errors: not device memory, a device that does not exist, a double free.
        match ipc::device_of(0x10) {
            Err(GpuError::Driver(m)) => assert!(m.contains("not CUDA device memory"), "{m}"),
            other => panic!("device_of(0x10): {other:?}"),
        }
        assert!(matches!(
            ipc::copy_d2d_on(0, b, 0x10, 64),
            Err(GpuError::Driver(_))
        ));
        match ipc::mem_alloc(99, 16) {
            Err(GpuError::GpuUnavailable(m)) => assert!(m.contains("cuda:99"), "{m}"),
            other => panic!("mem_alloc on cuda:99: {other:?}"),
        }
        match vovp_gpu::check_device(-1) {
            Err(GpuError::GpuUnavailable(m)) => assert!(m.contains("cuda:-1"), "{m}"),
            other => panic!("check_device(-1): {other:?}"),
        }
        assert!(
            current_context().is_null(),
            "failures restored the context too"
        );
        ipc::mem_free(0, a).expect("free a");
        ipc::mem_free(0, b).expect("free b");
        assert!(matches!(ipc::mem_free(0, a), Err(GpuError::Driver(_))));
        assert!(current_context().is_null());
    })
    .join()
    .expect("the test thread");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_default_capacity_is_a_share_of_free_memory() {
    if !gpu_tests_enabled("gpu_default_capacity_is_a_share_of_free_memory") {
        return;
    }
    let _serial = GPU_LOCK.lock().await;
    let free = probe().expect("probe").devices[0].free_memory;
    let gpu = GpuActor::spawn(GpuActor::new(GpuConfig::default()));
    let b = ask_alloc(&gpu, 0, 1)
        .await
        .expect("block in the default pool");
    let usage = gpu.ask(GpuUsage).await.expect("usage");
    let expected = free / 100 * DEFAULT_FREE_FRACTION_PERCENT;
    println!(
        "default pool on cuda:0: {:.1} GiB ({}% of {:.1} GiB free)",
        usage[0].capacity as f64 / GIB as f64,
        DEFAULT_FREE_FRACTION_PERCENT,
        free as f64 / GIB as f64
    );
    // Free memory may have moved a little between the probe and the pool (other processes).
    assert!(usage[0].capacity <= expected + 64 * MIB);
    assert!(usage[0].capacity + GIB >= expected);
    gpu.tell(FreeDevice(b)).await.expect("tell");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_ipc_child_reads_parent_bytes_and_copies_1gib() {
    if !gpu_tests_enabled("gpu_ipc_child_reads_parent_bytes_and_copies_1gib") {
        return;
    }
    let _serial = GPU_LOCK.lock().await;
    let gpu = GpuActor::spawn(GpuActor::new(GpuConfig {
        capacities: vec![(0, 3 * GIB)],
    }));
    let src = ask_alloc(&gpu, 0, GIB).await.expect("1 GiB block");
    let dst = ask_alloc(&gpu, 0, GIB).await.expect("second 1 GiB block");
    let src_ptr = ask_ptr(&gpu, src).await.expect("ptr");
    let dst_ptr = ask_ptr(&gpu, dst).await.expect("ptr");

    // Fill src with the pattern: one period from the host, then doubling on the device.
    ipc::copy_h2d(src_ptr, &pattern_range(0, PERIOD)).expect("h2d");
    let mut filled = PERIOD as u64;
    while filled < GIB {
        let n = filled.min(GIB - filled);
        ipc::copy_d2d(src_ptr + filled, src_ptr, n as usize).expect("d2d fill");
        filled += n;
    }
    // In-process bandwidth, for comparison with the child's (which goes through IPC mappings).
    let gbps = d2d_bandwidth(dst_ptr, src_ptr, GIB as usize);
    println!("parent: 1 GiB device-to-device copy: {gbps:.0} GB/s (bytes copied per second)");
    ipc::copy_h2d(dst_ptr, &[0u8; 4096]).expect("clear marker");

    let exe = std::env::current_exe().expect("current_exe");
    let out = Command::new(exe)
        .args([
            "child_process_entry",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(
            "VOVP_GPU_CHILD",
            format!("{};{}", encode(&src), encode(&dst)),
        )
        .output()
        .expect("spawn the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    // libtest prints "test child_process_entry ... " in front of the first line.
    for line in stdout
        .lines()
        .filter_map(|l| l.find("child:").map(|i| &l[i..]))
    {
        println!("{line}");
    }
    assert!(
        out.status.success(),
        "child failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("child: ok"),
        "the child did not run its checks:\n{stdout}"
    );

    // The child wrote a marker into dst through its mapping; the parent must see it.
    let mut marker = vec![0u8; 4096];
    ipc::copy_d2h(&mut marker, dst_ptr).expect("d2h");
    assert_eq!(marker, child_marker(), "parent sees the child's writes");
    gpu.tell(FreeDevice(src)).await.expect("tell");
    gpu.tell(FreeDevice(dst)).await.expect("tell");
}

/// The child half of the IPC test; a no-op unless started by it.
#[test]
fn child_process_entry() {
    let Ok(spec) = std::env::var("VOVP_GPU_CHILD") else {
        return;
    };
    let blocks: Vec<DeviceBlock> = spec.split(';').map(decode).collect();
    let (src, dst) = (blocks[0], blocks[1]);
    let t = Instant::now();
    let src_view = ipc::open(&src).expect("open src");
    println!(
        "child: opened the pool in {:.1} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    let dst_view = ipc::open(&dst).expect("open dst");
    assert_eq!(ipc::open_pools(), 1, "both blocks share one pool mapping");
    assert_eq!(src_view.size(), GIB);

    // The parent's bytes, at the start, the end and in between.
    let size = GIB as usize;
    for start in [0, PERIOD - 100, size / 3, size - MIB as usize] {
        let len = MIB as usize;
        let mut got = vec![0u8; len];
        ipc::copy_d2h(&mut got, src_view.ptr() + start as u64).expect("d2h");
        assert!(
            got == pattern_range(start, len),
            "child: src bytes differ at {start}"
        );
    }
    println!("child: parent's bytes verified");

    let gbps = d2d_bandwidth(dst_view.ptr(), src_view.ptr(), size);
    println!("child: 1 GiB device-to-device copy through IPC mappings: {gbps:.0} GB/s");
    // Any NVIDIA GPU copies at well over this; far less means copies go through the host.
    let floor: f64 = std::env::var("VOVP_GPU_MIN_GBPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20.0);
    assert!(
        gbps > floor,
        "implausibly slow device-to-device copy: {gbps:.1} GB/s"
    );
    let mut got = vec![0u8; MIB as usize];
    let at = size - MIB as usize;
    ipc::copy_d2h(&mut got, dst_view.ptr() + at as u64).expect("d2h");
    assert!(got == pattern_range(at, got.len()), "child: copy differs");

    ipc::copy_h2d(dst_view.ptr(), &child_marker()).expect("write marker");
    // Last, since it checks a safety net rather than the data path: the pool's size as the driver
    // reports it for an IPC mapping.
    let outside = DeviceBlock {
        offset: 4 * GIB,
        size: 1,
        ..src
    };
    assert!(
        ipc::open(&outside).is_err(),
        "a block past the pool's end is refused"
    );
    assert_eq!(ipc::open_pools(), 1);
    drop(src_view);
    assert_eq!(ipc::open_pools(), 1, "still mapped while a view lives");
    drop(dst_view);
    assert_eq!(ipc::open_pools(), 0, "unmapped with the last view");
    println!("child: ok");
}

fn child_marker() -> Vec<u8> {
    (0..4096).map(|i| pattern(i) ^ 0xa5).collect()
}

/// Copies `bytes` once to warm up, then times 10 copies; bytes copied per second, in GB/s.
fn d2d_bandwidth(dst: u64, src: u64, bytes: usize) -> f64 {
    ipc::copy_d2d(dst, src, bytes).expect("warm-up copy");
    let runs = 10;
    let t = Instant::now();
    for _ in 0..runs {
        ipc::copy_d2d(dst, src, bytes).expect("timed copy");
    }
    (runs * bytes) as f64 / t.elapsed().as_secs_f64() / 1e9
}

fn encode(b: &DeviceBlock) -> String {
    let hex: String = b.ipc_handle.iter().map(|x| format!("{x:02x}")).collect();
    format!("{},{},{},{},{hex}", b.device, b.pool, b.offset, b.size)
}

fn decode(s: &str) -> DeviceBlock {
    let f: Vec<&str> = s.split(',').collect();
    let mut ipc_handle = [0u8; 64];
    for (i, byte) in ipc_handle.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&f[4][2 * i..2 * i + 2], 16).expect("hex");
    }
    DeviceBlock {
        device: f[0].parse().expect("device"),
        pool: f[1].parse().expect("pool"),
        ipc_handle,
        offset: f[2].parse().expect("offset"),
        size: f[3].parse().expect("size"),
    }
}
