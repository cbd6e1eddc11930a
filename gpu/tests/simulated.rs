//! The test hook that simulates a missing driver library (`simulate_library_names`). In its own
//! test binary: the simulation is process-wide and would fail the GPU tests running beside it.

use vovp_gpu::{cuda_available, device_count, ipc, simulate_library_names, GpuError};

fn missing_reason() -> String {
    match cuda_available() {
        Err(GpuError::GpuUnavailable(r)) => r,
        other => panic!("expected GpuUnavailable, got {other:?}"),
    }
}

#[test]
fn a_library_name_that_does_not_load_means_no_driver() {
    let real = cuda_available();
    simulate_library_names(Some(&[
        "libcuda-that-does-not-exist-vovp-test.so".to_string()
    ]));
    let reason = missing_reason();
    assert!(reason.contains("libcuda"), "{reason}");
    assert!(
        reason.contains("libcuda-that-does-not-exist-vovp-test.so"),
        "the loader's own error is part of the reason: {reason}"
    );
    // Every entry point agrees, and nothing panics.
    assert!(matches!(device_count(), Err(GpuError::GpuUnavailable(_))));
    assert!(matches!(
        ipc::mem_alloc(0, 16),
        Err(GpuError::GpuUnavailable(_))
    ));
    assert!(matches!(
        ipc::copy_h2d_on(0, 0x1000, &[1]),
        Err(GpuError::GpuUnavailable(_))
    ));
    assert!(matches!(
        ipc::device_of(0x1000),
        Err(GpuError::GpuUnavailable(_))
    ));
    // Back to the real state, whatever it is (the same answer as before).
    simulate_library_names(None);
    assert_eq!(cuda_available(), real);
    // A name that loads (this process's own C library) also means "the real driver".
    simulate_library_names(Some(&["libc.so.6".to_string()]));
    assert_eq!(cuda_available(), real);
    simulate_library_names(None);
}
