#!/usr/bin/env bash
# Runs vovp's GPU tests WITHOUT a GPU, against the FAKE CUDA driver in gpu/fake-cuda/.
#
# The fake libcuda.so is a stand-in for the NVIDIA driver: "device memory" is shared host memory,
# copies are memcpy, CUDA IPC is emulated through /proc/<pid>/fd. Passing here shows that the
# store's GPU code paths work end to end (daemon pools and IPC handles, the Rust and Python
# clients' IPC mappings, the CLI, references, eviction) -- it is NOT proof on real hardware, and
# the GB/s it prints measure host memcpy, nothing else. On a machine with an NVIDIA GPU run
# `bash gpu/check.sh`.
#
#   scripts/gpu-fake-test.sh        # needs gcc; about 20 s after the build
set -euo pipefail
cd "$(dirname "$0")/.."
FAKE="$PWD/target/fake-cuda"
LOG="$FAKE/test.log"

echo "== fake CUDA driver -> $FAKE (a stand-in, not a GPU)"
mkdir -p "$FAKE"
gcc -shared -fPIC -O2 -Wall -Wextra -Werror -Wl,-soname,libcuda.so.1 \
    -o "$FAKE/libcuda.so.1" gpu/fake-cuda/fake_cuda.c -lpthread
# cudarc tries libcuda.so first, then libcuda.so.1 (among others).
ln -sf libcuda.so.1 "$FAKE/libcuda.so"

echo "== build"
# The cross-process tests run the daemon (vovp-engine) and the test fixture (vovp-fixture).
cargo build -p vovp-transport -p vovp-tests --bins
cargo test -p vovp-gpu -p vovp-gpu-pool -p vovp-actors -p vovp-tests --no-run

export LD_LIBRARY_PATH="$FAKE${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
: >"$LOG"
run() { # NAME ENV... -- CARGO-TEST-ARGS...
    local name=$1
    shift
    echo "== $name"
    set +e
    env "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    set -e
    if [ "$rc" -ne 0 ]; then
        echo "FAIL: $name (exit $rc; log in $LOG)"
        exit "$rc"
    fi
}

# GPU tests against the fake device. The bandwidth floor of vovp-gpu's test is off: memcpy speed
# says nothing. 128 MiB is the big put here (1 GiB on real GPUs).
run "vovp-gpu tests, fake GPU" VOVP_GPU_TESTS=1 VOVP_GPU_MIN_GBPS=0 \
    timeout 120 cargo test -p vovp-gpu -p vovp-actors --test gpu --test simulated -- --nocapture --test-threads=1
run "vovp-gpu-pool unit tests" timeout 60 cargo test -p vovp-gpu-pool
run "cross-process GPU tests (tests/tests/gpu.rs), fake GPU" VOVP_GPU_TESTS=1 \
    VOVP_GPU_BIG_BYTES="${VOVP_GPU_BIG_BYTES:-128M}" \
    timeout 120 cargo test -p vovp-tests --test gpu -- --nocapture --test-threads=1

# A driver that loads but has no usable device: every path must answer GpuUnavailable.
for mode in FAKE_CUDA_INIT_ERROR=100 FAKE_CUDA_DEVICES=0; do
    run "no usable device ($mode)" "$mode" timeout 60 cargo test -p vovp-actors -p vovp-tests \
        --test gpu -- --nocapture --test-threads=1
done

# The Python client's CUDA paths (python/tests/test_cuda.py: driver checks, IPC mappings through
# the native core, Python <-> Python across processes, Python <-> the Rust test fixture) against the fake
# device. The venv is made the way scripts/test.sh makes it (the native core built into the
# source tree, from which the tests import vovp).
VENV="${VOVP_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import numpy, pytest" 2>/dev/null; then
    "$VENV/bin/pip" install --quiet --upgrade pip
    "$VENV/bin/pip" install --quiet numpy pytest
fi
"$VENV/bin/pip" install --quiet --no-deps -e ./python
run "Python client CUDA tests (python/tests/test_cuda.py), fake GPU" VOVP_GPU_TESTS=1 \
    VOVP_ENGINE_BIN="$PWD/target/debug/vovp-engine" VOVP_FIXTURE_BIN="$PWD/target/debug/vovp-fixture" \
    timeout 300 "$VENV/bin/python" -m pytest python/tests/test_cuda.py -q -rs

echo "== results (FAKE driver: the GB/s are host memcpy figures, meaningless for GPUs)"
grep -oE "(parent:|child:|[0-9]+ MiB device put).*GB/s.*" "$LOG" || true
grep -oE "without a GPU: .*" "$LOG" | sort -u || true
echo "PASS: GPU code paths against the fake driver (not verified on real hardware)"
