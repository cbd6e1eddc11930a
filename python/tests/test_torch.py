"""torch support: tensors in and out, zero-copy, and through multiprocessing (needs torch)."""

import gc
import multiprocessing as mp

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import vovp  # noqa: E402
import _helpers  # noqa: E402
from _helpers import wait_for  # noqa: E402

DTYPES = [torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
          torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
          torch.complex128]
DTYPES += [getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)]
SHAPES = [(), (0,), (5,), (2, 3), (0, 3), (2, 3, 4)]


def make(dtype, shape):
    n = int(np.prod(shape, dtype=np.int64))
    base = torch.arange(n, dtype=torch.float64)
    if dtype == torch.bool:
        t = (torch.arange(n) % 3) == 0
    elif dtype.is_complex:
        t = torch.complex(base, -base).to(dtype)
    else:
        t = (base % 100).to(dtype)
    return t.reshape(shape)


def as_numpy(t):
    """Bits of a CPU tensor as numpy (bfloat16 has no numpy dtype: compare its int16 bits)."""
    t = t.detach()
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def same(a, b):
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and \
        np.array_equal(as_numpy(a), as_numpy(b))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip(client, daemon, dtype):
    other = daemon.client()
    for i, shape in enumerate(SHAPES):
        t = make(dtype, shape)
        name = f"{dtype}-{i}"
        r = client.put_tensor(name, t)
        assert isinstance(r, torch.Tensor)
        assert same(r, t)
        g = other.get_tensor(name, framework="torch")
        assert isinstance(g, torch.Tensor)
        assert same(g, t)
    other.close()


def test_zero_copy_views(client):
    r = client.put_tensor("z", torch.arange(10, dtype=torch.float32))
    g = client.get_tensor("z", framework="torch")
    n = client.get_tensor("z", framework="numpy")
    assert g.data_ptr() == r.data_ptr() == n.__array_interface__["data"][0]


def test_numpy_put_torch_get(client):
    client.put_tensor("np", np.arange(6, dtype=np.int32).reshape(2, 3))
    g = client.get_tensor("np", framework="torch")
    assert g.dtype == torch.int32 and g.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_bfloat16_read_by_numpy(client):
    t = torch.tensor([1.0, 2.0, -3.0], dtype=torch.bfloat16)
    client.put_tensor("bf", t)
    g = client.get_tensor("bf")
    assert np.array_equal(g.view(np.int16), t.view(torch.int16).numpy())
    e = {e["name"]: e for e in client.list()}["bf"]
    assert e["dtype"] == "bfloat16"


def test_non_contiguous_and_large(client):
    t = torch.arange(24.0).reshape(4, 6).t()
    r = client.put_tensor("nc", t)
    assert r.is_contiguous() and torch.equal(r, t)
    big = torch.randn(1024, 1024, dtype=torch.float64)[:, ::2]  # 4 MiB, strided
    r = client.put_tensor("big", big)
    assert torch.equal(r, big)
    assert torch.equal(client.get_tensor("big", framework="torch"), big)


def test_requires_grad_and_conj(client):
    t = torch.ones(3, requires_grad=True)
    r = client.put_tensor("g", t)
    assert not r.requires_grad and torch.equal(r, t.detach())
    c = torch.complex(torch.ones(2), torch.ones(2)).conj()
    r = client.put_tensor("conj", c)
    assert torch.equal(r, c.resolve_conj())


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
    g = client.get_tensor("rel", framework="torch")
    assert client.stats()["references"] == 2
    assert client.release(r) is True
    assert client.release(r) is False  # does not take g's reference
    assert client.stats()["references"] == 1
    del g
    gc.collect()
    assert client.stats()["references"] == 0


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


def test_reduction_spawn(start_daemon, reduction_to):
    d = start_daemon(memory=512 << 20)
    reduction_to(d.socket)
    watcher = d.client()
    ctx = mp.get_context("spawn")
    inq, outq = ctx.Queue(), ctx.Queue()
    w = ctx.Process(target=_helpers.torch_queue_worker, args=(inq, outq))
    w.start()
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
    assert watcher.stats()["creates"] == 2  # f once (sent twice), bf once; small by value
    inq.put(None)
    assert outq.get(timeout=60) == "done"
    w.join(60)
    del f, bf
    gc.collect()
    assert wait_for(lambda: watcher.stats()["objects"] == 0), watcher.stats()
    watcher.close()
