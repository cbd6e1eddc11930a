"""init_reduction: numpy arrays through multiprocessing, one copy in the store."""

import gc
import multiprocessing as mp
import time

import numpy as np
import pytest

import vovp
from vovp import reduction
import _helpers
from _helpers import wait_for

MB64 = 64 << 20


@pytest.fixture
def big_daemon(start_daemon):
    return start_daemon(memory=1 << 30)


def test_four_spawned_workers(big_daemon, reduction_to):
    """Each send of a plain array is one store object; an array that is store memory already
    (here: put_tensor's result) is broadcast by name with no copy; the sender keeps nothing
    once the receivers dropped theirs, however long its source arrays live."""
    reduction_to(big_daemon.socket)
    watcher = big_daemon.client()
    ctx = mp.get_context("spawn")
    inqs = [ctx.Queue() for _ in range(4)]
    outq = ctx.Queue()
    workers = [ctx.Process(target=_helpers.queue_worker, args=(q, outq)) for q in inqs]
    for w in workers:
        w.start()
    creates0 = watcher.stats()["creates"]

    shared = watcher.put_tensor("shared", np.arange(MB64 // 4, dtype=np.float32))
    own = [np.full(MB64 // 8, k + 1, dtype=np.float64) for k in range(4)]  # one each
    for k, q in enumerate(inqs):
        q.put(shared)
        q.put(own[k])
    results = [outq.get(timeout=120) for _ in range(8)]
    expect = {float(shared.sum(dtype=np.float64))} | {float(a.sum()) for a in own}
    assert {r[1] for r in results} == expect
    assert all(r[3] for r in results), "workers did not get store-backed arrays"
    assert not any(r[4] for r in results), "received numpy arrays must be read-only"
    assert len({r[0] for r in results}) == 4
    # shared: its put only (sent by name four times); own: one object per send.
    assert watcher.stats()["creates"] == creates0 + 5

    # A buffer refilled in place and sent again arrives with its new contents.
    own[0][:] = 9.0
    inqs[0].put(own[0])
    assert outq.get(timeout=60)[1] == 9.0 * (MB64 // 8)
    assert watcher.stats()["creates"] == creates0 + 6

    for q in inqs:
        q.put(None)
    assert sorted(outq.get(timeout=60)[0] for _ in range(4)) == ["done"] * 4
    for w in workers:
        w.join(60)
        assert w.exitcode == 0
    # The source arrays still live here, but every receiver dropped its copy: only the named
    # object "shared" is left.
    assert wait_for(lambda: watcher.stats()["objects"] == 1), watcher.stats()
    assert [e["name"] for e in watcher.list()] == ["shared"]
    del shared
    watcher.delete("shared")
    gc.collect()
    assert wait_for(lambda: watcher.stats()["objects"] == 0), watcher.stats()
    st = watcher.stats()
    assert st["used_bytes"] == 0 and st["references"] == 0
    assert reduction.pending_sends() == 0
    assert len(own) == 4  # the sources outlived everything above
    watcher.close()


def test_temporary_array_survives_until_received(big_daemon, reduction_to):
    """q.put(temporary): the source dies right after pickling, before any receiver exists."""
    reduction_to(big_daemon.socket)
    ctx = mp.get_context("spawn")
    inq, outq = ctx.Queue(), ctx.Queue()
    inq.put(np.full(1 << 20, 3, dtype=np.int64))
    # The feeder thread has pickled it (a send is pending) and dropped the array: observed,
    # not guessed with a sleep.
    assert wait_for(lambda: reduction.pending_sends() == 1, timeout=20)
    gc.collect()
    w = ctx.Process(target=_helpers.queue_worker, args=(inq, outq))
    w.start()
    r = outq.get(timeout=60)
    assert r[1] == 3.0 * (1 << 20) and r[3]
    inq.put(None)
    assert outq.get(timeout=60)[0] == "done"
    w.join(60)
    watcher = big_daemon.client()
    assert wait_for(lambda: watcher.stats()["objects"] == 0), watcher.stats()
    watcher.close()


def test_process_args_spawn(big_daemon, reduction_to):
    reduction_to(big_daemon.socket)
    ctx = mp.get_context("spawn")
    outq = ctx.Queue()
    p = ctx.Process(target=_helpers.args_worker, args=(np.ones(1 << 18), outq))
    p.start()
    assert outq.get(timeout=60) == (float(1 << 18), True)
    p.join(60)
    assert p.exitcode == 0
    watcher = big_daemon.client()
    assert wait_for(lambda: watcher.stats()["objects"] == 0), watcher.stats()


def test_worker_returns_result_and_exits(big_daemon, reduction_to):
    """A worker sends a large array back and returns at once; the main process reads it
    later. The worker's exit waits for the hand-off instead of destroying the object."""
    reduction_to(big_daemon.socket)
    ctx = mp.get_context("spawn")
    outq = ctx.Queue()
    p = ctx.Process(target=_helpers.result_worker, args=(1 << 20, outq))
    p.start()
    time.sleep(1.0)
    arr = outq.get(timeout=60)
    assert arr.shape == (1 << 20,) and int(arr.sum()) == 7 << 20
    assert _helpers.store_backed(arr)
    p.join(60)
    assert p.exitcode == 0
    watcher = big_daemon.client()
    assert watcher.stats()["objects"] == 1
    del arr
    gc.collect()
    assert wait_for(lambda: watcher.stats()["objects"] == 0), watcher.stats()


def test_fork_queue(big_daemon, reduction_to):
    reduction_to(big_daemon.socket)
    # The parent has a default client already; the forked child must open its own.
    vovp.default_client(big_daemon.socket).stats()
    ctx = mp.get_context("fork")
    inq, outq = ctx.Queue(), ctx.Queue()
    w = ctx.Process(target=_helpers.queue_worker, args=(inq, outq))
    w.start()
    a = np.arange(1 << 18, dtype=np.int32)
    inq.put(a)
    r = outq.get(timeout=60)
    assert r[1] == float(a.sum(dtype=np.float64)) and r[3]
    inq.put(None)
    assert outq.get(timeout=60)[0] == "done"
    w.join(60)
    assert w.exitcode == 0


def test_small_arrays_are_pickled_by_value(big_daemon, reduction_to):
    reduction_to(big_daemon.socket)
    watcher = big_daemon.client()
    w, inq, outq = _helpers.spawn_queue_worker(_helpers.queue_worker)
    inq.put(np.arange(100))
    r = outq.get(timeout=60)
    assert r[1] == 4950.0 and not r[3] and r[4]
    inq.put(None)
    outq.get(timeout=60)
    w.join(60)
    assert watcher.stats()["creates"] == 0


def test_store_backed_array_is_sent_by_name(big_daemon, reduction_to):
    """An array that already lives in the store (e.g. from get_tensor) is not copied again,
    and a strided view of it arrives with its view geometry."""
    reduction_to(big_daemon.socket)
    c = big_daemon.client()
    base = c.put_tensor("existing", np.arange(1 << 18, dtype=np.float64).reshape(512, 512))
    w, inq, outq = _helpers.spawn_queue_worker(_helpers.queue_worker)
    view = base[::2, 1::3]
    inq.put(view)
    r = outq.get(timeout=60)
    assert r[1] == float(view.sum()) and r[2] == view.shape and r[3]
    inq.put(None)
    outq.get(timeout=60)
    w.join(60)
    assert c.stats()["creates"] == 1
    c.close()


def test_fallback_when_store_is_full(start_daemon, reduction_to):
    d = start_daemon(memory=1 << 20)
    reduction_to(d.socket)
    w, inq, outq = _helpers.spawn_queue_worker(_helpers.queue_worker)
    with pytest.warns(RuntimeWarning, match="by value"):
        from multiprocessing.reduction import ForkingPickler
        ForkingPickler.dumps(np.ones(1 << 18))  # 2 MiB > 1 MiB store
    inq.put(None)
    outq.get(timeout=60)
    w.join(60)
