"""The cost of backing a create's pages (issue 14): two daemons side by side, one backing every
create (the default) and one with --lazy-pages, driven alternately so that the machine's drift
hits both alike. Each repetition uses a new client, hence a new arena: fresh pages, the case
where backing costs something (pages a freed object left warm cost nothing).

    cargo build --release --workspace --bins
    python benches/fresh_pages.py          # any venv with numpy; the client comes from python/

Prints, per size, the median CREATE round trip (the daemon's fallocate is in it) and the median
whole put (create, fill, seal) of each daemon, and the ratio of the whole puts; then the same
put again on the same client right after the first was deleted (its freed block, whose pages
the client touched already: warm), and how many times a put into fresh pages costs that. This
is what a writer pays each time a name it replaces needs one more block than before (a reader
still holds the version before last: BENCHMARKS.md, "Weight sync (versions)").
"""
import os
import statistics as st
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
import numpy as np  # noqa: E402
import vovp  # noqa: E402

ENGINE = os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")),
                      "release", "vovp-engine")
SIZES = [(1 << 20, 40), (16 << 20, 15), (256 << 20, 7)]


def main():
    tmp = tempfile.mkdtemp(prefix="vovp-fresh-")
    daemons = {}
    for kind, extra in [("backed", []), ("lazy", ["--lazy-pages"])]:
        sock = os.path.join(tmp, f"{kind}.sock")
        daemons[kind] = (subprocess.Popen(
            [ENGINE, "-m", "1G", "-s", sock, "--log-level", "warn"] + extra), sock)
    deadline = time.time() + 20
    while not all(os.path.exists(s) for _, s in daemons.values()) and time.time() < deadline:
        time.sleep(0.05)
    res = {}
    try:
        for size, reps in SIZES:
            src = np.full(size, 7, dtype=np.uint8)
            for rep in range(reps + 1):  # rep 0 is a warm-up, not counted
                for kind in (["backed", "lazy"] if rep % 2 else ["lazy", "backed"]):
                    c = vovp.Client(daemons[kind][1])
                    t0 = time.perf_counter()
                    buf = c.create(f"o{rep}", size)
                    t1 = time.perf_counter()
                    np.copyto(buf, src)
                    c.seal(f"o{rep}")
                    t2 = time.perf_counter()
                    del buf
                    c.delete(f"o{rep}")
                    # Again into the block just freed: its pages are warm.
                    t3 = time.perf_counter()
                    buf = c.create(f"w{rep}", size)
                    np.copyto(buf, src)
                    c.seal(f"w{rep}")
                    t4 = time.perf_counter()
                    del buf
                    c.delete(f"w{rep}")
                    c.close()
                    if rep:
                        res.setdefault((size, kind), []).append((t1 - t0, t2 - t0, t4 - t3))
        for size, _ in SIZES:
            (cb, pb, wb), (cl, pl, _) = [
                tuple(st.median(x[i] for x in res[size, k]) * 1e3 for i in range(3))
                for k in ("backed", "lazy")]
            print(f"{size >> 20:4} MiB of fresh pages: create {cb:8.3f} ms backed, {cl:8.3f} ms "
                  f"lazy; whole put {pb:8.2f} ms backed, {pl:8.2f} ms lazy ({pb / pl:.2f}x); "
                  f"into warm pages {wb:8.2f} ms (fresh backed / warm {pb / wb:.1f}x)")
    finally:
        for p, _ in daemons.values():
            p.terminate()
            p.wait()


if __name__ == "__main__":
    main()
