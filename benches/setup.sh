#!/usr/bin/env bash
# Prepares the Python side of the benchmarks: a venv at target/bench/venv with the reference store
# (Apache Arrow Plasma, which only ships in pyarrow <= 11), numpy, matplotlib for the plot, torch
# (the PyTorch workloads), and the vovp Python package from python/ (built by cargo). scripts/plasma-conformance.sh
# runs Plasma's own tests in the same venv, hence pytest and pandas (test_store_pandas_dataframe).
#
# Idempotent: a stamp file records what was installed; when it matches, nothing is done (this
# keeps `vovp-bench --quick` fast in CI after the first run). Prints, as its last two lines,
#   VENV_PYTHON=<path of the venv's python>
#   PLASMA_STORE=<path of plasma-store-server>
# which the harness reads.
#
# The peers of the `peers` workload (benches/peers.py) go into the same venv in a step of their
# own that may fail: Ray, Vineyard with vineyardd (vineyard-bdist), and setuptools < 81 for the
# pkg_resources that vineyard 0.24 imports. A peer that did not install is reported as not run
# by the driver, with the import error; the rest of the benchmark runs.
#
# Environment: PYTHON (default python3) picks the interpreter; VOVP_BENCH_VENV moves the venv;
# VOVP_BENCH_NO_PEERS=1 skips the peers' install.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VOVP_BENCH_VENV:-$ROOT/target/bench/venv}"
PYTHON="${PYTHON:-python3}"

# pyarrow 11.0.0 is the last release with Plasma; it has wheels for CPython 3.7-3.11. numpy 2
# breaks pyarrow 11's compiled extension, hence the pin; pandas 2.0 is the last one built against
# numpy 1 that pyarrow 11 was tested with.
# torch: the PyTorch workloads' baseline is torch.multiprocessing's own sharing (torch 2.x runs
# with numpy 1.26; checked with torch 2.15).
PACKAGES=("pyarrow==11.0.0" "numpy<2" "matplotlib" "pytest" "pandas<2.1" "torch")
STAMP_TEXT="v1 ${PACKAGES[*]} $("$PYTHON" -c 'import sys; print(sys.version.split()[0])')"
STAMP="$VENV/.vovp-bench-complete"

plasma_path() {
    "$VENV/bin/python" - <<'EOF'
import os, pyarrow
p = os.path.join(os.path.dirname(pyarrow.__file__), "plasma-store-server")
if not os.access(p, os.X_OK):
    raise SystemExit(f"plasma-store-server not found at {p}")
print(p)
EOF
}

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_TEXT" && -x "$VENV/bin/python" ]]; then
    echo "setup: venv $VENV is complete, nothing to do" >&2
else
    start=$(date +%s)
    echo "setup: creating $VENV (${PACKAGES[*]}, vovp from python/)" >&2
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet "${PACKAGES[@]}" >&2
    plasma_path >/dev/null
    echo "$STAMP_TEXT" >"$STAMP"
    echo "setup: done in $(($(date +%s) - start)) s" >&2
fi
# numpy<2 again: pip must not upgrade numpy under pyarrow 11 for a peer.
PEERS=("ray==2.60.0" "vineyard==0.24.2" "vineyard-bdist==0.24.2" "setuptools<81" "numpy<2")
PEERS_STAMP_TEXT="v1 ${PEERS[*]}"
PEERS_STAMP="$VENV/.vovp-bench-peers"
if [[ "${VOVP_BENCH_NO_PEERS:-0}" == 1 ]]; then
    echo "setup: VOVP_BENCH_NO_PEERS=1: peers not installed" >&2
elif [[ -f "$PEERS_STAMP" && "$(cat "$PEERS_STAMP")" == "$PEERS_STAMP_TEXT" ]]; then
    :
elif "$VENV/bin/python" -m pip install --quiet "${PEERS[@]}" >&2; then
    echo "$PEERS_STAMP_TEXT" >"$PEERS_STAMP"
else
    echo "setup: warning: the peers (${PEERS[*]}) did not install; the peers workload" \
        "reports them as not run" >&2
fi
# The vovp package, on every run: its native core (vovp._native) is built by cargo (maturin),
# so a changed Rust client must be rebuilt (incremental: seconds when nothing changed).
# Editable: the extension lands in python/vovp/, which the harness puts first on PYTHONPATH.
"$VENV/bin/python" -m pip install --quiet --no-deps -e "$ROOT/python" >&2

echo "VENV_PYTHON=$VENV/bin/python"
echo "PLASMA_STORE=$(plasma_path)"
