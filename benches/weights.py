"""vovp-bench --weights: a weight-sync workload (issue 26, item 8). One writer publishes new
versions of a model's state (64 MiB and 256 MiB; 1 MiB and 16 MiB in quick mode) under one
name; N reader processes follow it, each holding the version it last read, and read the first
and the last 8 bytes of every version they get.

Variants, same sizes, same N readers, same writer state, run one after the other per size and
N (in this order, reversed for every other size and N: a slow stretch of a shared machine does
not always hit the same variant):
- ``replace``: vovp, the writer ``put_tensor(name, state, replace=True)``; readers wait with
  ``get_tensor(name, newer_than=version_of(held), timeout=...)``.
- ``delete+put``: vovp without versions: the writer ``delete(name)`` then ``put_tensor(name,
  state)``; a reader polls the name (every 1 ms while it still finds the version it holds) and,
  once the name is gone, waits for it with ``get_tensor(name, timeout=...)``: it recognises the
  new version by the tag in its first 8 bytes, as it must (versions count from 1 again after a
  delete).
- ``ray``: the writer ``ray.put``s the state and sends the ObjectRef to every reader, an actor,
  as the top-level argument of a method call (Ray's documented way to hand an object to a task:
  Ray resolves the ref before the call, and a numpy array comes out of the local object store
  zero-copy, as ``ray.get`` would give it). Each actor keeps the array until the next one.
  Skipped with ``--no-ray`` (the harness's ``--quick``: ``ray.init`` alone takes 20 s here).

Per variant, two phases on one name:
- latency: for each of ``--versions`` versions (after 3 untimed ones, see WARM) the writer
  waits until every reader has read the previous one and sleeps 10 ms (every reader is
  waiting again), then takes the time, replaces, and each reader takes the time right after
  it read the first 8 bytes of the new version. Reported: the median over versions and
  readers of (reader's first byte - start of the replace), and the median time of the
  writer's replace call itself.
- before the rows of a size, the writer puts and deletes 2 + (most readers) copies of the
  state at once, so that its arenas hold as many warm blocks of that size as its readers can
  make a name need (``warm_blocks``; the cost of a fresh one is measured by
  benches/fresh_pages.py).
- rate: the writer replaces back to back while the readers follow (they may skip versions):
  3 untimed versions (see WARM), then ``--versions`` timed ones; reported: replaces per second
  of the timed ones, and the writer's minor page faults over them. Ray's writer keeps at most
  2 versions' method calls unanswered (an actor cannot skip a call, and every queued call pins
  a version in Ray's store); vovp's writer never waits for readers.

Checks (any failure fails the run): the writer writes its version number into the first and
the last 8 bytes of each version; a reader that reads a version other than the expected one in
the latency phase, an older one than it holds in the rate phase, first and last tags that
differ (a torn version), or a vovp version number that does not match (``replace``), fails.

Clock: ``time.monotonic_ns`` (CLOCK_MONOTONIC, one clock for every process of the machine), so
the writer's and the readers' times subtract. Writes ``--out`` (JSON: results, checks, the
Markdown tables) and prints the tables.

    python benches/weights.py --engine target/release/vovp-engine [--mode quick|full] [--no-ray]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import resource
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))  # the working tree's client first (readers inherit it)

MiB = 1 << 20

MODES = {
    # CI: both put paths (1 MiB goes through a lend, 16 MiB through CREATE + SEAL), 2 readers.
    "quick": dict(sizes=[MiB, 16 * MiB], readers=[2], versions=8, memory="256M"),
    "full": dict(sizes=[64 * MiB, 256 * MiB], readers=[2, 4], versions=20, memory="2G"),
}
VARIANTS = ("replace", "delete+put", "ray")
SETTLE_S = 0.010  # before each timed version: every reader is back in its wait
POLL_S = 0.001  # delete+put readers: how often they look whether the name went away
WAIT_S = 60.0  # any wait longer than this is a failure (a hung store must not hang the run)
RAY_WINDOW = 2  # Ray's writer: versions whose method calls may be unanswered at once
# Untimed versions first, in each phase: each store's first objects of a size take fresh pages
# (vovp backs them at create, Ray's store at its first writes), and the readers' first gets of a
# version map its memory; the figures are of the steady state. Each phase warms up by itself:
# back to back, the writer runs ahead of its readers, so more versions live at once than in the
# latency phase's lock step (a reader still holds the version before last while the writer
# writes the next: three blocks of the state, where the lock step needs two). The first time a
# name needs one more block, its pages are fresh: at 256 MiB, 65,536 first-touch faults, 110 ms
# against a 13 ms copy into warm pages on an idle machine here, 450-730 ms on a loaded one.
# Without the rate phase's own warm-up, that one-time cost fell on whichever variant ran its
# rate phase first and halved its rate (BENCHMARKS.md, "Weight sync (versions)"). A reader that
# falls one version further behind later still grows the set by one, so before the rows of a
# size the writer's arenas are also given as many warm blocks as its readers can make a name
# need (``warm_blocks``), for both vovp variants alike; Ray's store has its own memory warm.
WARM = 3


def log(msg):
    print(f"weights: {msg}", file=sys.stderr, flush=True)


def tag(state, version):
    """The writer's mark: ``version`` in the first and the last 8 bytes."""
    state[:8].view(np.int64)[0] = version
    state[-8:].view(np.int64)[0] = version


