"""torch support: tensors in and out, zero-copy, across processes and through multiprocessing.

Needs torch (CI installs it, and with VOVP_REQUIRE_TORCH=1 a skip for want of torch fails the
run, see conftest.py).
"""

import gc
import importlib.util
import multiprocessing as mp
import os
import subprocess
import sys
import time
import warnings
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import vovp  # noqa: E402
from vovp import tensor as T  # noqa: E402
import _helpers  # noqa: E402
from _helpers import requests_after_first_get, store_backed, tensor_digest, wait_for  # noqa: E402
from conftest import PYTHON_DIR  # noqa: E402

# Every dtype torch and numpy share (bfloat16: the store's own code; numpy views its bits).
DTYPES = [torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
          torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.complex64, torch.complex128]
SHAPES = [(), (0,), (5,), (2, 3), (0, 3), (2, 3, 4)]


def make(dtype, shape, seed=0):
    n = int(np.prod(shape, dtype=np.int64))
    base = torch.arange(seed, seed + n, dtype=torch.float64)
    if dtype == torch.bool:
        t = (torch.arange(n) % 3) == 0
    elif dtype.is_complex:
        t = torch.complex(base, -base).to(dtype)
    else:
        t = (base % 100).to(dtype)
    return t.reshape(shape)


def variants(dtype):
    """(label, tensor) for one dtype: every rank of SHAPES plus a transposed and a sliced
    (strided, offset) view, the non-contiguous inputs."""
    out = [(f"shape{s}", make(dtype, s)) for s in SHAPES]
    m = make(dtype, (6, 8), seed=3)
    out.append(("transposed", m.t()))
    out.append(("sliced", m[1:5, 2::3]))
    return out


def same(a, b):
    return tensor_digest(a) == tensor_digest(b)


def spawn_python(code, env=None, timeout=120):
    """Run ``code`` in a fresh interpreter (a separate process importing vovp from this tree);
    returns its stdout."""
    e = dict(os.environ if env is None else env)
    e["PYTHONPATH"] = str(PYTHON_DIR) + os.pathsep + str(PYTHON_DIR / "tests")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=e, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return out.stdout


# --- put/get ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_dtype_and_layout(client, daemon, dtype):
    other = daemon.client()
    for label, t in variants(dtype):
        name = f"{dtype}-{label}"
        r = client.put_tensor(name, t)
        assert isinstance(r, torch.Tensor) and r.is_contiguous()
        assert same(r, t), label
        g = other.get_tensor(name)  # no framework given: it was put from torch
        assert isinstance(g, torch.Tensor), label
        assert same(g, t), label
        assert store_backed(g) or t.numel() == 0, label
    other.close()


def test_other_process_gets_torch_tensors_by_name(client, daemon):
    """Every dtype and layout, got by name alone in a separate interpreter: torch tensors
    with the same values, over the store's memory."""
    expect = {}
    for dtype in DTYPES:
        for label, t in variants(dtype):
            name = f"x-{dtype}-{label}"
            client.put_tensor(name, t)
            expect[name] = (tensor_digest(t), t.numel() > 0)
    client.put_tensor("plain-numpy", np.arange(6, dtype=np.int16).reshape(2, 3))
    out = spawn_python(f"""
import json, vovp, _helpers
c = vovp.init_client({daemon.socket!r})
names = {sorted(expect)!r}
res = {{n: (type(t).__module__, _helpers.tensor_digest(t), _helpers.store_backed(t))
       for n, t in zip(names, c.get_tensors(names))}}
a = c.get_tensor("plain-numpy")
res["plain-numpy"] = (type(a).__module__, a.dtype.str, _helpers.store_backed(a))
print(json.dumps(res))
""")
    import json

    got = json.loads(out)
    for name, (digest, nonempty) in expect.items():
        # (an empty tensor has no address to recognise store memory by)
        assert got[name] == ["torch", digest, nonempty], name
    assert got["plain-numpy"] == ["numpy", "<i2", True]


