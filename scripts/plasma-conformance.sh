#!/usr/bin/env bash
# Plasma's own test suite against vovp.plasma: pyarrow 11.0.0's pyarrow/tests/test_plasma.py,
# taken from the installed wheel (never committed here), rewritten only by the sed lines below
# into a temporary directory and run there with pytest. scripts/plasma_conformance/conftest.py
# skips the tests of what vovp deliberately does not ship (each with its reason) and fails the
# run on any failure or on any skip that is not exactly the expected one.
#
# Uses the benchmark venv (benches/setup.sh: pyarrow 11, numpy<2, pytest, pandas) and the daemon
# in $VOVP_ENGINE_BIN (default target/debug/vovp-engine). Extra arguments go to pytest.
#
# test_use_huge_pages runs where /mnt/hugepages exists (Plasma's own condition) and must then
# pass; elsewhere the test skips itself. VOVP_PLASMA_HUGEPAGES=1 (root) sets it up for the run:
# mounts hugetlbfs on /mnt/hugepages, reserves 1000 more 2 MiB pages, and undoes both at exit.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"

PY="$(bash benches/setup.sh | sed -n 's/^VENV_PYTHON=//p')"
export VOVP_ENGINE_BIN="${VOVP_ENGINE_BIN:-$ROOT/target/debug/vovp-engine}"
if [ ! -x "$VOVP_ENGINE_BIN" ]; then
    echo "plasma-conformance: $VOVP_ENGINE_BIN is missing (cargo build --workspace --bins)" >&2
    exit 1
fi
SRC="$("$PY" -c 'import os, pyarrow; print(os.path.join(os.path.dirname(pyarrow.__file__), "tests", "test_plasma.py"))')"
"$PY" -c 'import pyarrow, sys; sys.exit(pyarrow.__version__ != "11.0.0")' || {
    echo "plasma-conformance: needs pyarrow 11.0.0 (the last release with Plasma)" >&2; exit 1; }

WORK="$(mktemp -d "${TMPDIR:-/tmp}/vovp-plasma-conformance.XXXXXX")"
HUGE_UNDO=""
cleanup() {
    rm -rf "$WORK"
    if [ -n "$HUGE_UNDO" ]; then
        umount /mnt/hugepages && rmdir /mnt/hugepages
        echo "$HUGE_UNDO" >/proc/sys/vm/nr_hugepages
    fi
}
trap cleanup EXIT
if [ "${VOVP_PLASMA_HUGEPAGES:-0}" = 1 ] && [ ! -e /mnt/hugepages ]; then
    before="$(cat /proc/sys/vm/nr_hugepages)"
    mkdir /mnt/hugepages
    mount -t hugetlbfs none /mnt/hugepages
    HUGE_UNDO="$before"
    echo $((before + 1000)) >/proc/sys/vm/nr_hugepages
    echo "plasma-conformance: $(grep HugePages_Free /proc/meminfo) on /mnt/hugepages" >&2
fi
{
    echo "import vovp.plasma as plasma_mod"
    sed -e 's/import pyarrow.plasma as plasma/import vovp.plasma as plasma/' \
        -e 's/from pyarrow import plasma/from vovp import plasma/' \
        -e 's/pa\.plasma\./plasma_mod./' \
        "$SRC"
} >"$WORK/test_plasma.py"
if grep -nE 'pyarrow\.plasma|pa\.plasma|from pyarrow import plasma' "$WORK/test_plasma.py"; then
    echo "plasma-conformance: the rewrite left references to pyarrow's Plasma (above)" >&2
    exit 1
fi
cp scripts/plasma_conformance/conftest.py "$WORK/conftest.py"

cd "$WORK"
# python/ first on the path: the working tree's client, also in the tests' subprocesses.
PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}" \
    "$PY" -m pytest -p no:cacheprovider -q -rs --durations=5 test_plasma.py "$@"
