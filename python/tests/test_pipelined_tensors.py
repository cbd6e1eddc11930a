"""A ``put_tensor`` of a host tensor up to 4 KiB, or of 64 KiB up to the lend's largest
object, returns the store's copy before the store answered (issue 27): the bytes are written
into the putter's small lend (or its lend) first, the PUBLISH goes out without waiting,
and the id, version and any failure come with the reply, read later. What must not change:
another process asking after the put returned finds the tensor; the result is the store's
memory, read-only, holding a reference that goes back when it is dropped or released; a name
already taken fails at once; a put the store refuses anyway is raised by ``sync()`` and by
``version_of`` of its result, whose bytes stay readable."""

import gc
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import vovp
from vovp.client import find_lease
from vovp.errors import ObjectExists

from _helpers import wait_for

# Asked right after the parent's put_tensor returned: no sync, no retry, no wait.
CHILD = textwrap.dedent("""
    import sys, numpy as np, vovp
    c = vovp.Client(sys.argv[1])
    for line in sys.stdin:
        name = line.strip()
        t = c.get_tensor(name)
        print(name, int(t.sum()), t.dtype, t.shape, flush=True)
""")


def test_a_small_put_returns_before_the_reply_and_another_process_finds_it(
        client, daemon, subprocess_env):
    child = subprocess.Popen([sys.executable, "-c", CHILD, daemon.socket],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=subprocess_env)
    try:
        for i in range(50):
            a = np.full((2, 4), i, dtype=np.int32)
            r = client.put_tensor(f"s{i}", a)
            # The store's copy, read-only, typed, before the store's answer was read.
            assert find_lease(r)._oid is None
            assert r.dtype == np.int32 and r.shape == (2, 4) and not r.flags.writeable
            np.testing.assert_array_equal(r, a)
            child.stdin.write(f"s{i}\n")
            child.stdin.flush()
            assert child.stdout.readline().split() == [f"s{i}", str(8 * i), "int32", "(2,",
                                                       "4)"]
        assert vovp.version_of(r) == 1
        assert find_lease(r).oid > 0
    finally:
        child.stdin.close()
        child.wait(10)