def test_seed_put_get_same_memory(client, daemon):
    a = torch.tensor([[1, 2, 3], [5, 4, 6]])
    ret_a = client.put_tensor("test111", a)
    ret_a2 = daemon.client().get_tensor("test111")
    assert isinstance(ret_a2, torch.Tensor) and ret_a2.dtype == torch.int64
    assert ret_a2.tolist() == [[1, 2, 3], [5, 4, 6]]
    assert ret_a2.data_ptr() != ret_a.data_ptr()  # another client's mapping...
    la, lb = vovp.client.find_lease(ret_a), vovp.client.find_lease(ret_a2)
    assert (la.segment, la.offset, la.oid) == (lb.segment, lb.offset, lb.oid)  # ...same bytes


def test_framework_override_and_numpy_stays_numpy(client):
    client.put_tensor("t", torch.arange(6, dtype=torch.int32))
    client.put_tensor("n", np.arange(6, dtype=np.int32))
    assert isinstance(client.get_tensor("t"), torch.Tensor)
    n = client.get_tensor("t", framework="numpy")
    assert isinstance(n, np.ndarray) and not n.flags.writeable and n.tolist() == list(range(6))
    assert isinstance(client.get_tensor("n"), np.ndarray)
    g = client.get_tensor("n", framework="torch")
    assert isinstance(g, torch.Tensor) and g.dtype == torch.int32
    refs = client.stats()["references"]
    with pytest.raises(ValueError, match="framework"):
        client.get_tensor("n", framework="jax")
    assert client.stats()["references"] == refs  # the bad call took nothing
    e = {e["name"]: e for e in client.list()}
    assert e["t"]["dtype"] == "int32" and e["t"]["shape"] == (6,)


def test_without_torch_a_torch_object_comes_back_as_numpy(client, daemon):
    client.put_tensor("bf", torch.tensor([1.0, -2.0], dtype=torch.bfloat16))
    client.put_tensor("f", torch.tensor([1.5, 2.5]))
    out = spawn_python(f"""
import sys
sys.modules["torch"] = None  # this process cannot import torch
import vovp
c = vovp.init_client({daemon.socket!r})
f, bf = c.get_tensors(["f", "bf"])
print(type(f).__module__, f.tolist(), bf.dtype.name, bf.view("int16").tolist(), sep="|")
""")
    bits = torch.tensor([1.0, -2.0], dtype=torch.bfloat16).view(torch.int16).tolist()
    # numpy shows bfloat16 with ml_dtypes' dtype where that is installed, else as its bits.
    shown = "bfloat16" if importlib.util.find_spec("ml_dtypes") else "uint16"
    assert out.strip().split("|") == ["numpy", "[1.5, 2.5]", shown, str(bits)]


def test_bfloat16_shown_with_a_dtype_numpy_has_no_kind_for(client, monkeypatch):
    """Where ml_dtypes is installed, numpy shows bfloat16 with its dtype, of kind 'V' (void),
    which the native core cannot show a result with: it shows the bits, and the Python layer
    views them with that dtype. A 2-byte void dtype stands in for ml_dtypes' here, at every
    size (inline, through the lend, CREATE + copy + SEAL) and in a batch."""
    monkeypatch.setattr(T, "_BF16_NP", np.dtype("V2"))
    monkeypatch.setattr(T, "_PUT_PLANS", {})
    for n in (4, 1 << 17, 8 << 20):
        t = torch.arange(n, dtype=torch.float32).to(torch.bfloat16)
        r = client.put_tensor(f"bf{n}", t)
        assert r.dtype == torch.bfloat16 and torch.equal(r, t)
    batch = {f"b{i}": torch.full((3,), float(i), dtype=torch.bfloat16) for i in range(4)}
    for name, r in client.put_tensors(batch).items():
        assert r.dtype == torch.bfloat16 and torch.equal(r, batch[name])


def test_numpy_gets_never_import_torch(client, daemon):
    # torch is installed here; a process that gets only numpy tensors must not pay its import
    # (seconds), single gets or batches alike.
    client.put_tensors({"np0": np.arange(3), "np1": np.ones(2)})
    client.sync()
    out = spawn_python(f"""
import sys, vovp
c = vovp.init_client({daemon.socket!r})
a = c.get_tensor("np0")
b, d = c.get_tensors(["np0", "np1"])
print(type(b).__module__, int(a.sum() + b.sum() + d.sum()), "torch" in sys.modules, sep="|")
""")
    assert out.strip().split("|") == ["numpy", "8", "False"]


