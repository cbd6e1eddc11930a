#!/usr/bin/env bash
# The suites of scripts/test.sh ROUNDS times in a row (default 10) with both CPUs kept busy by
# two busy loops: issue 31's check that no test passes or fails by timing. Run
# ./scripts/test.sh once first (it builds everything and makes .venv and the benchmark venv).
# Prints one line per round (exit codes, seconds, pytest's summary); logs in target/rounds/.
# Stops at the first round with a failure, and exits non-zero then.
set -uo pipefail
cd "$(dirname "$0")/.."
export VOVP_REQUIRE_TORCH=1 VOVP_REQUIRE_ROOT="${VOVP_REQUIRE_ROOT:-1}"
export VOVP_ENGINE_BIN="$PWD/target/debug/vovp-engine" VOVP_CLI_BIN="$PWD/target/debug/vovp"
export VOVP_FIXTURE_BIN="$PWD/target/debug/vovp-fixture"
LOGS="$PWD/target/rounds"
mkdir -p "$LOGS"
cargo build --workspace --bins -q && cargo test --workspace -q --no-run || exit 1
.venv/bin/pip install --quiet --no-deps -e ./python || exit 1
BENCH_PY="$(bash benches/setup.sh | sed -n 's/^VENV_PYTHON=//p')"
(while :; do :; done) &
L1=$!
(while :; do :; done) &
L2=$!
trap 'kill $L1 $L2' EXIT
for i in $(seq 1 "${ROUNDS:-10}"); do
    s=$(date +%s)
    cargo test --workspace >"$LOGS/rust-$i.log" 2>&1
    r1=$?
    .venv/bin/python -m pytest python/tests -q -rs >"$LOGS/py-$i.log" 2>&1
    r2=$?
    ./scripts/plasma-conformance.sh >"$LOGS/conformance-$i.log" 2>&1
    r3=$?
    "$BENCH_PY" -m pytest python/tests/test_plasma_dropin.py -q -rs \
        -k "not test_buffers_without_pyarrow_are_plasma_buffers" >"$LOGS/dropin-$i.log" 2>&1
    r4=$?
    echo "$(date +%H:%M) round $i: cargo $r1, pytest $r2, conformance $r3, drop-in $r4" \
        "($(($(date +%s) - s)) s) | $(tail -1 "$LOGS/py-$i.log")"
    if [ $((r1 + r2 + r3 + r4)) -ne 0 ]; then
        exit 1
    fi
done