def read_tags(arr):
    """(first tag, time right after reading it, last tag): the reader's first byte."""
    first = int(arr[:8].view(np.int64)[0])
    t = time.monotonic_ns()
    return first, t, int(arr[-8:].view(np.int64)[0])


class Torn(Exception):
    """A reader read something it must not have."""


def check_tags(first, last, lo, hi, what):
    if first != last:
        raise Torn(f"{what}: torn version, first tag {first}, last tag {last}")
    if not lo <= first <= hi:
        raise Torn(f"{what}: read version {first}, expected {lo}..{hi}")


# --- vovp readers: processes of their own, reused across sizes and variants --------------------


def vovp_reader(rid, socket, commands, results):
    """Runs ("run", variant, name, latency versions, rate versions) commands until None;
    reports on ``results``:
    ("ready", rid), ("ack", rid, version, t_first_byte) per latency version, then
    ("done", rid, [(version, t_first_byte), ...]) for the rate phase, or ("error", rid, text)."""
    import vovp

    c = vovp.init_client(socket)
    while True:
        cmd = commands.get()
        if cmd is None:
            return
        _, variant, name, timed, rate = cmd
        try:
            follow(c, vovp, rid, variant, name, timed, rate, results)
        except Exception as e:  # noqa: BLE001  (reported to the writer, which fails the run)
            results.put(("error", rid, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def follow(c, vovp, rid, variant, name, timed, rate, results):
    held = c.get_tensor(name, timeout=WAIT_S)
    first, _, last = read_tags(held)
    check_tags(first, last, 0, 0, f"reader {rid}, first get")
    results.put(("ready", rid))
    last_version = timed + rate
    seen = []
    prev = 0
    while prev < last_version:
        if variant == "replace":
            new = c.get_tensor(name, newer_than=vovp.version_of(held), timeout=WAIT_S)
            first, t, last = read_tags(new)
        else:
            # No versions: poll until the name stops giving the version held, then wait for it
            # to come back (a get with a timeout waits for a missing name).
            while True:
                new = c.get_tensor(name, timeout=WAIT_S)
                first, t, last = read_tags(new)
                if first != prev:
                    break
                del new
                time.sleep(POLL_S)
        latency_phase = prev < timed
        lo, hi = (prev + 1, prev + 1) if latency_phase else (prev + 1, last_version)
        check_tags(first, last, lo, hi, f"reader {rid}")
        if variant == "replace" and vovp.version_of(new) != first + 1:
            raise Torn(f"reader {rid}: tag {first} in vovp version {vovp.version_of(new)}")
        # Hold the new version, let the old one go (a replace's old version lives on with us).
        held = new
        del new
        prev = first
        if latency_phase:
            results.put(("ack", rid, first, t))
        else:
            seen.append((first, t))
    del held
    results.put(("done", rid, seen))


class VovpReaders:
    def __init__(self, socket, n):
        ctx = mp.get_context("spawn")  # a fresh interpreter: no client state forked
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(n)]
        self.procs = [ctx.Process(target=vovp_reader, args=(i, socket, q, self.results),
                                  daemon=True) for i, q in enumerate(self.commands)]
        for p in self.procs:
            p.start()

    def expect(self, kind, n):
        """The next ``n`` messages, which must be of ``kind`` (a reader's error raises)."""
        out = []
        while len(out) < n:
            try:
                msg = self.results.get(timeout=WAIT_S)
            except queue.Empty:
                raise Torn(f"no {kind!r} from a reader within {WAIT_S} s") from None
            if msg[0] == "error":
                raise Torn(f"reader {msg[1]} failed: {msg[2]}")
            if msg[0] != kind:
                raise Torn(f"expected {kind!r} from the readers, got {msg[:3]}")
            out.append(msg)
        return out

    def close(self):
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def warm_blocks(client, state, blocks):
    """Puts ``blocks`` copies of ``state`` at once, then deletes them: the writer's arenas
    then hold that many blocks of the state's size whose pages it touched, as many as its
    readers can make a name need at once (the current version, the new one, and one older
    version per reader that falls behind). Without it, the first vovp variant at a size pays
    for each block its readers' lag adds (65,536 first-touch faults per 256 MiB block, see
    WARM) and the next variant finds them warm: the rate of whichever ran first suffers."""
    names = [f"weights-warm-{i}" for i in range(blocks)]
    for name in names:
        client.put_tensor(name, state)
    for name in names:
        client.delete(name)


def minor_faults():
    """This process's minor page faults so far (first touches of pages, ours or fresh)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def run_vovp(client, readers, variant, state, n, versions, key):
    name = f"weights-{key}"
    tag(state, 0)
    client.put_tensor(name, state)
    if variant == "replace":
        def replace():
            client.put_tensor(name, state, replace=True)
    else:
        def replace():
            client.delete(name)
            client.put_tensor(name, state)
    timed = WARM + versions
    for q in readers.commands[:n]:
        q.put(("run", variant, name, timed, WARM + versions))
    readers.expect("ready", n)
    latency, writer = [], []
    for v in range(1, timed + 1):
        time.sleep(SETTLE_S)
        tag(state, v)
        t0 = time.monotonic_ns()
        replace()
        t1 = time.monotonic_ns()
        for _, _, got, t in readers.expect("ack", n):
            if got != v:
                raise Torn(f"ack of version {got} while {v} was the newest")
            if v > WARM:
                latency.append(t - t0)
        if v > WARM:
            writer.append(t1 - t0)
    for v in range(timed + 1, timed + WARM + 1):
        tag(state, v)
        replace()
    first_timed = timed + WARM + 1
    faults = minor_faults()
    t0 = time.monotonic_ns()
    for v in range(first_timed, first_timed + versions):
        tag(state, v)
        replace()
    elapsed = time.monotonic_ns() - t0
    faults = minor_faults() - faults
    seen = sum(1 for msg in readers.expect("done", n) for tag_read, _ in msg[2]
               if tag_read >= first_timed)
    client.delete(name)
    return latency, writer, versions / (elapsed / 1e9), seen, faults


# --- Ray ---------------------------------------------------------------------------------------


def start_ray(n, store_bytes):
    import ray

    # address="local": a cluster of our own, never one found running on the machine.
    ray.init(address="local", num_cpus=n, object_store_memory=store_bytes,
             include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Reader:
        """Holds the version it got last; answers each call with its first byte's time."""

        def __init__(self):
            self.held = None

        def ready(self):
            return True

        def update(self, arr, expected):
            first, t, last = read_tags(arr)
            check_tags(first, last, expected, expected, "Ray reader")
            self.held = arr
            return first, t

        def drop(self):
            self.held = None

    readers = [Reader.remote() for _ in range(n)]
    ray.get([r.ready.remote() for r in readers])
    return ray, readers


def run_ray(ray, actors, state, n, versions):
    actors = actors[:n]
    tag(state, 0)
    ref = ray.put(state)
    ray.get([a.update.remote(ref, 0) for a in actors])
    del ref
    latency, writer = [], []
    timed = WARM + versions
    for v in range(1, timed + 1):
        time.sleep(SETTLE_S)
        tag(state, v)
        t0 = time.monotonic_ns()
        ref = ray.put(state)
        calls = [a.update.remote(ref, v) for a in actors]
        t1 = time.monotonic_ns()
        del ref
        for _, t in ray.get(calls, timeout=WAIT_S):
            if v > WARM:
                latency.append(t - t0)
        if v > WARM:
            writer.append(t1 - t0)
    pending = []
    first_timed = timed + WARM + 1
    for v in range(timed + 1, first_timed + versions):
        if v == first_timed:
            faults = minor_faults()
            t0 = time.monotonic_ns()
        if len(pending) >= RAY_WINDOW:
            ray.get(pending.pop(0), timeout=WAIT_S)
        tag(state, v)
        ref = ray.put(state)
        pending.append([a.update.remote(ref, v) for a in actors])
        del ref
    for calls in pending:
        ray.get(calls, timeout=WAIT_S)
    elapsed = time.monotonic_ns() - t0
    faults = minor_faults() - faults
    ray.get([a.drop.remote() for a in actors])
    return latency, writer, versions / (elapsed / 1e9), versions * n, faults


# --- report ------------------------------------------------------------------------------------


def ms(ns):
    return ns / 1e6


def markdown(rows, variants):
    def cell(r, v, k, fmt):
        x = r.get(v, {}).get(k)
        return "-" if x is None else fmt.format(x)

    def ratio(r, v, k):
        a, b = r.get("replace", {}).get(k), r.get(v, {}).get(k)
        return "-" if a is None or b is None else f"{a / b:.2f}x"

    peers = [v for v in variants if v != "replace"]

    def table(title, key, fmt, aside, aside_fmt, suffix="", ratios=True):
        """A markdown table: ``key`` per variant (``aside`` in parentheses), then (with
        ``ratios``) the ratios of replace to each peer."""
        shown = peers if ratios else []
        lines = ["", title, "",
                 "| state | readers | " + " | ".join(variants)
                 + "".join(f" | replace / {p}" for p in shown) + " |",
                 "|---|---|" + "---|" * (len(variants) + len(shown))]
        for r in rows:
            cells = [f"{cell(r, v, key, fmt)} ({cell(r, v, aside, aside_fmt)}{suffix})"
                     for v in variants]
            lines.append(f"| {r['size'] // MiB} MiB | {r['readers']} | " + " | ".join(cells)
                         + "".join(f" | {ratio(r, p, key)}" for p in shown) + " |")
        return lines

    out = table("Time from the start of the writer's replace to each reader's first byte, ms "
                "(median over versions and readers; the writer's own replace call in "
                "parentheses); ratio = replace / peer, lower favours replace:",
                "latency_ms", "{:.2f}", "writer_ms", "{:.2f}")
    out += table("Writer's replaces per second with the readers following (in parentheses: the "
                 "share of the versions the readers read; they may skip); ratio = replace / "
                 "peer, higher favours replace:", "rate_per_s", "{:.1f}", "rate_read_pct", "{:.0f}", " %")
    out += table("The writer's minor page faults over the timed replaces of the rate phase "
                 "(in parentheses: per version); 65,536 are one 256 MiB version written into "
                 "fresh pages:", "rate_writer_faults", "{:.0f}", "rate_faults_per_version",
                 "{:.0f}", ratios=False)
    targets = rate_targets(rows)
    if targets:
        out += ["", "Targets (issue 44 item 8, the rate at 256 MiB):", ""]
        out += [f"- {t['name']}: {t['ratio']:.2f}x, {'PASS' if t['ok'] else 'FAIL'}"
                for t in targets]
    return "\n".join(out[1:]) + "\n"


# Issue 44 item 8: at 256 MiB a replace runs at least as fast as delete + put, and at 1.5x Ray.
RATE_TARGETS = (("delete+put", 1.0), ("ray", 1.5))


def rate_targets(rows):
    """Per 256 MiB row and peer: replace's rate over the peer's against its bound."""
    out = []
    for r in rows:
        if r["size"] != 256 * MiB or "replace" not in r:
            continue
        for peer, bound in RATE_TARGETS:
            if peer in r:
                ratio = r["replace"]["rate_per_s"] / r[peer]["rate_per_s"]
                out.append(dict(name=f"replace / {peer}, 256 MiB, {r['readers']} readers "
                                     f">= {bound:.1f}x", ratio=ratio, ok=ratio >= bound))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default=str(REPO / "target" / "release" / "vovp-engine"))
    ap.add_argument("--mode", choices=sorted(MODES), default="full")
    ap.add_argument("--no-ray", action="store_true", help="only the vovp variants")
    ap.add_argument("--versions", type=int, help="versions per phase (default: the mode's)")
    ap.add_argument("--out", default=str(REPO / "target" / "bench" / "weights.json"))
    args = ap.parse_args()
    cfg = MODES[args.mode]
    versions = args.versions or cfg["versions"]
    variants = [v for v in VARIANTS if not (args.no_ray and v == "ray")]

    # The daemon this script starts, whichever vovp-engine a PATH or a venv would give.
    os.environ["VOVP_ENGINE_BIN"] = str(Path(args.engine).resolve())
    import vovp

    log(f"vovp from {Path(vovp.__file__).parent}, daemon {args.engine}, mode {args.mode}, "
        f"variants {', '.join(variants)}, {versions} versions per phase")
    checks, rows, error = [], [], None
    sock_dir = tempfile.mkdtemp(prefix="vwb-", dir="/tmp")
    store = vovp.start_store(memory=cfg["memory"], socket=os.path.join(sock_dir, "v.sock"))
    client = vovp.init_client(store.socket)
    readers = VovpReaders(store.socket, max(cfg["readers"]))
    ray = actors = None
    started = time.monotonic()
    try:
        if "ray" in variants:
            t = time.monotonic()
            # Room for the versions in flight: the actors' held ones, the window, the new one.
            ray, actors = start_ray(max(cfg["readers"]), 2 * max(cfg["sizes"]) * (RAY_WINDOW + 2))
            log(f"Ray up with {len(actors)} reader actors in {time.monotonic() - t:.1f} s")
        for size in cfg["sizes"]:
            # Written once, so that no variant pays for first-touch page faults of its source.
            state = np.arange(size, dtype=np.uint8)
            if any(v != "ray" for v in variants):
                warm_blocks(client, state, 2 + max(cfg["readers"]))
            for n in cfg["readers"]:
                row = {"size": size, "readers": n}
                order = variants if len(rows) % 2 == 0 else variants[::-1]
                for variant in order:
                    what = f"{variant}, {size // MiB} MiB, {n} readers"
                    try:
                        if variant == "ray":
                            lat, wr, rate, seen, faults = run_ray(ray, actors, state, n,
                                                                  versions)
                        else:
                            lat, wr, rate, seen, faults = run_vovp(
                                client, readers, variant, state, n, versions,
                                f"{variant}-{size}-{n}")
                    except Exception as e:  # noqa: BLE001  (a failed check, reported below)
                        checks.append(dict(name=f"weights: {what}", ok=False,
                                           detail=f"{type(e).__name__}: {e}"))
                        log(f"{what}: FAILED: {e}")
                        continue
                    row[variant] = dict(latency_ms=ms(statistics.median(lat)),
                                        writer_ms=ms(statistics.median(wr)), rate_per_s=rate,
                                        rate_versions_read=seen,
                                        rate_read_pct=100 * seen / (n * versions),
                                        rate_writer_faults=faults,
                                        rate_faults_per_version=faults / versions,
                                        latency_ns=lat, writer_ns=wr)
                    checks.append(dict(name=f"weights: {what}", ok=True,
                                       detail=f"{versions} versions read by each reader, every "
                                              f"tag as expected; {seen} read in the rate phase"))
                    log(f"{what}: first byte {row[variant]['latency_ms']:.2f} ms after the "
                        f"replace started (writer {row[variant]['writer_ms']:.2f} ms), "
                        f"{rate:.1f} replaces/s ({faults} minor faults in the writer)")
                rows.append(row)
            del state
    except Exception as e:  # noqa: BLE001  (recorded in the JSON; the harness fails the run)
        error = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        log(error)
    finally:
        readers.close()
        client.close()
        store.stop()
        if ray is not None:
            ray.shutdown()
    table = markdown(rows, variants)
    log(f"done in {time.monotonic() - started:.0f} s")
    out = dict(mode=args.mode, versions=versions, variants=variants, results=rows,
               targets=rate_targets(rows),
               checks=checks, markdown=table, error=error,
               clock="time.monotonic_ns (CLOCK_MONOTONIC)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print()
    print(table)
    failed = error is not None or not all(c["ok"] for c in checks)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
