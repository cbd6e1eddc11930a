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
# pass; elsewhere the test skips itself ("requires hugepage support"). Where huge pages can be
# reserved this script sets that up for the run: as root, it mounts hugetlbfs on /mnt/hugepages
# and reserves 1000 more 2 MiB pages (the test's store is 2 GB; where memory is fragmented it
# compacts it and drops clean caches first), and undoes both at exit.
# VOVP_PLASMA_HUGEPAGES: auto (default) does so where it can and says why not where it cannot;
# 1 fails the run where it cannot; 0 never touches huge pages.
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
HUGE_UNDO=""  # nr_hugepages to restore once /mnt/hugepages (ours) is unmounted
HUGE_WHY=""
HUGE_MADE_DIR=""  # set when this run made /mnt/hugepages (and so removes it)
undo_huge() { # never fails: it runs in the EXIT trap, where a failure would fail a passed run
    if [ -z "$HUGE_UNDO" ]; then return 0; fi
    local restore="$HUGE_UNDO"
    HUGE_UNDO=""
    # -l: a leftover process with the mount open must not keep it (and the next run from
    # setting up its own).
    if umount /mnt/hugepages 2>/dev/null || umount -l /mnt/hugepages 2>/dev/null; then
        if [ -n "$HUGE_MADE_DIR" ]; then rmdir /mnt/hugepages 2>/dev/null || true; fi
    else
        echo "plasma-conformance: warning: could not unmount /mnt/hugepages" >&2
    fi
    echo "$restore" 2>/dev/null >/proc/sys/vm/nr_hugepages ||
        echo "plasma-conformance: warning: could not set vm.nr_hugepages back to $restore" >&2
}
cleanup() {
    rm -rf "$WORK"
    undo_huge
}
trap cleanup EXIT
free_huge_pages() { awk '/^HugePages_Free:/ {print $2}' /proc/meminfo; }
setup_huge() { # 0 when /mnt/hugepages is ready with 1000 free pages; else HUGE_WHY says why
    if [ "$(id -u)" != 0 ]; then HUGE_WHY="not root"; return 1; fi
    local before
    if ! before="$(cat /proc/sys/vm/nr_hugepages 2>/dev/null)"; then
        HUGE_WHY="no /proc/sys/vm/nr_hugepages"; return 1
    fi
    if [ ! -e /mnt/hugepages ]; then
        if ! mkdir /mnt/hugepages 2>/dev/null; then HUGE_WHY="cannot create /mnt/hugepages"; return 1; fi
        HUGE_MADE_DIR=1
    fi
    if ! mount -t hugetlbfs none /mnt/hugepages 2>/dev/null; then
        if [ -n "$HUGE_MADE_DIR" ]; then rmdir /mnt/hugepages 2>/dev/null || true; fi
        HUGE_WHY="cannot mount hugetlbfs"; return 1
    fi
    HUGE_UNDO="$before"
    # After a build the memory is mostly page cache, fragmented: the kernel may find only a few
    # hundred 2 MiB pages (seen in CI: 417). Then compact, and then drop clean caches, and ask
    # again (both cost the machine only re-reads of cached files).
    local free attempt
    for attempt in ask compact drop; do
        case "$attempt" in
            compact) echo 1 2>/dev/null >/proc/sys/vm/compact_memory || true ;;
            drop) sync; echo 3 2>/dev/null >/proc/sys/vm/drop_caches || true
                  echo 1 2>/dev/null >/proc/sys/vm/compact_memory || true ;;
        esac
        echo $((before + 1000)) 2>/dev/null >/proc/sys/vm/nr_hugepages || true
        free="$(free_huge_pages)"
        if [ "${free:-0}" -ge 1000 ]; then return 0; fi
    done
    HUGE_WHY="only ${free:-0} free 2 MiB pages after asking the kernel for 1000 more"
    undo_huge
    return 1
}
HUGE="${VOVP_PLASMA_HUGEPAGES:-auto}"
if [ "$HUGE" != 0 ]; then
    # One run at a time on a machine: another's cleanup must not unmount the pages under us.
    exec 9>"${TMPDIR:-/tmp}/vovp-plasma-conformance.lock"
    flock 9
fi
# A hugetlbfs already mounted there (the machine's own) is used as it is.
if [ "$HUGE" != 0 ] && ! mountpoint -q /mnt/hugepages 2>/dev/null; then
    if setup_huge; then
        echo "plasma-conformance: $(free_huge_pages) free huge pages on /mnt/hugepages" >&2
    elif [ "$HUGE" = 1 ]; then
        echo "plasma-conformance: VOVP_PLASMA_HUGEPAGES=1 but huge pages cannot be set up: $HUGE_WHY" >&2
        exit 1
    else
        echo "plasma-conformance: huge pages cannot be reserved here ($HUGE_WHY): test_use_huge_pages skips itself" >&2
    fi
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
