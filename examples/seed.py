#!/usr/bin/env python3
"""The seed document's program, verbatim calls, runnable: torch tensors through vovp.

    vovp-engine -m 1000000000 -s /tmp/dgl_socket &      # the seed's plasma-store-server line
    python examples/seed.py /tmp/dgl_socket

1. One process puts a torch tensor under a name; another process gets it by name alone: a
   torch tensor over the same store memory (same segment and offset).
2. ``vovp.init_client(path); vovp.init_reduction()``: tensors sent through a multiprocessing
   Queue travel through the store of ``path`` (not the default socket), zero-copy.

Prints one JSON line with what each process saw (python/tests/test_examples.py checks it).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
from typing import Any

import torch as th

import vovp
from vovp.client import find_lease


def another_process(path: str, out: Any) -> None:
    # The seed's "In another process" block.
    client = vovp.init_client(path)
    ret_a2 = client.get_tensor("test111")  # Exact same underlying memory with ret_a
    lease = find_lease(ret_a2)
    assert lease is not None
    out.put(dict(type=type(ret_a2).__module__ + "." + type(ret_a2).__name__,
                 values=ret_a2.tolist(), where=[lease.segment, lease.offset]))


def receiver(q: Any, out: Any) -> None:
    t = q.get()
    out.put(dict(type=type(t).__module__ + "." + type(t).__name__, sum=float(t.sum()),
                 through_store=find_lease(t) is not None))


def main(path: str) -> None:
    # The seed's "In one process" block.
    client = vovp.init_client(path)
    a = th.tensor([[1, 2, 3], [5, 4, 6]])  # a can be a CUDA tensor
    ret_a = client.put_tensor("test111", a)  # ret_a has same value with a, memory of the store
    lease = find_lease(ret_a)
    assert lease is not None
    report: dict[str, Any] = dict(put=dict(values=ret_a.tolist(), where=[lease.segment, lease.offset]))

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=another_process, args=(path, out))
    p.start()
    report["get"] = out.get(timeout=120)
    p.join(60)

    # The seed's "Direct use KV store for pickling between process" block.
    client = vovp.init_client(path)
    vovp.init_reduction()
    q = ctx.Queue()
    p = ctx.Process(target=receiver, args=(q, out))
    p.start()
    q.put(th.arange(1 << 16, dtype=th.float32))  # 256 KiB: sent by name through the store
    report["queue"] = out.get(timeout=120)
    p.join(60)
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/dgl_socket")
