#!/usr/bin/env bash
# The wheel as a user gets it: build it (maturin, release, through the package's own build
# backend so that vovp-engine and vovp ride in it), report its platform tag, install it into a
# fresh venv outside the checkout, then run the seed's program (examples/seed.py) there with no
# cargo on PATH and nothing of the checkout reachable: against (a) the wheel's `vovp-engine` run
# by hand and (b) a store started with `vovp.start_store`. Also `python -m vovp --help`.
#
# torch comes from pip's cache (the test venv installed it first). Prints what it checked;
# exits non-zero on the first failure.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
WORK="$(mktemp -d /tmp/vovp-wheel-test.XXXXXX)"
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK"' EXIT

echo "== build the wheel"
TOOLS="$WORK/tools"
python3 -m venv "$TOOLS"
"$TOOLS/bin/pip" install --quiet "maturin>=1.5,<2"
# The backend's staging step (the daemon and the CLI), then maturin itself, which checks the
# extension's symbols against the manylinux policies and tags the wheel.
"$TOOLS/bin/python" -c "import sys; sys.path.insert(0, 'python/build_backend'); \
import vovp_build; print('staged:', *vovp_build.stage_binaries())"
(cd python && "$TOOLS/bin/maturin" build --release --out "$WORK/dist" 2>&1 | tail -3)
WHEEL="$(ls "$WORK"/dist/vovp-*.whl)"
echo "wheel: $(basename "$WHEEL")"
case "$(basename "$WHEEL")" in
    *manylinux_2_*) ;;
    *) echo "FAIL: no manylinux tag on $(basename "$WHEEL")"; exit 1 ;;
esac
# The binaries' newest glibc symbol must not exceed the tag's.
TAG_GLIBC="$(basename "$WHEEL" | sed -E 's/.*manylinux_([0-9]+)_([0-9]+).*/\1.\2/')"
"$TOOLS/bin/python" - "$WHEEL" "$TAG_GLIBC" <<'PY'
import re, subprocess, sys, tempfile, zipfile
wheel, tag = sys.argv[1], tuple(map(int, sys.argv[2].split(".")))
with tempfile.TemporaryDirectory() as d, zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if "/scripts/" not in name:
            continue
        path = z.extract(name, d)
        syms = subprocess.run(["objdump", "-T", path], capture_output=True, text=True).stdout
        need = max((tuple(map(int, v.split("."))) for v in re.findall(r"GLIBC_([0-9.]+)", syms)),
                   default=(0,))
        print(f"{name.split('/')[-1]}: needs glibc {'.'.join(map(str, need))}")
        if need > tag:
            sys.exit(f"FAIL: {name} needs glibc {need}, newer than the wheel's tag {tag}")
PY

echo "== install into a fresh venv outside the checkout"
VENV="$WORK/venv"
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet "$WHEEL"
TORCH="$("$ROOT/.venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')"
"$VENV/bin/pip" install --quiet "torch==$TORCH"
cp examples/seed.py "$WORK/seed.py"
# No cargo, no checkout: PATH is the venv's and the system's; the working directory is $WORK.
CLEAN=(env -i HOME="$WORK" PATH="$VENV/bin:/usr/bin:/bin" LANG=C.UTF-8)
if "${CLEAN[@]}" bash -c 'command -v cargo' >/dev/null; then
    echo "FAIL: cargo is reachable"; exit 1
fi
for exe in vovp-engine vovp; do
    [ -x "$VENV/bin/$exe" ] || { echo "FAIL: the wheel installed no $exe"; exit 1; }
done
(cd "$WORK" && "${CLEAN[@]}" python -m vovp --help | grep -q "put-tensor") ||
    { echo "FAIL: python -m vovp --help"; exit 1; }

echo "== (a) the seed against the wheel's vovp-engine"
(cd "$WORK" && "${CLEAN[@]}" vovp-engine -m 1G -s "$WORK/seed.sock" >"$WORK/engine.log" 2>&1 &)
for _ in $(seq 200); do [ -S "$WORK/seed.sock" ] && break; sleep 0.05; done
(cd "$WORK" && "${CLEAN[@]}" timeout 300 python seed.py "$WORK/seed.sock") | tee "$WORK/a.json"
pkill -f -- "-s $WORK/seed.sock" || true

echo "== (b) the seed against vovp.start_store"
# seed.py as a module, so the spawned processes find its functions.
cat >"$WORK/seed_started.py" <<'PY'
import seed
import vovp

if __name__ == "__main__":
    with vovp.start_store(memory="1G") as store:
        seed.main(store.socket)
PY
(cd "$WORK" && "${CLEAN[@]}" timeout 300 python seed_started.py) | tee "$WORK/b.json"

for f in a b; do
    "$VENV/bin/python" - "$WORK/$f.json" <<'PY'
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
# The other process got the same values at the same place in the store; the queue's tensor
# travelled through it.
assert r["get"]["values"] == r["put"]["values"] == [[1, 2, 3], [5, 4, 6]], r
assert r["get"]["where"] == r["put"]["where"], r
assert r["queue"]["through_store"] and r["queue"]["sum"] == float(sum(range(1 << 16))), r
print(sys.argv[1], "ok: same memory in both processes, queue through the store")
PY
done
echo "wheel test: PASS"
