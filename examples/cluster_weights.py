"""Weight sync across nodes with vovp.cluster: a trainer publishes each version of its weights
under one name (``replace=True``), rollout workers on every node wait for a newer version than
the one they hold (``newer_than``) and read it from their own node's store, zero-copy. The
bytes go engine to engine, once per node, however many workers a node has.

    python examples/cluster_weights.py            # a local Ray cluster (ray.init())
    RAY_ADDRESS=auto python examples/cluster_weights.py   # a running one
"""

from __future__ import annotations

import time

import numpy as np
import ray

import vovp.cluster as vc

STEPS = 3


@ray.remote(num_cpus=0)
def rollout() -> tuple[str, list[int]]:
    """A worker: read every version newer than the one it holds, until the trainer's last."""
    v, seen = 0, []
    while True:
        w = vc.fetch("policy", newer_than=v, timeout=60)  # waits for a newer version
        v = vc.version_of(w)
        seen.append(int(w[0, 0]))  # a version is whole: every element is its step
        assert (w == w[0, 0]).all()
        if w[0, 0] == STEPS - 1:
            return vc.node_id()[:8], seen


def main() -> None:
    vc.init(memory="512M")  # starts Ray if none is running; a store and agent per node
    follows = [rollout.remote() for _ in range(4)]
    for step in range(STEPS):
        weights = np.full((1024, 256), step, dtype=np.float32)  # the trainer's new weights
        w = vc.publish("policy", weights, replace=True)  # the name's next version
        print(f"step {step}: published version {vc.version_of(w)}")
        time.sleep(0.2)  # training
    for node, seen in ray.get(follows):
        # A worker slower than the trainer skips versions; it never sees an older one.
        assert seen == sorted(seen) and seen[-1] == STEPS - 1
        print(f"node {node}: read steps {seen}")
    vc.unpublish("policy")


if __name__ == "__main__":
    main()
