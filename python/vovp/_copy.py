"""Copies into the store's memory: ``copy_into`` splits large ones across threads.

A byte-for-byte copy (same dtype, both C-contiguous) is the native one every other large put
makes (``vovp_shm::copy::parallel_copy``, the rayon pool); one numpy must convert (byte order)
or walk strides goes to a small thread pool of numpy copies.
"""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import _native

# Copies larger than this are split across the copy pool.
PARALLEL_COPY_MIN = 1 << 20
# Slabs of a large copy at most, and threads of the copy pool (the caller copies slabs too, so
# at most _WORKERS - 1 pool threads work at once). Asked once: os.cpu_count() reads /sys on
# every call (6 µs here, 60 µs after a garbage collection), which every large put paid.
_WORKERS = max(1, min(8, os.cpu_count() or 1))

_POOL = None
_POOL_LOCK = threading.Lock()


def _copy_pool():
    global _POOL
    if _POOL is None:
        with _POOL_LOCK:
            if _POOL is None:
                _POOL = ThreadPoolExecutor(_WORKERS, thread_name_prefix="vovp-copy")
    return _POOL


def _reset_pool_after_fork():
    # The pool's threads do not exist in a forked child, and the lock may have been held by
    # one of the parent's other threads.
    global _POOL, _POOL_LOCK
    _POOL = None
    _POOL_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_reset_pool_after_fork)


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` (same shape, dtypes equal up to byte order), in parallel when large.

    A few threads each copying a slab get close to memory bandwidth instead of the ~one-core
    speed of a single memcpy: the native copy's rayon pool for a byte-for-byte copy, numpy's
    copies (which release the GIL) on the copy pool for one that converts or walks strides.
    """
    nbytes = dst.nbytes
    workers = _WORKERS
    if nbytes < PARALLEL_COPY_MIN * 2 or workers < 2:
        np.copyto(dst, src, casting="equiv")
        return
    dt = dst.dtype
    if (dt == src.dtype and dt.names is None and not dt.hasobject and dst.shape == src.shape
            and dst.flags.c_contiguous and src.flags.c_contiguous):
        if not _native.copy_bytes(dst, src):
            np.copyto(dst, src)  # they overlap: numpy copies through a buffer
        return
    if np.may_share_memory(dst, src):  # (slabs copied at once would read what others wrote)
        np.copyto(dst, src, casting="equiv")
        return
    if src.flags.c_contiguous:
        d, s = dst.reshape(-1), src.reshape(-1)
    elif dst.ndim >= 1 and dst.shape[0] >= 2:
        d, s = dst, src  # split along the first axis; each slab is a strided copy
    else:
        np.copyto(dst, src, casting="equiv")
        return
    n = d.shape[0]
    parts = min(workers, max(1, nbytes // PARALLEL_COPY_MIN), n)
    bounds = [n * i // parts for i in range(parts + 1)]
    # Slabs are claimed (like vovp::parallel_copy's chunks): the calling thread copies slabs
    # too and then waits only for slabs a pool thread is copying, never for a sleeping pool
    # thread to wake up and start (after a pause that wake-up cost more than it saved).
    claims = itertools.count()
    done = [threading.Event() for _ in range(parts)]
    errors = []

    def copy_claimed():
        while (i := next(claims)) < parts:  # next() on a count is atomic under the GIL
            try:
                np.copyto(d[bounds[i]:bounds[i + 1]], s[bounds[i]:bounds[i + 1]],
                          casting="equiv")
            except BaseException as e:  # noqa: BLE001 (re-raised by the caller below)
                errors.append(e)
            finally:
                done[i].set()

    pool = _copy_pool()
    for _ in range(1, parts):
        pool.submit(copy_claimed)
    copy_claimed()
    for e in done:
        e.wait()
    if errors:
        raise errors[0]
