"""Gets without a message (issue 13) from Python: the native core reads the daemon's shared
directory and records holds in this client's hold table. What must not change: the bytes,
dtype and shape, the reference counts the daemon reports, deferred deletes, a dead process's
holds."""

import gc
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from _helpers import requests_after_first_get, wait_for


def test_a_get_sends_no_request_and_counts_as_a_reference(client, daemon):
    a = np.arange(16, dtype=np.float32).reshape(4, 4)
    client.put_tensor("t", a)
    client.put_tensor("first", a)
    client.sync()  # (a small put_tensor returns before the store applied it)
    other = daemon.client()
    # Small put_tensors live in the putter's arena: the first get from it maps that arena
    # (one SEGMENT request per arena, kept mapped), every get after it sends nothing.
    before = requests_after_first_get(other, "first")
    g = other.get_tensor("t")
    assert other.core.requests_sent() == before
    assert g.dtype == np.float32 and g.shape == (4, 4)
    np.testing.assert_array_equal(g, a)
    st = client.stats()
    assert st["shared_holds"] == 1 and st["references"] == 1
    assert {e["name"]: e for e in client.list()}["t"]["refcount"] == 1
    del g
    gc.collect()
    st = client.stats()
    assert st["shared_holds"] == 0 and st["references"] == 0

    t = other.get_tensor("t", framework="torch")
    assert isinstance(t, torch.Tensor) and torch.equal(t, torch.from_numpy(a))
    assert other.core.requests_sent() == before
    del t
    gc.collect()
    assert client.stats()["shared_holds"] == 0
    other.close()


def test_shared_reads_can_be_turned_off(client, daemon):
    client.put_tensor("t", np.arange(4))
    client.put_tensor("first", np.arange(4))
    client.sync()  # (a small put_tensor returns before the store applied it)
    other = daemon.client(shared_reads=False)
    del_first = other.get_tensor("first")  # maps the putter's arena (a SEGMENT request)
    del del_first
    gc.collect()
    other.flush()
    before = other.core.requests_sent()
    g = other.get_tensor("t")
    assert other.core.requests_sent() == before + 1
    assert client.stats()["shared_holds"] == 0 and client.stats()["references"] == 1
    del g
    other.close()


CHILD = textwrap.dedent("""
    import sys, time, numpy as np, vovp
    c = vovp.Client(sys.argv[1])
    a = c.get_tensor("big")
    assert c.core.requests_sent() == 0, c.core.requests_sent()
    print(int(a.sum()), flush=True)
    time.sleep(3600)
""")


def test_delete_while_a_killed_process_held_it(client, daemon, subprocess_env):
    # Put inline: segment 0, mapped by all (objects over 256 KiB, or of 64 KiB and more put
    # through a lend, go to the putter's arena).
    a = np.arange(8_000, dtype=np.int64)
    client.put_tensor("big", a)
    child = subprocess.Popen([sys.executable, "-c", CHILD, daemon.socket],
                             stdout=subprocess.PIPE, env=subprocess_env)
    try:
        assert int(child.stdout.readline()) == int(a.sum())
        assert client.stats()["shared_holds"] == 1
        client.delete("big")
        assert not client.contains("big")
        assert client.stats()["pending_delete"] == 1
        # The held memory is not reused while the child holds it.
        for i in range(20):
            client.put_tensor(f"fill{i}", np.full(8_000, -1, dtype=np.int64))
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        assert wait_for(lambda: client.stats()["shared_holds"] == 0
                        and client.stats()["pending_delete"] == 0, timeout=20)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