def test_zero_copy_views(client):
    r = client.put_tensor("z", torch.arange(10, dtype=torch.float32))
    g = client.get_tensor("z")  # torch in, torch out
    n = client.get_tensor("z", framework="numpy")
    # Torch tensors are writable, so they view the store through this process's private
    # (copy-on-write) mapping of the same pages; the read-only numpy view uses the shared one.
    # Same pages, same offset, no copy.
    assert g.data_ptr() == r.data_ptr()
    from vovp.client import find_lease

    lg, ln = find_lease(g), find_lease(n)
    assert (lg.segment, lg.offset) == (ln.segment, ln.offset)
    assert g.data_ptr() != n.__array_interface__["data"][0]  # two mappings of one page
    # Writing through the torch tensor stays in this process: the store keeps its bytes.
    g[0] = 42.0
    assert n[0] == 0.0 and client.get_tensor("z", framework="numpy")[0] == 0.0


def test_bfloat16_read_by_numpy(client):
    t = torch.tensor([1.0, 2.0, -3.0], dtype=torch.bfloat16)
    client.put_tensor("bf", t)
    g = client.get_tensor("bf", framework="numpy")
    assert np.array_equal(g.view(np.int16), t.view(torch.int16).numpy())
    e = {e["name"]: e for e in client.list()}["bf"]
    assert e["dtype"] == "bfloat16"


def test_large_strided(client):
    big = torch.randn(1024, 1024, dtype=torch.float64)[:, ::2]  # 4 MiB, strided
    r = client.put_tensor("big", big)
    assert torch.equal(r, big)
    assert torch.equal(client.get_tensor("big"), big)


def test_requires_grad_put_stores_values_only(client):
    """The store keeps values, not autograd state: put_tensor(t) is put_tensor(t.detach())
    and the result does not require grad; the source is untouched."""
    leaf = torch.ones(3, requires_grad=True)
    nonleaf = leaf * 2
    for name, t in (("leaf", leaf), ("nonleaf", nonleaf)):
        r = client.put_tensor(name, t)
        assert not r.requires_grad and r.grad_fn is None
        assert torch.equal(r, t.detach())
        assert t.requires_grad
        g = client.get_tensor(name)
        assert not g.requires_grad and torch.equal(g, t.detach())
    c = torch.complex(torch.ones(2), torch.ones(2)).conj()
    assert torch.equal(client.put_tensor("conj", c), c.resolve_conj())


def test_release_on_gc(client):
    r = client.put_tensor("gc", torch.arange(100))
    s = r[10:20]
    del r
    gc.collect()
    assert client.stats()["references"] == 1
    assert s.tolist() == list(range(10, 20))
    del s
    gc.collect()
    assert client.stats()["references"] == 0


def test_explicit_release(client):
    r = client.put_tensor("rel", torch.arange(4))
    g = client.get_tensor("rel")
    assert client.stats()["references"] == 2
    assert client.release(r) is True
    assert client.release(r) is False  # does not take g's reference
    assert client.stats()["references"] == 1
    del g
    gc.collect()
    assert client.stats()["references"] == 0


# --- batch calls -----------------------------------------------------------------------------


