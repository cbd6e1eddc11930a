#!/usr/bin/env bash
# The whole test suite: Rust (unit, engine, cross-process daemon tests), Python (pytest
# against the real daemon), then Plasma's own test suite against vovp.plasma. Creates the Python
# venv (.venv) and the benchmark venv with pyarrow 11 (target/bench/venv) on first use.
set -euo pipefail
cd "$(dirname "$0")/.."

# The cross-process tests run the daemon, CLI and test fixture binaries: build them first.
cargo build --workspace --bins
cargo test --workspace

VENV="${VOVP_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
# torch is optional for users but not for the tests: most users come from PyTorch. The PyPI
# wheel (CPU is all the tests need; it also carries CUDA libraries, a large first download).
# Ray: vovp.cluster (pip install "vovp[cluster]"), tested on a local multi-node Ray cluster.
# prometheus_client: its text parser reads the daemon's metrics in test_metrics.py.
if ! "$VENV/bin/python" -c "import numpy, pytest, torch, ray, prometheus_client" 2>/dev/null; then
    "$VENV/bin/pip" install --quiet --upgrade pip
    "$VENV/bin/pip" install --quiet numpy pytest torch "ray>=2.9" prometheus_client
fi
# The package's native core (vovp._native) is built with cargo by maturin, which pip fetches
# from PyPI. Editable: the extension is built into python/vovp/, so the tests (which import vovp
# from the source tree, as do the children they spawn) run this build.
"$VENV/bin/pip" install --quiet --no-deps -e ./python
# pytest under interpreter $1 against the binaries built above. VOVP_REQUIRE_TORCH=1: a torch
# test skipped because torch cannot be imported fails the run (python/tests/conftest.py).
python_tests() {
    local python=$1
    shift
    VOVP_REQUIRE_TORCH="${VOVP_REQUIRE_TORCH:-1}" \
        VOVP_ENGINE_BIN="$PWD/target/debug/vovp-engine" VOVP_CLI_BIN="$PWD/target/debug/vovp" \
        VOVP_FIXTURE_BIN="$PWD/target/debug/vovp-fixture" \
        "$python" -m pytest "$@"
}
# -rs lists every skip that remains (GPU-only tests).
python_tests "$VENV/bin/python" python/tests -q -rs

# Plasma's own tests (pyarrow 11's test_plasma.py) against vovp.plasma; fails on any failure or
# unexpected skip.
./scripts/plasma-conformance.sh

# The drop-in's own tests once more with pyarrow importable (the benchmark venv): its buffers
# are then pyarrow.Buffers over the native object, another path than the PlasmaBuffers above.
BENCH_PY="$(bash benches/setup.sh | sed -n 's/^VENV_PYTHON=//p')"
python_tests "$BENCH_PY" python/tests/test_plasma_dropin.py -q -rs \
    -k "not test_buffers_without_pyarrow_are_plasma_buffers"
