#!/usr/bin/env bash
# Runs the GPU tests of vovp-gpu on a machine with an NVIDIA GPU and driver (no CUDA toolkit
# needed: the driver library is loaded at run time). Takes a few minutes at most, mostly the build.
#
#   gpu/check.sh            # from anywhere in the repository
#
# Environment: CUDA_VISIBLE_DEVICES picks the GPU (tests use cuda:0); VOVP_GPU_MIN_GBPS sets the
# device-to-device bandwidth floor (default 20 GB/s).
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== driver"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv || true
else
    echo "nvidia-smi not found (the tests will say whether libcuda.so loads)"
fi

echo "== build"
start=$(date +%s)
timeout 240 cargo test -p vovp-gpu --no-run

echo "== tests"
set +e
VOVP_GPU_TESTS=1 timeout 180 cargo test -p vovp-gpu -- --nocapture --test-threads=1 2>&1 | tee /tmp/vovp-gpu-check.log
rc=${PIPESTATUS[0]}
set -e

echo "== results ($(( $(date +%s) - start )) s)"
# libtest may print "test NAME ... " in front of a test's first line, hence -o.
grep -oE "(driver supports|cuda:[0-9]+ [^:]*: [0-9]|default pool|parent:|child:|panicked|FAILED).*" \
    /tmp/vovp-gpu-check.log || true
grep -E "^test result" /tmp/vovp-gpu-check.log || true
if [ "$rc" -eq 0 ]; then
    echo "PASS: vovp-gpu GPU checks"
else
    echo "FAIL: vovp-gpu GPU checks (exit $rc; full log in /tmp/vovp-gpu-check.log)"
fi
exit "$rc"
