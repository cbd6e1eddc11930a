"""vovp against every peer, side by side in one run (benchmark driver's ``peers`` workload).

Run by ``benches/driver.py`` (``--only peers``, ``--peers LIST``); the harness turns what
``run`` returns into the table "vovp against every peer" (benches/src/report.rs) and its plot
(benches/plot.py, target/bench/peers.png).

Columns ("stores"), each driven through its fastest documented Python path:

- ``vovp``: ``put_tensor`` / ``get_tensor`` of a numpy array (the typed calls users make);
  ``vovp_torch`` the same with a torch tensor; ``vovp_raw``: ``put`` / ``get_buffer`` of the
  same bytes (no dtype, no shape).
- ``plasma``: pyarrow 11's ``put_raw_buffer`` / ``get_buffers`` (Plasma's fastest put: its own
  multi-threaded memcpy).
- ``ray``: ``ray.put`` / ``ray.get`` (numpy arrays come back zero-copy from Ray's object store);
  delete = dropping the ObjectRef. Ray has no wait-by-name, so its hand-off is the documented
  one: the ObjectRef passed to a method of an actor in another process (Ray resolves it before
  the call).
- ``vineyard``: ``client.put`` / ``client.get`` of the numpy array (a Tensor object: blob plus
  metadata); ``vineyard_blob``: ``create_blob`` + copy + ``seal`` / ``get_blob`` (Vineyard's raw
  bytes, its analogue of vovp's raw calls). Hand-off by name: the writer ``persist``s and
  ``put_name``s, the reader waits in ``get_name(name, wait=True)`` and then gets the object
  (blobs take no part: vineyardd refuses to persist a blob, and only persistent objects take
  a name).
  ``vineyardd --meta=local`` is started here, from the vineyard-bdist package.
- ``shm``: ``multiprocessing.shared_memory``: put = ``SharedMemory(create=True)`` + copy into
  an ndarray over ``.buf``; get = attach by name + ndarray with dtype and shape passed by hand;
  delete = close + unlink. No wait-by-name: the hand-off sends the name through a Pipe.
- ``torch_mp``: ``torch.multiprocessing``: put = ``share_memory_()`` of a fresh tensor (the copy
  its Queue makes); hand-off = a fresh tensor through a ``torch.multiprocessing`` Queue (no get
  by name, no get latency).

Every store runs in the same repetitions, in an order that changes with each repetition so
that, over the rows of a Williams design (n repetitions for n stores, 2n when n is odd), every
store runs first once and right after every other store equally often (``ordered``). A
rotation, used before, kept each store's predecessor the same in all repetitions but one, so
what a store leaves behind (its daemon still working, a GiB just freed) fell on one column
every time; a seeded shuffle after it left chance imbalances in a fixed pattern
(benches/FINDINGS.md, finding 18). All ops are timed in one process (A); the
hand-off's reader (B) is one spawned process that holds a client of every store.
"""

from __future__ import annotations

import gc
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

import numpy as np

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

MODES = {
    "quick": dict(ops=400, ops_reps=3, put=[(MiB, 5), (16 * MiB, 3), (256 * MiB, 3)],
                  getlat=[(MiB, 60)], handoff=[(MiB, 8), (64 * MiB, 3)], batch=64, batch_reps=20,
                  pair=512, pair_reps=5),
    "full": dict(ops=3000, ops_reps=9, put=[(MiB, 40), (16 * MiB, 20), (256 * MiB, 9), (GiB, 9)],
                 getlat=[(MiB, 400)], handoff=[(MiB, 40), (64 * MiB, 15)], batch=64,
                 batch_reps=200, pair=2048, pair_reps=15),
}

# --peers names -> the columns they bring. vovp's columns are always there.
PEER_NAMES = {
    "plasma": ["plasma"],
    "ray": ["ray"],
    "vineyard": ["vineyard", "vineyard_blob"],
    "shm": ["shm"],
    "torch": ["torch_mp"],
}
VOVP_COLUMNS = ["vovp", "vovp_torch", "vovp_raw"]
# Not a store: the limit a large put approaches, measured in the same repetitions as the puts
# (the machine's copy speed drifts between phases of a run, so a limit from the Rust pass
# minutes earlier is no yardstick for them). Only in the "put" workload.
LIMIT_COLUMNS = ["memcpy"]

LABELS = {
    "vovp": "vovp put_tensor/get_tensor (numpy)",
    "vovp_torch": "vovp put_tensor/get_tensor (torch)",
    "vovp_raw": "vovp put/get_buffer (raw)",
    "plasma": "Plasma",
    "ray": "Ray",
    "vineyard": "Vineyard",
    "vineyard_blob": "Vineyard blob",
    "shm": "shared_memory",
    "torch_mp": "torch.multiprocessing",
    "memcpy": "memcpy limit",
}

