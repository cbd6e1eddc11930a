"""Node features partitioned across nodes (DistDGL's DistTensor, on Ray): each node keeps its
rows in its own vovp store; trainers pull rows by id, in the ids' order, from wherever they live.

    python examples/dist_features.py              # a local Ray cluster (ray.init())
    RAY_ADDRESS=auto python examples/dist_features.py     # a running one
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import ray

import vovp.cluster as vc

ROWS, DIM = 100_000, 64


def batch(seed: int) -> npt.NDArray[np.int64]:
    return np.random.default_rng(seed).integers(0, ROWS, 1024)


@ray.remote(num_cpus=0)
def trainer(seed: int) -> int:
    feats = vc.DistTensor("feat")  # attach by name
    ids = batch(seed)  # a mini-batch's nodes
    rows = feats.pull(ids)
    # Row i starts as i everywhere; other trainers' pushes may have added to it meanwhile.
    assert (rows == rows[:, :1]).all() and (rows[:, 0] >= ids).all()
    grad = np.ones((len(ids), DIM), np.float32)
    feats.push(ids, grad, op="add")  # e.g. a sparse embedding update
    local = feats.local_partition()  # this node's rows, zero-copy
    return 0 if local is None else len(local)


def main() -> None:
    vc.init(memory="512M")
    feats = vc.DistTensor("feat", (ROWS, DIM), np.float32)  # range partition over the nodes
    ids = np.arange(ROWS)
    feats.push(ids, np.repeat(ids[:, None].astype(np.float32), DIM, axis=1))
    print("local rows per trainer's node:", ray.get([trainer.remote(s) for s in range(4)]))
    # Every trainer's "add" landed once per occurrence of an id in its batch.
    expect = ids + np.bincount(np.concatenate([batch(s) for s in range(4)]), minlength=ROWS)
    assert np.array_equal(feats.pull(ids)[:, 0], expect.astype(np.float32))
    print("after the pushes, rows 0-4:", feats.pull(ids[:5])[:, 0])
    feats.delete()


if __name__ == "__main__":
    main()
