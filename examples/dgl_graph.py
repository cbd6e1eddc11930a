#!/usr/bin/env python3
"""DGL-style graph sharing: a launcher puts a graph once, N trainers get it by name alone.

    vovp-engine -m 1G -s /tmp/vovp.sock &
    python examples/dgl_graph.py /tmp/vovp.sock --trainers 4 --nodes 100000 --feat-dim 64

The launcher builds a random graph in CSR form (``indptr``, ``indices``, int64) with node
features (float32, nodes x feat-dim) and puts the three tensors into the store once. Each
trainer process knows only the graph's name: ``get_tensors`` of the three names returns torch
tensors over the store's memory (no copy, no shape or dtype passed around: they are in the
tensor headers). A trainer then runs one "layer" of mean neighbour aggregation over its share
of the nodes and reports a checksum, plus where each tensor lives in the store, so the launcher
can check that every trainer read the very bytes it put (same segment and offset), and that the
results equal its own computation.

Prints one JSON line (python/tests/test_examples.py runs this with a small graph).
"""

import argparse
import json
import multiprocessing as mp
from typing import Any

import torch

import vovp
from vovp.client import find_lease

PARTS = ("indptr", "indices", "feat")


def random_graph(nodes: int, avg_degree: int, feat_dim: int,
                 seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    degree = torch.randint(0, 2 * avg_degree + 1, (nodes,), generator=g)
    indptr = torch.zeros(nodes + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(degree, 0)
    indices = torch.randint(0, nodes, (int(indptr[-1]),), generator=g)
    feat = torch.randn(nodes, feat_dim, generator=g)
    return {"indptr": indptr, "indices": indices, "feat": feat}


def mean_aggregate(indptr: torch.Tensor, indices: torch.Tensor, feat: torch.Tensor,
                   nodes: torch.Tensor) -> torch.Tensor:
    """Mean of the neighbours' features for each node in ``nodes`` (0 when it has none)."""
    start, end = indptr[nodes], indptr[nodes + 1]
    deg = end - start
    # Edge ids of all the selected nodes, concatenated; then which node each edge belongs to.
    owner = torch.repeat_interleave(torch.arange(len(nodes)), deg)
    offsets = torch.arange(int(deg.sum())) - torch.repeat_interleave(
        torch.cumsum(deg, 0) - deg, deg)
    neigh = indices[torch.repeat_interleave(start, deg) + offsets]
    out = torch.zeros(len(nodes), feat.shape[1])
    out.index_add_(0, owner, feat[neigh])
    return out / deg.clamp(min=1).unsqueeze(1)


def where(t: Any) -> list[int | None]:
    lease = find_lease(t)
    assert lease is not None, "not a store-backed tensor"
    return [lease.segment, lease.offset]


def trainer(socket: str, graph: str, rank: int, world: int, out: Any) -> None:
    client = vovp.init_client(socket)
    # By name alone; waits up to 60 s for the launcher's put if this trainer started first.
    indptr, indices, feat = client.get_tensors([f"{graph}/{p}" for p in PARTS], timeout=60)
    nodes = torch.arange(rank, indptr.numel() - 1, world)
    h = mean_aggregate(indptr, indices, feat, nodes)
    out.put(dict(rank=rank, checksum=float(h.double().sum()),
                 types=[type(t).__module__ for t in (indptr, indices, feat)],
                 where={p: where(t) for p, t in zip(PARTS, (indptr, indices, feat))}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("socket")
    ap.add_argument("--trainers", type=int, default=4)
    ap.add_argument("--nodes", type=int, default=100_000)
    ap.add_argument("--avg-degree", type=int, default=10)
    ap.add_argument("--feat-dim", type=int, default=64)
    ap.add_argument("--name", default="graph")
    args = ap.parse_args()

    client = vovp.init_client(args.socket)
    graph = random_graph(args.nodes, args.avg_degree, args.feat_dim)
    # Put once; the launcher keeps its own zero-copy views (the store's copies).
    stored = client.put_tensors({f"{args.name}/{p}": graph[p] for p in PARTS})
    mine = {p: where(stored[f"{args.name}/{p}"]) for p in PARTS}

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=trainer, args=(args.socket, args.name, r, args.trainers, out))
             for r in range(args.trainers)]
    for proc in procs:
        proc.start()
    reports = sorted((out.get(timeout=300) for _ in procs), key=lambda r: r["rank"])
    for proc in procs:
        proc.join(60)
    expect = [float(mean_aggregate(graph["indptr"], graph["indices"], graph["feat"],
                                   torch.arange(r, args.nodes, args.trainers)).double().sum())
              for r in range(args.trainers)]
    print(json.dumps(dict(
        bytes=sum(t.numel() * t.element_size() for t in graph.values()),
        zero_copy=all(r["where"] == mine for r in reports),
        torch=all(r["types"] == ["torch"] * 3 for r in reports),
        checksums_match=[abs(r["checksum"] - e) <= 1e-6 * max(1.0, abs(e))
                         for r, e in zip(reports, expect)],
        exit_codes=[proc.exitcode for proc in procs])))
    for part in PARTS:
        client.delete(f"{args.name}/{part}")


if __name__ == "__main__":
    main()