def test_put_tensors_get_tensors(client, daemon):
    tensors = {f"b{i}": make(torch.float32, (i, 3), seed=i) for i in range(5)}
    tensors["np"] = np.arange(4, dtype=np.uint8)
    stored = client.put_tensors(tensors)
    assert list(stored) == list(tensors)
    client.sync()  # (small put_tensors return before the store applied them)
    other = daemon.client()
    # They live in the putter's arena: the first get maps it (a SEGMENT request).
    before = requests_after_first_get(other, "np")
    got = other.get_tensors(list(tensors))
    # Small host objects: all six come from the shared directory, with no request at all.
    assert other.core.requests_sent() - before == 0
    # Without shared reads: one request, a GET of six names.
    socket_only = daemon.client(shared_reads=False)
    before = requests_after_first_get(socket_only, "np")
    again = socket_only.get_tensors(list(tensors))
    assert socket_only.core.requests_sent() - before == 1
    del again
    for (name, t), g in zip(tensors.items(), got):
        if name == "np":
            assert isinstance(g, np.ndarray) and g.tolist() == [0, 1, 2, 3]
        else:
            assert isinstance(g, torch.Tensor) and torch.equal(g, t)
    assert other.get_tensors([]) == []
    del got, g
    gc.collect()
    other.flush()
    # Any name missing: ObjectNotFound naming it, and nothing is held.
    with pytest.raises(vovp.ObjectNotFound, match="'nope'"):
        other.get_tensors(["b1", "nope", "b2"])
    assert wait_for(lambda: other.stats()["references"] == len(tensors))  # put_tensors' own
    other.close()


def test_get_tensors_waits_for_all(client, daemon):
    import threading

    def late_put():
        c = daemon.client()
        c.put_tensor("late", torch.ones(3))
        c.close()

    client.put_tensor("early", torch.zeros(2))
    th = threading.Timer(0.3, late_put)
    th.start()
    early, late = client.get_tensors(["early", "late"], timeout=10)
    th.join()
    assert early.tolist() == [0.0, 0.0] and late.tolist() == [1.0, 1.0, 1.0]


# --- DLPack ------------------------------------------------------------------------------------


def test_dlpack_host_results_are_zero_copy(client):
    t = client.put_tensor("d", torch.arange(12, dtype=torch.float32).reshape(3, 4))
    n = client.get_tensor("d", framework="numpy")  # read-only numpy view of the store
    for obj in (t, n, client.get_tensor("d")):
        assert obj.__dlpack_device__() == (1, 0)  # kDLCPU
        addr = vovp._lookup.data_address(obj)
        for consume in (torch.from_dlpack, np.from_dlpack):
            if obj is n and not (NUMPY2 and _tells_read_only(consume)):
                # A read-only numpy array is exported only by numpy 2, only to a consumer that
                # can be told it is read-only (DLPack >= 1.0); numpy refuses the rest.
                with pytest.raises(BufferError, match="read-?only"):
                    consume(obj)
                continue
            out = consume(obj)
            got = out.data_ptr() if isinstance(out, torch.Tensor) else \
                out.__array_interface__["data"][0]
            assert got == addr, consume
            assert out.tolist() == t.tolist()


NUMPY2 = np.lib.NumpyVersion(np.__version__) >= "2.0.0"


def _tells_read_only(consume) -> bool:
    """Whether ``consume`` (a from_dlpack) asks for DLPack >= 1.0, which can carry read-only."""
    asked = {}

    class Probe:
        def __dlpack_device__(self):
            return (1, 0)

        def __dlpack__(self, **kwargs):
            asked.update(kwargs)
            raise BufferError("probe")

    try:
        consume(Probe())
    except BufferError:
        pass
    return asked.get("max_version") is not None


# --- multiprocessing -------------------------------------------------------------------------