def test_a_put_through_the_lend_returns_before_the_reply_too(client, daemon, subprocess_env):
    """64 KiB up to the lend's largest object (1 MiB, a quarter of a 256 MiB store's lend)
    goes the same way through the putter's lend: the copy, then a PUBLISH not waited for."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, daemon.socket],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=subprocess_env)
    try:
        for i, n in enumerate([16 << 10, 64 << 10, 128 << 10] * 4):
            a = np.full(n, i, dtype=np.int32)
            r = client.put_tensor(f"l{i}", a)
            assert find_lease(r)._oid is None, "it waited for the store's answer"
            assert r.dtype == np.int32 and r.shape == (n,) and not r.flags.writeable
            np.testing.assert_array_equal(r, a)
            child.stdin.write(f"l{i}\n")
            child.stdin.flush()
            assert child.stdout.readline().split() == [f"l{i}", str(n * i), "int32", f"({n},)"]
            assert vovp.version_of(r) == 1
    finally:
        child.stdin.close()
        child.wait(10)
    # A racing put (the name taken by another client's unsealed object) fails at sync, and
    # its bytes stay readable however many puts follow.
    other = daemon.client()
    unsealed = other.create("l-racing", 16)
    r = client.put_tensor("l-racing", np.arange(64 << 10, dtype=np.int32))
    with pytest.raises(ObjectExists):
        client.sync()
    with pytest.raises(ObjectExists):
        vovp.version_of(r)
    for i in range(40):
        client.put_tensor(f"after{i}", np.full(64 << 10, i, dtype=np.int32))
        client.delete(f"after{i}")
        np.testing.assert_array_equal(r[:3], [0, 1, 2])
    np.testing.assert_array_equal(r, np.arange(64 << 10, dtype=np.int32))
    other.abort("l-racing")
    del unsealed, r
    other.close()


def test_the_result_is_the_stores_memory_and_holds_a_reference(client, daemon):
    watcher = daemon.client()
    r = client.put_tensor("mine", np.arange(6, dtype=np.float64))
    g = watcher.get_tensor("mine")
    np.testing.assert_array_equal(g, r)
    lr, lg = find_lease(r), find_lease(g)
    assert (lr.segment, lr.offset) == (lg.segment, lg.offset)
    assert {e["name"]: e for e in watcher.list()}["mine"]["refcount"] == 2
    del g
    gc.collect()
    assert client.release(r)
    assert wait_for(lambda: watcher.stats()["references"] == 0)
    # Dropped before its reply was read, by a client that makes no other call: the
    # reference the reply grants goes back all the same (the release thread reads it).
    client.put_tensor("dropped", np.zeros(3))
    gc.collect()
    assert wait_for(lambda: {e["name"]: e for e in watcher.list()}
                    .get("dropped", {}).get("refcount") == 0)
    watcher.close()


def test_a_taken_name_fails_at_once_and_a_racing_put_at_sync(client, daemon):
    client.put_tensor("p", np.zeros(2))
    client.sync()
    with pytest.raises(ObjectExists):
        client.put_tensor("p", np.ones(2))
    # Taken by another client's object that is not sealed yet: the shared directory cannot
    # show it, so the put goes out and the store refuses it.
    other = daemon.client()
    unsealed = other.create("racing", 16)
    r = client.put_tensor("racing", np.arange(2, dtype=np.int64))
    np.testing.assert_array_equal(r, [0, 1])
    with pytest.raises(ObjectExists):
        client.sync()
    client.sync()  # each failure is raised once
    with pytest.raises(ObjectExists):
        vovp.version_of(r)
    np.testing.assert_array_equal(r, [0, 1])  # its bytes stay readable
    # The other client's object is untouched.
    other.abort("racing")
    del unsealed, r
    gc.collect()
    # Replacing is not a failure.
    t = client.put_tensor("p", np.full(2, 7.0), replace=True)
    assert vovp.version_of(t) == 2
    np.testing.assert_array_equal(other.get_tensor("p"), [7.0, 7.0])
    other.close()


def test_a_batch_goes_out_as_few_messages_and_one_refused_put_fails_alone(
        client, daemon, subprocess_env):
    # The store refuses one put of the batch (its name is taken by another client's unsealed
    # object): the others are stored and another process finds them.
    other = daemon.client()
    unsealed = other.create("m-racing", 16)
    client.put_tensor("m-warm", np.zeros(1))  # the small lend, taken beforehand
    client.sync()
    before = client.core.requests_sent()
    tensors = {f"m{i}": np.full(3, i, dtype=np.int16) for i in range(20)}
    tensors["m-racing"] = np.arange(4)
    rs = client.put_tensors(tensors)
    sent = client.core.requests_sent() - before
    assert 1 <= sent <= 4, f"{sent} frames for 21 small puts (a PUBLISH_MANY per 8)"
    np.testing.assert_array_equal(rs["m-racing"], [0, 1, 2, 3])  # the caller's bytes
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent("""
            import sys, vovp
            c = vovp.Client(sys.argv[1])
            print(sum(int(c.get_tensor(f"m{i}").sum()) for i in range(20)),
                  c.contains("m-racing"))
        """), daemon.socket], capture_output=True, text=True, env=subprocess_env, timeout=60)
    assert child.stdout.split() == [str(3 * sum(range(20))), "False"], child.stderr
    with pytest.raises(ObjectExists):
        client.sync()
    with pytest.raises(ObjectExists):
        vovp.version_of(rs["m-racing"])
    assert [vovp.version_of(rs[f"m{i}"]) for i in range(20)] == [1] * 20
    other.abort("m-racing")
    del unsealed
    other.close()


def test_immediate_release_clients_wait_for_the_store(daemon):
    """``release_delay=0`` promises a reference back at once: without a release thread no one
    would read a dropped result's reply, so its puts wait for the store's answer."""
    import torch
    c = daemon.client(release_delay=0)
    r = c.put_tensor("w", np.zeros(4))
    assert find_lease(r)._oid is not None
    # A batch waits too.
    before = c.core.unread_replies
    rs = c.put_tensors({"b1": np.ones(2), "b2": torch.zeros(3), "b3": np.zeros(1)})
    assert c.core.unread_replies == before == 0
    assert all(find_lease(x)._oid is not None for x in rs.values())
    assert isinstance(rs["b2"], torch.Tensor)
    c.close()


def test_writable_and_torch_results_come_back_at_once_and_stay_private(daemon, client):
    """A writable result (``writable=True``, every torch result) of a small put is pipelined
    too: it views the store's copy through a private mapping, so writes to it stay in this
    process, while another process's get sees the bytes that were put."""
    import torch
    w = client.put_tensor("w", np.zeros(4), writable=True)
    t = client.put_tensor("t", torch.zeros(4, dtype=torch.int32))
    ts = client.put_tensors({"t1": torch.ones(2), "t2": torch.zeros(3)})
    # Not answered yet (a lease's id comes with the store's answer).
    assert find_lease(w)._oid is None and find_lease(t)._oid is None
    assert w.flags.writeable and isinstance(t, torch.Tensor)
    w[:] = 5.0
    t[:] = 7
    ts["t1"][:] = 9.0
    other = daemon.client()
    assert other.get_tensor("w", framework="numpy").tolist() == [0.0] * 4
    assert other.get_tensor("t", framework="numpy").tolist() == [0] * 4
    assert other.get_tensor("t1", framework="numpy").tolist() == [1.0, 1.0]
    # This process's own later gets show the store's bytes once its results are gone.
    assert w.tolist() == [5.0] * 4 and t.tolist() == [7] * 4
    del w, t, ts
    gc.collect()
    assert client.get_tensor("t").tolist() == [0] * 4
    assert vovp.version_of(client.get_tensor("w")) == 1
    other.close()


def test_numpy_sees_a_tensor_with_its_dtype_and_shape_and_never_past_the_object(client):
    """The native layout behind ``np.asarray(obj)`` (put and get paths): the tensor's own
    dtype and shape for the headers numpy can show as they are; one that does not fit the
    object is refused (numpy would read past it); anything else keeps the uint8 view."""
    a = np.arange(12, dtype=np.int16).reshape(3, 4)
    client.put_tensor("lay", a)
    client.put("raw", b"x" * 16)
    client.sync()
    obj = client.core.native.get1("lay")
    assert obj.tensor_plan is not None
    arr = np.asarray(obj)
    assert arr.dtype == np.int16 and arr.shape == (3, 4) and not arr.flags.writeable
    np.testing.assert_array_equal(arr, a)
    raw = client.core.native.get1("raw")
    assert raw.tensor_plan is None
    assert np.asarray(raw).dtype == np.uint8
    with pytest.raises(ValueError):
        raw.set_layout("f", 8, [3])  # 24 bytes over 16
    with pytest.raises(ValueError):
        raw.set_layout("O", 8, [2])  # not a plain numpy kind
    raw.set_layout("u", 4, [2, 2])
    assert np.asarray(raw).shape == (2, 2)
    # Big-endian and bfloat16 headers go the Python way, as before.
    big = client.put_tensor("big-endian", np.arange(3, dtype=">i4"))
    np.testing.assert_array_equal(client.get_tensor("big-endian"), [0, 1, 2])
    del big, arr, obj, raw
