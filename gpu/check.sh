#!/usr/bin/env bash
# The GPU checks, for a person on a machine with an NVIDIA GPU and driver (no CUDA toolkit needed:
# libcuda.so is loaded at run time). One command, from anywhere in the repository:
#
#   bash gpu/check.sh
#
# Builds, then runs with VOVP_GPU_TESTS=1: the vovp-gpu crate's tests (pools, out-of-memory, CUDA
# IPC into a child process, 1 GiB device-to-device bandwidth) and the cross-process tests in
# tests/tests/gpu.rs (the real daemon with --gpu-memory, this process and `vovp-fixture` processes
# sharing one device allocation, releases, LRU eviction of device objects, a 1 GiB device put
# against the raw copy_d2d bandwidth). Prints PASS/FAIL with the measured GB/s. A few minutes,
# mostly the build.
#
# Environment: CUDA_VISIBLE_DEVICES picks the GPU (the tests use cuda:0); VOVP_GPU_MIN_GBPS is
# vovp-gpu's device-to-device floor (default 20 GB/s); VOVP_GPU_BIG_BYTES the big put (default 1G;
# the daemon then reserves 4x that plus 64 MiB on cuda:0).
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS="$PWD/target/gpu-check"
mkdir -p "$LOGS"
start=$(date +%s)

echo "== driver"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv || true
else
    echo "nvidia-smi not found (the tests will say whether libcuda.so loads)"
fi

echo "== build"
# The cross-process tests run the daemon (vovp-engine) and the test fixture (vovp-fixture).
if ! timeout 240 cargo build -p vovp-transport -p vovp-tests --bins ||
    ! timeout 240 cargo test -p vovp-gpu -p vovp-gpu-pool -p vovp-actors -p vovp-tests --no-run; then
    echo "FAIL: build"
    exit 1
fi

status=0
part() { # NAME LOG COMMAND...
    local name=$1 log=$2
    shift 2
    echo "== $name"
    VOVP_GPU_TESTS=1 "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 0 ]; then
        results+=("PASS: $name")
    else
        results+=("FAIL: $name (exit $rc; log: $log)")
        status=1
    fi
}
results=()
part "vovp-gpu tests" "$LOGS/gpu-crate.log" \
    timeout 120 cargo test -p vovp-gpu -p vovp-actors --test gpu --test simulated -- --nocapture --test-threads=1
part "cross-process GPU tests (tests/tests/gpu.rs)" "$LOGS/cross-process.log" \
    timeout 180 cargo test -p vovp-tests --test gpu -- --nocapture --test-threads=1

echo "== results ($(($(date +%s) - start)) s)"
# libtest may print "test NAME ... " in front of a test's first line, hence -o.
grep -ohE "(driver supports|cuda:[0-9]+ [^:]*: [0-9]|parent:|child:|[0-9]+ MiB device put).*" \
    "$LOGS"/gpu-crate.log "$LOGS"/cross-process.log || true
grep -hE "^test result|panicked" "$LOGS"/gpu-crate.log "$LOGS"/cross-process.log || true
if grep -q "Fake GPU" "$LOGS"/gpu-crate.log; then
    echo "WARNING: the FAKE driver (gpu/fake-cuda) was loaded, not NVIDIA's: check LD_LIBRARY_PATH."
    echo "         These results say nothing about real hardware."
fi
printf '%s\n' "${results[@]}"
exit "$status"