def test_seed_program(start_daemon):
    """examples/seed.py: the seed's calls verbatim, with the daemon on a non-default socket
    and no $VOVP_SOCKET: put in one process, get by name in another, init_reduction() after
    init_client(path) sends through *that* store."""
    import json

    d = start_daemon()
    env = dict(os.environ)
    env.pop("VOVP_SOCKET", None)
    env["PYTHONPATH"] = str(PYTHON_DIR)
    out = subprocess.run([sys.executable, str(PYTHON_DIR.parent / "examples" / "seed.py"),
                          d.socket], capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "by value" not in out.stderr, out.stderr
    r = json.loads(out.stdout)
    assert r["put"]["values"] == [[1, 2, 3], [5, 4, 6]]
    assert r["get"] == dict(type="torch.Tensor", values=[[1, 2, 3], [5, 4, 6]],
                            where=r["put"]["where"])
    assert r["queue"] == dict(type="torch.Tensor", sum=float(sum(range(1 << 16))),
                              through_store=True)
    c = d.client()
    assert c.stats()["creates"] == 2  # test111 and the queued tensor
    assert [e["name"] for e in c.list()] == ["test111"]  # the queued one went with its reader


def test_init_reduction_unreachable_store_is_an_immediate_error(start_daemon):
    d = start_daemon()
    out = spawn_python(f"""
import os, vovp
os.environ.pop("VOVP_SOCKET", None)
try:
    vovp.init_reduction("/tmp/vovp-no-such-dir/s.sock")
except vovp.ConnectionError as e:
    print("path:", e)
os.environ["VOVP_SOCKET"] = "/tmp/vovp-no-such-dir/s.sock"
try:
    vovp.init_reduction()
except vovp.ConnectionError as e:
    print("env:", e)
c = vovp.init_client({d.socket!r})
vovp.init_reduction()  # the init_client above wins over $VOVP_SOCKET
print("ok", os.environ["VOVP_SOCKET"] == {d.socket!r})
""")
    lines = out.splitlines()
    assert lines[0].startswith("path: init_reduction: cannot reach the vovp store at "
                               "'/tmp/vovp-no-such-dir/s.sock'")
    assert lines[1].startswith("env: init_reduction: cannot reach")
    assert lines[2] == "ok True"


def test_reduction_spawn_leaves_nothing_behind(start_daemon, reduction_to):
    """The issue's case: tensors sent through a spawn Queue, dropped by the receiver, while
    the sender still has them (the loop variable ``t`` keeps ``f`` alive): nothing stays in
    the store. Before the fix the sender's copy lived as long as its source."""
    d = start_daemon(memory=512 << 20)
    reduction_to(d.socket)
    watcher = d.client()
    w, inq, outq = _helpers.spawn_queue_worker(_helpers.torch_queue_worker)
    f = torch.arange(1 << 20, dtype=torch.float32)
    bf = torch.ones(1 << 18, dtype=torch.bfloat16)
    small = torch.arange(10)
    for t in (f, bf, small, f):
        inq.put(t)
    results = [outq.get(timeout=120) for _ in range(4)]
    assert results[0] == (float(f.double().sum()), "torch.float32", (1 << 20,), True)
    assert results[1] == (float(1 << 18), "torch.bfloat16", (1 << 18,), True)
    assert results[2] == (45.0, "torch.int64", (10,), False)
    assert results[3] == results[0]
    assert watcher.stats()["creates"] == 3  # one per large send; small by value
    inq.put(None)
    assert outq.get(timeout=60) == "done"
    w.join(60)
    gc.collect()
    assert wait_for(lambda: watcher.stats()["objects"] == 0), watcher.stats()
    assert t is f and bf.numel() == 1 << 18  # the sources are alive all along
    watcher.close()


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_children_of_every_start_method(start_daemon, reduction_to, method):
    """Tensors of every dtype and layout sent to a child of each start method arrive intact,
    as torch tensors over store memory; the child sends one back; nothing is left after."""
    d = start_daemon(memory=256 << 20)
    reduction_to(d.socket, threshold=1)  # every non-empty tensor through the store
    watcher = d.client()
    ctx = mp.get_context(method)
    inq, outq = ctx.Queue(), ctx.Queue()
    w = ctx.Process(target=_helpers.torch_child, args=(inq, outq, True))
    w.start()
    ts = [t for dtype in DTYPES for _, t in variants(dtype)]
    inq.put(ts)
    got = outq.get(timeout=120)
    assert [g[1] for g in got] == [tensor_digest(t) for t in ts]
    assert all(g[0] == "Tensor" for g in got)
    # Empty tensors (0 bytes) are below any threshold: pickled by value.
    assert [g[2] for g in got] == [t.numel() > 0 for t in ts]
    inq.put(None)
    back = outq.get(timeout=60)
    assert isinstance(back, torch.Tensor) and store_backed(back)
    assert torch.equal(back, torch.arange(1 << 16, dtype=torch.float64))
    assert outq.get(timeout=60)[0] == "done"
    w.join(60)
    assert w.exitcode == 0
    del back, got
    gc.collect()
    assert wait_for(lambda: watcher.stats()["objects"] == 0), watcher.stats()
    watcher.close()


def test_reduction_requires_grad_goes_through_torch(start_daemon, reduction_to):
    """Tensors that require grad keep torch's own semantics (requires_grad travels, torch's
    shared memory, not the store); torch refuses non-leaf ones, as without vovp."""
    d = start_daemon()
    reduction_to(d.socket)
    watcher = d.client()
    leaf = torch.ones(1 << 16, requires_grad=True)
    back = ForkingPickler.loads(ForkingPickler.dumps(leaf))
    assert back.requires_grad and torch.equal(back.detach(), leaf.detach())
    assert not store_backed(back)
    with pytest.raises(RuntimeError, match="non-leaf"):
        ForkingPickler.dumps(leaf * 2)
    assert watcher.stats()["creates"] == 0


def test_refilled_buffer_sends_new_contents(start_daemon, reduction_to):
    d = start_daemon()
    reduction_to(d.socket)
    buf = torch.zeros(1 << 15)
    sent = []
    for i in range(3):
        buf.fill_(i)
        sent.append(ForkingPickler.loads(ForkingPickler.dumps(buf)))
    assert [float(t[0]) for t in sent] == [0.0, 1.0, 2.0]
    assert all(store_backed(t) for t in sent)


def test_full_store_falls_back_with_a_warning_other_errors_raise(start_daemon, reduction_to):
    d = start_daemon(memory=1 << 20)
    reduction_to(d.socket)
    big = torch.ones(1 << 19)  # 2 MiB > the 1 MiB store
    with pytest.warns(RuntimeWarning, match="store is full"):
        back = ForkingPickler.loads(ForkingPickler.dumps(big))
    assert torch.equal(back, big) and not store_backed(back)
    # A store that went away is not a reason to pickle silently by value.
    d.stop()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(vovp.ConnectionError):
            ForkingPickler.dumps(torch.ones(1 << 15))


# --- DataLoader --------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 4 workers on 2 CPUs
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dataloader_workers_send_batches_through_the_store(start_daemon, reduction_to, method,
                                                          monkeypatch):
    """DataLoader(num_workers=4, worker_init_fn=vovp.worker_init_fn): every batch arrives
    intact and store-backed; nothing is left after an epoch is exhausted (with the workers
    still alive), nor after the loader is deleted mid-epoch with batches in flight."""
    from torch.utils.data import DataLoader

    d = start_daemon(memory=256 << 20)
    reduction_to(d.socket)
    # Longer than torch waits for a worker to exit (5 s) before terminating it: a worker that
    # waited at exit for receivers of its abandoned batches would be killed, and fail below.
    monkeypatch.setenv("VOVP_HANDOFF_TIMEOUT", "60")
    watcher = d.client()
    # 32 KiB items, 256 KiB batches of 8; from the third batch on, 0.4 s per batch, so that
    # the main process has taken the first two before the others arrive.
    ds = _helpers.ItemDataset(48, 1 << 13, slow_from=16)
    # Persistent workers: one start-up for both epochs (spawned workers import torch, slowly).
    loader = DataLoader(ds, batch_size=8, num_workers=4, worker_init_fn=vovp.worker_init_fn,
                        multiprocessing_context=method, persistent_workers=True)
    batches = list(loader)
    assert len(batches) == 6
    for k, b in enumerate(batches):
        expect = torch.arange(8 * k, 8 * k + 8, dtype=torch.float32)[:, None].expand(8, 1 << 13)
        assert torch.equal(b, expect), k
        assert store_backed(b), k
    assert watcher.stats()["creates"] == 6
    del batches, b
    gc.collect()
    assert wait_for(lambda: watcher.stats()["objects"] == 0), watcher.stats()

    # Second epoch: two batches taken, then the loader deleted with the four others sent by
    # the workers (put in the store) but never received.
    it = iter(loader)
    first = next(it), next(it)
    assert torch.equal(first[1][:, 0], torch.arange(8.0, 16.0))
    assert wait_for(lambda: watcher.stats()["creates"] == 12), watcher.stats()
    workers = list(it._workers)
    # torch terminates a worker that has not exited 5 s after the loader's shutdown began; on
    # a loaded machine torch's own teardown can take that long. Let it wait up to 50 s, so
    # that an exit code of 0 below means the worker left on its own, whatever the load.
    from torch.utils.data import _utils as loader_utils
    monkeypatch.setattr(loader_utils, "MP_STATUS_CHECK_INTERVAL", 50.0)
    t0 = time.monotonic()
    del it, loader, first
    gc.collect()
    for w in workers:
        w.join(60)
        assert w.exitcode == 0  # left on their own, not terminated by the loader
    # The abandoned batches' in-flight holds did not keep the workers waiting for receivers
    # that will never come: that wait would end only at VOVP_HANDOFF_TIMEOUT (60 s). (A
    # worker exits in ~3 s here, torch's own teardown.)
    assert time.monotonic() - t0 < 45.0
    assert wait_for(lambda: watcher.stats()["objects"] == 0), watcher.stats()
    watcher.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensor_without_daemon_gpu_memory_is_a_clear_error_or_works(client):
    # The test daemon has no --gpu-memory: the store sizes the pool itself (or reports why it
    # cannot); either way the put answers a typed result, never a crash. test_cuda.py covers
    # the CUDA paths in depth.
    try:
        back = client.put_tensor("cuda", torch.arange(3.0, device="cuda"))
    except vovp.GpuUnavailable as e:
        assert str(e)
    else:
        assert back.is_cuda and back.tolist() == [0.0, 1.0, 2.0]


def test_put_tensors_pipelines_small_ones_and_reports_errors(client):
    small = {f"s{i}": torch.full((4,), i) for i in range(100)}  # more than one batch of 64
    small["big"] = torch.ones(1 << 17)  # 512 KiB: CREATE + copy + SEAL
    small["arr"] = np.arange(3)
    gc.collect()
    client.flush()
    before = client.core.requests_sent()
    stored = client.put_tensors(small)
    # The small tensors (101: batches of 64 and 37) written without waiting into this
    # client's small lend, one PUBLISH_MANY per 8 of a batch (8 + 5 frames), after one LEND,
    # the connection's one question whether the store knows PUBLISH_MANY, and one SEGMENT
    # mapping its first arena; for the big one a LEND and its PUBLISH: nothing else (no
    # per-tensor requests).
    from vovp.client import find_lease

    assert find_lease(stored["big"]).segment != 0
    assert client.core.requests_sent() - before == (8 + 5) + 3 + 2
    assert list(stored) == list(small)
    for name, t in small.items():
        g = stored[name]
        assert type(g) is type(t)
        assert (torch.equal(g, t) if isinstance(t, torch.Tensor) else g.tolist() == t.tolist())
    # One name taken: the error is raised, every other tensor is stored.
    with pytest.raises(vovp.ObjectExists):
        client.put_tensors({"new1": torch.ones(2), "s5": torch.ones(2), "new2": torch.ones(2)})
    assert client.contains("new1") and client.contains("new2")
    assert client.get_tensor("s5").tolist() == [5, 5, 5, 5]


def test_handoff_does_not_wait_for_the_seal_reply(start_daemon, reduction_to):
    """A large send seals its object without waiting for the reply (the receiver's GET waits
    for the seal instead); the reply is read in front of the sender's next request."""
    d = start_daemon()
    reduction_to(d.socket)
    data = ForkingPickler.dumps(torch.arange(1 << 18, dtype=torch.float32))  # 1 MiB
    sender = vovp.default_client(d.socket)
    assert sender.core.unread_replies == 1  # the SEAL's reply is not read yet
    other = d.client()
    # (the daemon may see this LIST before the SEAL: they come on different connections)
    assert wait_for(lambda: [(e["sealed"], e["ephemeral"]) for e in other.list()] ==
                    [(True, True)])
    back = ForkingPickler.loads(data)
    assert torch.equal(back, torch.arange(1 << 18, dtype=torch.float32)) and store_backed(back)
    assert sender.stats()["objects"] == 1  # the next request consumed the seal's reply first
    assert sender.core.unread_replies == 0
    del back
    gc.collect()
    assert wait_for(lambda: other.stats()["objects"] == 0)
