#!/usr/bin/env bash
# The versions users have (issue 29): the Python suite under numpy 1.x as well as 2.x, and under
# an older torch as well as the newest. The main suite (scripts/test.sh, .venv) is numpy 2 with
# the newest torch; this adds
#   numpy1-torch-new: the benchmark venv (benches/setup.sh: numpy<2 for pyarrow 11, newest
#                     torch), every Python test but the Ray cluster's (no Ray there);
#   numpy1-torch-old: target/compat/venv (numpy 1.26, torch $VOVP_OLD_TORCH, default 2.6.0, the
#                     oldest release of the last two years), the tests that touch numpy/torch
#                     interop: tensors, torch, DLPack, reduction, the client.
# Binaries as for scripts/test.sh (target/debug). Prints each row's pytest summary; fails if any
# row fails or skips a test for want of torch.
#
# Disk: the old-torch venv is ~5 GB (torch and its CUDA libraries). It is installed without
# pip's cache and removed at the end, so CI's later steps keep that room; VOVP_COMPAT_KEEP=1
# keeps it for reruns.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
OLD_TORCH="${VOVP_OLD_TORCH:-2.6.0}"
export VOVP_REQUIRE_TORCH=1
export VOVP_ENGINE_BIN="$ROOT/target/debug/vovp-engine" VOVP_CLI_BIN="$ROOT/target/debug/vovp"
export VOVP_FIXTURE_BIN="$ROOT/target/debug/vovp-fixture"

row() { # NAME PYTHON PYTEST-ARGS...
    local name=$1 py=$2
    shift 2
    echo "== $name: $("$py" -c 'import numpy, torch; print(f"numpy {numpy.__version__}, torch {torch.__version__}")')"
    "$py" -m pytest -q -rs -p no:cacheprovider "$@"
}

BENCH_PY="$(bash benches/setup.sh | sed -n 's/^VENV_PYTHON=//p')"
# Not here: the Ray clusters (the main run has them) and the metrics parser's test (it reads the
# daemon's text with prometheus_client, which this venv lacks; nothing in it is numpy's).
row numpy1-torch-new "$BENCH_PY" python/tests --ignore python/tests/test_cluster.py \
    --ignore python/tests/test_cluster_versions.py --ignore python/tests/test_cluster_state.py \
    --ignore python/tests/test_ray_transport.py --ignore python/tests/test_metrics.py

VENV="$ROOT/target/compat/venv"
STAMP="$VENV/.vovp-compat-$OLD_TORCH"
if [ ! -f "$STAMP" ]; then
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --no-cache-dir "numpy==1.26.4" "torch==$OLD_TORCH" pytest
    touch "$STAMP"
fi
"$VENV/bin/pip" install --quiet --no-deps -e python
row numpy1-torch-old "$VENV/bin/python" python/tests/test_tensor.py python/tests/test_torch.py \
    python/tests/test_dlpack.py python/tests/test_reduction.py python/tests/test_client.py
if [ "${VOVP_COMPAT_KEEP:-0}" != 1 ]; then
    rm -rf "$VENV"
fi
