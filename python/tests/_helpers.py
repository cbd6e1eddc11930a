"""Helpers shared by the tests, importable by spawned worker processes."""

from __future__ import annotations

import gc
import os
import time

import numpy as np


def wait_for(predicate, timeout=10.0, interval=0.02):
    """Poll ``predicate`` until it is true or ``timeout`` passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        v = predicate()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(interval)


def store_backed(arr) -> bool:
    """Whether ``arr`` is a view of store memory held by a vovp client of this process."""
    from vovp.client import find_lease

    return find_lease(arr) is not None


def queue_worker(inq, outq):
    """Receive arrays until None; report (pid, sum, shape, store-backed, writeable) for each."""
    while True:
        arr = inq.get()
        if arr is None:
            break
        outq.put((os.getpid(), float(np.sum(arr, dtype=np.float64)), arr.shape,
                  store_backed(arr), bool(arr.flags.writeable)))
        del arr
        gc.collect()
    outq.put(("done", os.getpid()))


def args_worker(arr, outq):
    """Process(args=(arr,)) target: report what arrived."""
    outq.put((float(np.sum(arr, dtype=np.float64)), store_backed(arr)))


def result_worker(n, outq):
    """Send a large array back and return at once (the process then exits).

    A spawned child starts without vovp's reducers: it registers them itself, finding the
    socket through $VOVP_SOCKET, which the parent's init_reduction exported.
    """
    import vovp

    vovp.init_reduction()
    outq.put(np.full(n, 7, dtype=np.int32))


def torch_queue_worker(inq, outq):
    """Receive torch tensors until None; report (sum, dtype, shape, store-backed) for each."""
    while True:
        t = inq.get()
        if t is None:
            break
        outq.put((float(t.double().sum()), str(t.dtype), tuple(t.shape), store_backed(t)))
        del t
        gc.collect()
    outq.put("done")