WHAT = {
    "vovp": "put_tensor(name, ndarray) / get_tensor(name) + read a[0]; handoff: "
            "get_tensor(name, timeout)",
    "vovp_torch": "put_tensor(name, tensor) / get_tensor(name) + read t[0]",
    "vovp_raw": "put(name, buffer) / get_buffer(name) + read mv[0]",
    "plasma": "put_raw_buffer / get_buffers + read first byte; handoff: get_buffers(timeout_ms)",
    "ray": "ray.put(ndarray) / ray.get(ref) + read a[0]; delete = del ref; handoff: ray.put, "
           "ref passed to an actor method in another process",
    "vineyard": "client.put(ndarray) / client.get(id) + read a[0]; handoff: put + persist + "
                "put_name / get_name(wait=True) + get",
    "vineyard_blob": "create_blob + copy + seal / get_blob + read first byte; no hand-off "
                     "(a blob cannot be persisted, so it cannot be named)",
    "shm": "SharedMemory(create) + copy / attach by name + ndarray(shape, dtype) + read a[0]; "
           "delete = close + unlink; handoff: name sent through a Pipe",
    "torch_mp": "share_memory_() of a fresh tensor; handoff: fresh tensor through a "
                "torch.multiprocessing Queue; no get by name",
    "memcpy": "not a store: vovp.copy_into (put_tensor's parallel copy) of the array into "
              "an anonymous shared mapping made once per size and kept (its pages warm; "
              "not the store's memory), timed like a put; large puts only",
}

# Stores that only take part in some workloads: torch.multiprocessing has no get (and no
# store of 64 B objects to count op/s in); Vineyard refuses to persist a blob, and only
# persistent objects take a name, so blobs cannot be waited for by name.
NO_GET = {"torch_mp"}
NO_NAME = {"vineyard_blob"}


def now():
    return time.perf_counter_ns()


def log(msg):
    print(f"driver: peers: {msg}", file=sys.stderr, flush=True)


def size_label(n):
    for unit, div in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def put_back_to_back(c, n, reps, block=16):
    """64 B numpy ``put_tensor`` against raw ``put`` of the same array on client ``c``, back to
    back in one loop (issue 48, item 7): each round puts `n` of each, in blocks of `block`
    that alternate (which kind goes first alternates too), each block timed on its own, so
    both kinds see the same state of the store, the client and the machine. Both return
    before the store's answer; each round ends with ``sync()`` and the deletes, untimed.
    Returns (put_tensor op/s, put op/s), one of each per round."""
    arr = make_array(64, seed=5)
    typed, raw = [], []
    for rep in range(reps):
        names = [(f"pair-{rep}-t{i}", f"pair-{rep}-r{i}") for i in range(n)]
        blocks = [([t for t, _ in names[i:i + block]], [r for _, r in names[i:i + block]])
                  for i in range(0, n, block)]
        spent = [0, 0]
        for k, (typed_names, raw_names) in enumerate(blocks):
            for kind in ((0, 1) if (k + rep) % 2 == 0 else (1, 0)):
                if kind == 0:
                    t0 = now()
                    for nm in typed_names:
                        c.put_tensor(nm, arr)
                    spent[0] += now() - t0
                else:
                    t0 = now()
                    for nm in raw_names:
                        c.put(nm, arr)
                    spent[1] += now() - t0
        c.sync()
        typed.append(n / (spent[0] / 1e9))
        raw.append(n / (spent[1] / 1e9))
        for t, r in names:
            c.delete(t)
            c.delete(r)
    return typed, raw


def make_array(size, seed=1):
    """float32 values 0..250 (exact in float32, never NaN) of `size` bytes: a 1 MiB block
    repeated (cheap to build for 1 GiB)."""
    n = size // 4
    block = ((np.arange(min(n, MiB // 4), dtype=np.int64) * 7 + seed) % 251).astype(np.float32)
    return np.resize(block, n)


def expected(arr, typed):
    """(first, last) a get returns: elements for typed stores, bytes for raw ones."""
    if typed:
        return float(arr[0]), float(arr[-1])
    b = arr.view(np.uint8)
    return int(b[0]), int(b[-1])


# --- adapters ------------------------------------------------------------------------------------
# put(k, arr): store `arr` under key k; get(k): the get, a read of the first element (byte for
# raw stores) and the release of what the get returned; ends(k): (first, last) for the checks;
# delete(k). Keys come from key(name), made before any timed loop.


# vovp's columns are three ways of calling one store from one process, so they share one
# client, as vovp documents (one per process): with a client each, each column's puts went to
# an arena of its own, and three warm 1 GiB arenas do not fit a 2 GiB store, so every 1 GiB
# put took fresh pages (1.7 GB/s) where one client reuses the freed arena (peers are one store
# each, one client each). Closed with its last column.
_VOVP_CLIENTS: dict = {}


def vovp_client(sock):
    import vovp

    entry = _VOVP_CLIENTS.get(sock)
    if entry is None:
        entry = _VOVP_CLIENTS[sock] = [vovp.init_client(sock), 0]
    entry[1] += 1
    return entry[0]


def vovp_client_done(sock):
    entry = _VOVP_CLIENTS.get(sock)
    if entry is not None:
        entry[1] -= 1
        if entry[1] <= 0:
            del _VOVP_CLIENTS[sock]
            entry[0].close()


class VovpTyped:
    typed = True

    def __init__(self, sock, torch_input=False):
        if torch_input:
            import torch  # noqa: F401 (no torch: this column is reported as not run)
        self.sock = sock
        self.c = vovp_client(sock)
        self.torch = torch_input
        self.framework = "torch" if torch_input else "numpy"

    def key(self, name):
        return name

    def conv(self, arr):
        if self.torch:
            import torch

            return torch.from_numpy(arr)
        return arr

    def put(self, k, arr):
        self.c.put_tensor(k, arr)

    def get(self, k, timeout=None):
        t = self.c.get_tensor(k, timeout=timeout)
        x = t[0]
        del t
        return x

    def ends(self, k):
        t = self.c.get_tensor(k, framework="numpy")
        return float(t[0]), float(t[-1])

    def delete(self, k):
        self.c.delete(k)

    def close(self):
        vovp_client_done(self.sock)


class WarmCopy:
    """The memcpy limit column: what a large put's copy costs with nothing of a store around
    it, into shared memory already faulted in (an anonymous shared mapping made once per size
    and kept: not the store's memory, so the stores' room is the same as without it)."""

    typed = False

    def __init__(self, sock):
        from vovp.client import copy_into  # what put_tensor copies with

        self.copy_into = copy_into
        self.dst = {}
        self.last = None

    def key(self, name):
        return name

    def conv(self, arr):
        return arr

    def put(self, k, arr):
        dst = self.dst.get(arr.nbytes)
        if dst is None:  # (first use: the untimed repetition faults its pages in)
            dst = np.frombuffer(mmap.mmap(-1, arr.nbytes), dtype=np.uint8)
            self.dst[arr.nbytes] = dst
        self.copy_into(dst.view(arr.dtype).reshape(arr.shape), arr)
        self.last = dst

    def ends(self, k):
        return int(self.last[0]), int(self.last[-1])

    def delete(self, k):
        pass

    def close(self):
        self.dst.clear()


class VovpRaw:
    typed = False

    def __init__(self, sock):
        self.sock = sock
        self.c = vovp_client(sock)

    def key(self, name):
        return name

    def conv(self, arr):
        return arr

    def put(self, k, arr):
        self.c.put(k, arr)

    def get(self, k, timeout=None):
        b = self.c.get_buffer(k, timeout=timeout)
        x = b[0]
        del b
        return x

    def ends(self, k):
        b = self.c.get_buffer(k)
        return b[0], b[-1]

    def delete(self, k):
        self.c.delete(k)

    def close(self):
        vovp_client_done(self.sock)


class Plasma:
    typed = False

    def __init__(self, sock):
        import pyarrow.plasma as plasma

        self.plasma = plasma
        self.c = plasma.connect(sock)

    def key(self, name):
        import hashlib

        return self.plasma.ObjectID(hashlib.sha1(name.encode()).digest())

    def conv(self, arr):
        return arr.view(np.uint8)  # put_raw_buffer takes len(), not nbytes

    def put(self, k, arr):
        self.c.put_raw_buffer(arr, object_id=k)

    def get(self, k, timeout=None):
        b = self.c.get_buffers([k], timeout_ms=0 if timeout is None else int(timeout * 1000))[0]
        if b is None:
            raise KeyError("plasma: object not found")
        mv = memoryview(b)
        x = mv[0]
        del mv, b
        return x

    def ends(self, k):
        mv = memoryview(self.c.get_buffers([k], timeout_ms=0)[0]).cast("B")
        return mv[0], mv[-1]

    def delete(self, k):
        self.c.delete([k])

    def close(self):
        self.c.disconnect()


class Ray:
    typed = True

    def __init__(self, capacity):
        import ray

        self.ray = ray
        # address="local": a cluster of our own. One CPU: the reader actor needs none, and Ray
        # must not start a worker per core on a small machine.
        ray.init(address="local", num_cpus=1, object_store_memory=capacity,
                 include_dashboard=False, log_to_driver=False,
                 _system_config={"automatic_object_spilling_enabled": False})

        @ray.remote(num_cpus=0)
        class Reader:
            def ready(self):
                return True

            def first(self, arr):
                x = arr[0]
                return time.perf_counter_ns(), float(x)

        self.reader = Reader.remote()
        ray.get(self.reader.ready.remote())
        self.refs = {}

    def key(self, name):
        return name

    def conv(self, arr):
        return arr

    def put(self, k, arr):
        self.refs[k] = self.ray.put(arr)

    def get(self, k, timeout=None):
        a = self.ray.get(self.refs[k])
        x = a[0]
        del a
        return x

    def ends(self, k):
        a = self.ray.get(self.refs[k])
        return float(a[0]), float(a[-1])

    def delete(self, k):
        del self.refs[k]

    def close(self):
        self.refs.clear()
        self.ray.shutdown()


def vineyardd_path():
    warnings.filterwarnings("ignore")  # vineyard 0.24 imports the deprecated pkg_resources
    import vineyard

    p = os.path.join(os.path.dirname(vineyard.__file__), "bdist", "vineyardd")
    if os.access(p, os.X_OK):
        return p
    found = shutil.which("vineyardd")
    if not found:
        raise RuntimeError("no vineyardd: install vineyard-bdist (benches/setup.sh does)")
    return found


class VineyardDaemon:
    """vineyardd --meta=local on a socket of its own, RPC off (no TCP port to collide on)."""

    def __init__(self, capacity, log_path):
        self.dir = tempfile.mkdtemp(prefix="vovp-v6d-")
        self.sock = os.path.join(self.dir, "vineyard.sock")
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [vineyardd_path(), f"--socket={self.sock}", "--meta=local", f"--size={capacity}",
             "--rpc=false"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not os.path.exists(self.sock):
            if self.proc.poll() is not None:
                raise RuntimeError(f"vineyardd exited with {self.proc.returncode} (see "
                                   f"{log_path})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"vineyardd did not open {self.sock} within 30 s")
            time.sleep(0.05)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class Vineyard:
    typed = True

    def __init__(self, sock):
        warnings.filterwarnings("ignore")
        import vineyard

        self.c = vineyard.connect(sock)
        self.ids = {}

    def key(self, name):
        return name

    def conv(self, arr):
        return arr

    def put(self, k, arr):
        self.ids[k] = self.c.put(arr)

    def get(self, k, timeout=None):
        a = self.c.get(self.ids[k])
        x = a[0]
        del a
        return x

    def ends(self, k):
        a = self.c.get(self.ids[k])
        return float(a[0]), float(a[-1])

    def delete(self, k):
        self.c.delete(self.ids.pop(k))

    # hand-off by name
    def put_named(self, name, arr):
        oid = self.c.put(arr)
        self.c.persist(oid)
        self.c.put_name(oid, name)
        self.ids[name] = oid

    def get_named(self, name):
        a = self.c.get(self.c.get_name(name, wait=True))
        x = a[0]
        del a
        return x

    def delete_named(self, name):
        self.c.drop_name(name)
        self.c.delete(self.ids.pop(name))

    def close(self):
        self.c.close()


class VineyardBlob(Vineyard):
    typed = False

    def put(self, k, arr):
        b = self.c.create_blob(arr.nbytes)
        np.frombuffer(memoryview(b), np.uint8)[:] = arr.view(np.uint8)
        self.ids[k] = b.seal(self.c).id

    def get(self, k, timeout=None):
        mv = memoryview(self.c.get_blob(self.ids[k]))
        x = mv[0]
        del mv
        return x

    def ends(self, k):
        mv = memoryview(self.c.get_blob(self.ids[k]))
        return mv[0], mv[-1]

    def put_named(self, name, arr):
        self.put(name, arr)
        oid = self.ids[name]
        self.c.persist(oid)
        self.c.put_name(oid, name)

    def get_named(self, name):
        mv = memoryview(self.c.get_blob(self.c.get_name(name, wait=True)))
        x = mv[0]
        del mv
        return x


class Shm:
    typed = True

    def __init__(self):
        from multiprocessing import shared_memory

        self.sm = shared_memory
        self.blocks = {}  # name -> (SharedMemory, shape, dtype)
        self.run = f"vb{os.getpid()}"

    def key(self, name):
        # POSIX shm names: short, no slashes.
        return f"{self.run}-{abs(hash(name)) % 10**12}"

    def conv(self, arr):
        return arr

    def put(self, k, arr):
        shm = self.sm.SharedMemory(name=k, create=True, size=arr.nbytes)
        np.ndarray(arr.shape, arr.dtype, buffer=shm.buf)[...] = arr
        self.blocks[k] = (shm, arr.shape, arr.dtype)

    def get(self, k, timeout=None):
        _, shape, dtype = self.blocks[k]  # dtype and shape passed by hand
        shm = self.sm.SharedMemory(name=k)
        a = np.ndarray(shape, dtype, buffer=shm.buf)
        x = a[0]
        del a
        shm.close()
        return x

    def ends(self, k):
        shm, shape, dtype = self.blocks[k]
        a = np.ndarray(shape, dtype, buffer=shm.buf)
        r = float(a[0]), float(a[-1])
        del a
        return r

    def delete(self, k):
        shm = self.blocks.pop(k)[0]
        shm.close()
        shm.unlink()

    def close(self):
        for k in list(self.blocks):
            self.delete(k)


class TorchMp:
    """torch.multiprocessing's sharing: put = share_memory_() of a fresh tensor."""

    typed = True

    def __init__(self):
        import torch

        self.torch = torch
        self.held = {}

    def key(self, name):
        return name

    def conv(self, arr):
        # A fresh (never shared) tensor per put, made before the clock starts.
        return self.torch.from_numpy(arr.copy())

    def put(self, k, t):
        self.held[k] = t.share_memory_()

    def ends(self, k):
        t = self.held[k]
        return float(t[0]), float(t[-1])

    def delete(self, k):
        del self.held[k]

    def close(self):
        self.held.clear()


# --- the reader process (hand-off's B) ------------------------------------------------------------


def reader_main(conn, tq, socks):
    """Opens a client of every store in `socks` and answers hand-off commands: "ready", then
    waits for the object in the store's own way, reads its first element, answers (time, x)."""
    warnings.filterwarnings("ignore")
    stores = {}
    try:
        for sid, sock in socks.items():
            stores[sid] = open_reader(sid, sock)
        conn.send(("ok", None))
    except Exception:  # noqa: BLE001
        conn.send(("error", traceback.format_exc()))
        return
    from multiprocessing import shared_memory

    while True:
        cmd = conn.recv()
        if cmd[0] == "exit":
            return
        _, sid, name = cmd
        try:
            conn.send(("ready", None))
            if sid == "shm":
                _, shm_name, shape, dtype = conn.recv()
                shm = shared_memory.SharedMemory(name=shm_name)
                a = np.ndarray(shape, dtype, buffer=shm.buf)
                x = a[0]
                t1 = now()
                del a
                shm.close()
            elif sid == "torch_mp":
                t = tq.get()
                x = t[0]
                t1 = now()
                x = float(x)
                del t
            elif sid in ("vineyard", "vineyard_blob"):
                x = stores[sid].get_named(name)
                t1 = now()
            else:
                x = stores[sid].get(stores[sid].key(name), timeout=10.0)
                t1 = now()
            conn.send(("ok", (t1, float(x))))
        except Exception:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))


def open_reader(sid, sock):
    if sid == "vovp" or sid == "vovp_torch":
        return VovpTyped(sock, sid == "vovp_torch")
    if sid == "vovp_raw":
        return VovpRaw(sock)
    if sid == "plasma":
        return Plasma(sock)
    if sid == "vineyard":
        return Vineyard(sock)
    if sid == "vineyard_blob":
        return VineyardBlob(sock)
    return None  # shm, torch_mp: nothing to open


class Reader:
    def __init__(self, socks):
        try:
            import torch.multiprocessing as tmp  # its Queue carries torch_mp's tensors
        except ImportError:
            import multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        self.tq = ctx.Queue()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=reader_main, args=(child, self.tq, socks), daemon=True)
        self.proc.start()
        self.expect_ok()

    def expect_ok(self, timeout=60):
        if not self.conn.poll(timeout):
            raise RuntimeError(f"hand-off reader did not answer within {timeout} s")
        status, reply = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"hand-off reader failed:\n{reply}")
        return reply

    def close(self):
        try:
            self.conn.send(("exit",))
        except Exception:  # noqa: BLE001
            pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()


# --- workloads -----------------------------------------------------------------------------------


def williams_rows(n):
    """The rows of a Williams design for n items: orders of range(n) in which every ordered
    pair (a, b) is adjacent, a right before b, equally often over all rows (once per n rows
    for even n, twice per 2n rows for odd n), and every item comes first equally often."""
    first, lo, hi = [0], 1, n - 1
    for k in range(1, n):
        if k % 2:
            first.append(lo)
            lo += 1
        else:
            first.append(hi)
            hi -= 1
    rows = [[(x + r) % n for x in first] for r in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return rows


def ordered(ids, rep):
    """The stores' order in repetition ``rep`` (-1: the warm-up): a row of the Williams design
    for ``ids`` (see the module's docstring); repetitions walk through its rows in turn. What
    is balanced is the order within a repetition; the last store of one repetition also
    precedes the first of the next."""
    rows = williams_rows(len(ids))
    return [ids[i] for i in rows[rep % len(rows)]]


class Run:
    def __init__(self, stores, cfg, checks):
        self.stores = stores  # id -> adapter, in column order
        self.cfg = cfg
        self.checks = checks
        self.rows = []
        self.bad = {}  # id -> first failed check
        self.failed = {}  # id -> why a peer stopped during the run
        self.touch = {}  # kind of result -> µs to read its first element (touch_costs)
        self.torch_calls = {}  # "put"/"get" -> µs of torch's own calls per op (touch_costs)

    def fail(self, sid, workload, exc):
        """A peer that raised: dropped from the rest of the run, with the reason (vovp's own
        columns re-raise: a vovp error fails the run)."""
        if sid in VOVP_COLUMNS:
            raise exc
        why = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
        self.failed[sid] = f"failed in {workload}: {why}"
        log(f"{LABELS[sid]} {self.failed[sid]}")
        st = self.stores.pop(sid, None)
        try:
            st.close()
        except Exception:  # noqa: BLE001
            pass

    def check(self, sid, what, got, want):
        if got != want and sid not in self.bad:
            self.bad[sid] = f"{what}: got {got}, expected {want}"

    def ids(self, workload):
        return [s for s in self.stores
                if not (workload in ("ops", "getlat") and s in NO_GET)
                and not (workload == "handoff" and s in NO_NAME)
                and not (workload != "put" and s in LIMIT_COLUMNS)]

    def row(self, key, name, unit, hib, size, samples):
        self.rows.append(dict(key=f"py.peers.{key}", name=name, unit=unit,
                              higher_is_better=hib, size=size,
                              samples={k: v for k, v in samples.items() if v}))

    def small(self):
        ops, reps = self.cfg["ops"], self.cfg["ops_reps"]
        arr = make_array(64, seed=3)
        ids = self.ids("ops")
        put = {s: [] for s in ids}
        get = {s: [] for s in ids}
        for rep in range(reps):
            for sid in ordered(ids, rep):
                if sid not in self.stores:
                    continue
                try:
                    self.small1(sid, rep, ops, arr, put, get)
                except Exception as e:  # noqa: BLE001
                    self.fail(sid, "64 B ops", e)
            log(f"64 B ops: repetition {rep + 1}/{reps} done")
        self.row("put.64", "put 64 B", "op/s", True, 64, put)
        self.row("get.64", "get 64 B (+ read, release)", "op/s", True, 64, get)

    def small1(self, sid, rep, ops, arr, put, get):
        st = self.stores[sid]
        keys = [st.key(f"{sid}-ops-{rep}-{i}") for i in range(ops)]
        data = st.conv(arr)
        want = expected(arr, st.typed)
        gc.collect()
        f = st.put
        t0 = now()
        for k in keys:
            f(k, data)
        t1 = now()
        f = st.get
        for k in keys:
            f(k)
        t2 = now()
        self.check(sid, "64 B", st.ends(keys[-1]), want)
        for k in keys:
            st.delete(k)
        put[sid].append(ops / ((t1 - t0) / 1e9))
        get[sid].append(ops / ((t2 - t1) / 1e9))

    def large(self):
        for size, reps in self.cfg["put"]:
            src = make_array(size, seed=5)
            ids = self.ids("put")
            gbs = {s: [] for s in ids}
            for rep in range(-1, reps):  # repetition -1: first use of each store's memory
                for sid in ordered(ids, rep):
                    if sid not in self.stores:
                        continue
                    try:
                        gb = self.large1(sid, rep, size, src)
                    except Exception as e:  # noqa: BLE001
                        self.fail(sid, f"put {size_label(size)}", e)
                        continue
                    if rep >= 0:
                        gbs[sid].append(gb)
            del src
            self.row(f"put.{size}", f"put {size_label(size)}", "GB/s", True, size, gbs)
            log(f"put {size_label(size)} done")

    def large1(self, sid, rep, size, src):
        st = self.stores[sid]
        k = st.key(f"{sid}-put-{size}-{rep}")
        data = st.conv(src)
        gc.collect()
        t0 = now()
        st.put(k, data)
        t1 = now()
        self.check(sid, f"put {size_label(size)}", st.ends(k), expected(src, st.typed))
        st.delete(k)
        return size / ((t1 - t0) / 1e9) / 1e9

    def getlat(self):
        for size, reps in self.cfg["getlat"]:
            src = make_array(size, seed=9)
            keys = {}
            for sid in self.ids("getlat"):
                st = self.stores[sid]
                try:
                    keys[sid] = st.key(f"{sid}-getlat-{size}")
                    st.put(keys[sid], st.conv(src))
                    self.check(sid, f"get {size_label(size)}", st.ends(keys[sid]),
                               expected(src, st.typed))
                except Exception as e:  # noqa: BLE001
                    self.fail(sid, f"get latency {size_label(size)}", e)
            ids = self.ids("getlat")
            lat = {s: [] for s in ids}
            for rep in range(-1, reps):
                for sid in ordered(ids, rep):
                    if sid not in self.stores:
                        continue
                    get, k = self.stores[sid].get, keys[sid]
                    try:
                        get(k)  # untimed: warms this store's path after another's
                        t0 = now()
                        get(k)
                        t1 = now()
                    except Exception as e:  # noqa: BLE001
                        self.fail(sid, f"get latency {size_label(size)}", e)
                        continue
                    if rep >= 0:
                        lat[sid].append((t1 - t0) / 1e3)
            for sid in ids:
                if sid in self.stores:
                    self.stores[sid].delete(keys[sid])
            self.row(f"getlat.{size}", f"get latency {size_label(size)} (+ read, release)",
                     "µs", False, size, lat)
            log(f"get latency {size_label(size)} done")

    def touch_costs(self):
        """What reading the first element costs on its own (no store), per kind of result:
        numpy a[0], torch t[0], memoryview mv[0]; median of 5 rounds of 2000, in µs. The
        typed columns' gets include it (torch's indexing is the dearest)."""
        arr = make_array(MiB, seed=1)
        cases = {"numpy": arr, "memoryview": memoryview(arr.view(np.uint8))}
        try:
            import torch

            cases["torch"] = torch.from_numpy(arr)
        except ImportError:
            pass
        out = {}
        for kind, obj in cases.items():
            rounds = []
            for _ in range(5):
                t0 = now()
                for _ in range(2000):
                    obj[0]
                rounds.append((now() - t0) / 2000 / 1e3)
            out[kind] = sorted(rounds)[2]
        self.touch = out
        self.torch_calls = self._torch_calls()

    def _torch_calls(self):
        """What torch's own calls cost a typed 64 B op of the torch column, with no store
        (median of 5 rounds of 2000, µs): "put", put_tensor's source read (the tensor's numpy
        view) and its result made and dropped (torch.from_numpy); "get", the result made, t[0]
        read and dropped, less numpy's a[0]. A torch column costs at least the numpy
        column's time plus these (the report says what that bounds its targets to)."""
        try:
            import torch
        except ImportError:
            return {}
        from vovp import tensor as T

        t = torch.from_numpy(make_array(64, seed=3))
        arr = t.numpy()
        code = T.put_plan(arr.dtype, arr.shape)[0]
        plain, to_torch = T.plain_cpu_numpy, T.numpy_to_torch

        def put_side():
            plain(t)
            r = to_torch(arr, code)
            del r

        def get_side():
            r = to_torch(arr, code)
            r[0]
            del r

        out = {}
        for side, op in (("put", put_side), ("get", get_side)):
            rounds = []
            for _ in range(5):
                t0 = now()
                for _ in range(2000):
                    op()
                rounds.append((now() - t0) / 2000 / 1e3)
            out[side] = sorted(rounds)[2]
        out["get"] = max(0.0, out["get"] - self.touch.get("numpy", 0.0))
        return out

    def batch(self):
        """vovp only: put_tensors/get_tensors of `batch` 64 B tensors against as many single
        put_tensor/get_tensor calls, per tensor (issue 27, item 1). Both kinds of put return
        before the store's answer: each put phase ends with `sync()` (timed), so it counts
        the store's work on the puts and the get phase measures gets alone, not the store
        catching up with puts it has not applied yet (a get of a name not published yet
        goes over the socket, and lets go of the GIL to wait)."""
        if "vovp" not in self.stores:
            return
        c = self.stores["vovp"].c
        n, reps = self.cfg["batch"], self.cfg["batch_reps"]
        arr = make_array(64, seed=4)
        rates = {k: [] for k in ("put1", "putn", "get1", "getn")}
        for rep in range(reps):
            for mode in (("single", "batch") if rep % 2 == 0 else ("batch", "single")):
                names = [f"batch-{rep}-{mode}-{i}" for i in range(n)]
                if mode == "single":
                    t0 = now()
                    for nm in names:
                        c.put_tensor(nm, arr)
                    c.sync()
                    t1 = now()
                    for nm in names:
                        c.get_tensor(nm)
                    t2 = now()
                else:
                    items = {nm: arr for nm in names}
                    t0 = now()
                    r = c.put_tensors(items)
                    del r
                    c.sync()
                    t1 = now()
                    got = c.get_tensors(names)
                    del got
                    t2 = now()
                tag = "1" if mode == "single" else "n"
                rates["put" + tag].append(n / ((t1 - t0) / 1e9))
                rates["get" + tag].append(n / ((t2 - t1) / 1e9))
                for nm in names:
                    c.delete(nm)
        out = []
        for op, call in (("put", "put_tensors"), ("get", "get_tensors")):
            out.append(dict(key=f"py.batch.{op}.64", group="Python: batched typed calls",
                            name=f"{call} of {n} × 64 B, per tensor", unit="op/s",
                            higher_is_better=True, base_label=f"single {call[:-1]} calls",
                            vovp=rates[op + "n"], base=rates[op + "1"]))
        log("batched typed calls done")
        return out

    def typed_raw_pair(self):
        """vovp only: 64 B numpy put_tensor against raw put back to back in one loop
        (``put_back_to_back``): the row of issue 48's item 7."""
        if "vovp" not in self.stores:
            return
        typed, raw = put_back_to_back(self.stores["vovp"].c, self.cfg["pair"],
                                      self.cfg["pair_reps"])
        log("put_tensor against put, back to back, done")
        return [dict(key="py.pair.put.64", group="Python: typed against raw calls",
                     name="put_tensor 64 B (numpy), back to back with put in one loop",
                     unit="op/s", higher_is_better=True, base_label="raw put",
                     vovp=typed, base=raw)]

    def handoff(self, socks):
        """B: one spawned process with a client of every store in `socks` (a peer that fails
        here is dropped and B restarted without it: it may be stuck in that peer's wait)."""
        reader = Reader(socks)
        try:
            for size, reps in self.cfg["handoff"]:
                src = make_array(size, seed=11)
                ids = self.ids("handoff")
                lat = {s: [] for s in ids}
                for rep in range(-1, reps):
                    for sid in ordered(ids, rep):
                        if sid not in self.stores:
                            continue
                        try:
                            us = self.handoff1(reader, sid, rep, size, src)
                        except Exception as e:  # noqa: BLE001
                            reader.close()
                            socks = {k: v for k, v in socks.items() if k != sid}
                            reader = Reader(socks)
                            self.fail(sid, f"hand-off {size_label(size)}", e)
                            continue
                        if rep >= 0:
                            lat[sid].append(us)
                self.row(f"handoff.{size}", f"hand-off {size_label(size)}: put in A → first "
                         "element read in B", "µs", False, size, lat)
                log(f"hand-off {size_label(size)} done")
        finally:
            reader.close()

    def handoff1(self, reader, sid, rep, size, src):
        st = self.stores[sid]
        name = f"{sid}-handoff-{size}-{rep}"
        data = st.conv(src)
        gc.collect()
        if sid == "ray":
            time.sleep(0.002)
            t0 = now()
            ref = st.ray.put(data)
            t1, x = st.ray.get(st.reader.first.remote(ref), timeout=120)
            del ref
        else:
            reader.conn.send(("get", sid, name))
            reader.expect_ok()  # "ready": B is about to wait
            time.sleep(0.002)  # let it get there
            t0 = now()
            if sid == "shm":
                k = st.key(name)
                st.put(k, data)
                reader.conn.send(("name", k, src.shape, src.dtype))
            elif sid == "torch_mp":
                reader.tq.put(data)  # torch's reducer moves it to shared memory
            elif sid in ("vineyard", "vineyard_blob"):
                st.put_named(name, data)
            else:
                st.put(st.key(name), data)
            t1, x = reader.expect_ok(timeout=120)
            if sid in ("vineyard", "vineyard_blob"):
                st.delete_named(name)
            elif sid != "torch_mp":
                st.delete(st.key(name))
        del data
        self.check(sid, f"hand-off {size_label(size)}", x, expected(src, st.typed)[0])
        return (t1 - t0) / 1e3


# --- entry point ---------------------------------------------------------------------------------


def run(mode, vovp_sock, plasma_sock, capacity, peers, out_dir, checks):
    """The peers pass. `peers`: --peers names (PEER_NAMES). Returns (peers JSON, extra rows,
    error text or None). A store that cannot start is reported with its reason; the others
    run."""
    cfg = MODES[mode]
    wanted = list(VOVP_COLUMNS)
    for p in peers:
        wanted += PEER_NAMES[p]
    wanted += LIMIT_COLUMNS
    status = {}
    stores = {}
    daemons = []
    info = {}

    def start(sid, make):
        try:
            stores[sid] = make()
            status[sid] = None
        except Exception as e:  # noqa: BLE001 (reported; the other stores run)
            status[sid] = f"{type(e).__name__}: {e}".strip().splitlines()[0][:300]
            log(f"{LABELS[sid]} cannot start: {status[sid]}")

    v6d = None
    for sid in wanted:
        if sid == "vovp":
            start(sid, lambda: VovpTyped(vovp_sock))
        elif sid == "vovp_torch":
            start(sid, lambda: VovpTyped(vovp_sock, torch_input=True))
        elif sid == "vovp_raw":
            start(sid, lambda: VovpRaw(vovp_sock))
        elif sid == "memcpy":
            start(sid, lambda: WarmCopy(vovp_sock))
        elif sid == "plasma":
            start(sid, lambda: Plasma(plasma_sock))
        elif sid == "ray":
            t = time.monotonic()
            start(sid, lambda: Ray(capacity))
            info["ray_start_seconds"] = round(time.monotonic() - t, 1)
            if sid in stores:
                info["ray"] = stores[sid].ray.__version__
        elif sid in ("vineyard", "vineyard_blob"):
            if v6d is None and "vineyard_daemon" not in status:
                try:
                    v6d = VineyardDaemon(capacity, os.path.join(out_dir, "vineyardd.log"))
                    daemons.append(v6d)
                    import vineyard

                    info["vineyard"] = vineyard.__version__
                    status["vineyard_daemon"] = None
                except Exception as e:  # noqa: BLE001
                    status["vineyard_daemon"] = f"vineyardd: {type(e).__name__}: {e}"[:300]
            if status["vineyard_daemon"]:
                status[sid] = status["vineyard_daemon"]
                log(f"{LABELS[sid]} cannot start: {status[sid]}")
            else:
                start(sid, (lambda s=sid: (Vineyard if s == "vineyard" else VineyardBlob)(
                    v6d.sock)))
        elif sid == "shm":
            start(sid, Shm)
        elif sid == "torch_mp":
            start(sid, TorchMp)
    status.pop("vineyard_daemon", None)

    r = Run(stores, cfg, checks)
    extra = []
    error = None
    socks = {sid: (v6d.sock if sid.startswith("vineyard") else
                   plasma_sock if sid == "plasma" else vovp_sock)
             for sid in stores if sid != "ray" and sid not in LIMIT_COLUMNS}
    try:
        for name, step in (("ops", r.small), ("put", r.large), ("getlat", r.getlat),
                           ("touch", r.touch_costs),
                           ("batch", lambda: extra.extend(r.batch() or [])),
                           ("pair", lambda: extra.extend(r.typed_raw_pair() or [])),
                           ("handoff", lambda: r.handoff(socks))):
            t = time.monotonic()
            step()
            info[f"seconds_{name}"] = round(time.monotonic() - t, 1)
            log(f"{name}: {info[f'seconds_{name}']} s")
    except Exception:  # noqa: BLE001 (the harness fails the run on a driver error)
        error = traceback.format_exc()
    finally:
        for st in stores.values():
            try:
                st.close()
            except Exception:  # noqa: BLE001
                pass
        for d in daemons:
            d.stop()
    for sid in stores:
        checks.append(dict(name=f"peers: {LABELS[sid]} gave back what was put",
                           ok=sid not in r.bad, store=sid, detail=r.bad.get(sid, "")))
    peers_json = dict(
        stores=[dict(id=s, label=LABELS[s], ran=status.get(s) is None,
                     reason=status.get(s) or r.failed.get(s), what=WHAT[s]) for s in wanted],
        rows=r.rows, info=dict(info, touch_us=r.touch, torch_calls_us=r.torch_calls))
    return peers_json, extra, error
