"""Weight sync across nodes with vovp.cluster: a trainer publishes each version of its weights,
rollout workers on every node read the newest one from their own node's store, zero-copy.

    python examples/cluster_weights.py            # a local Ray cluster (ray.init())
    RAY_ADDRESS=auto python examples/cluster_weights.py   # a running one

Until versioned names land (issue "Versions"), each version gets its own name and the old one
is unpublished once the workers moved on.
"""

from __future__ import annotations

import numpy as np
import ray

import vovp.cluster as vc


@ray.remote(num_cpus=0)
def rollout(name: str) -> tuple[str, float]:
    w = vc.fetch(name, timeout=60)  # copied once to this node, then local to every process
    return vc.node_id()[:8], float(w.sum())


def main() -> None:
    vc.init(memory="512M")  # starts Ray if none is running; a store and agent per node
    for version in range(3):
        name = f"policy-v{version}"
        weights = np.full((1024, 256), version, dtype=np.float32)
        vc.publish(name, weights)
        vc.broadcast(name)  # staged on every node before the workers ask
        for node, total in ray.get([rollout.remote(name) for _ in range(4)]):
            assert total == float(weights.sum())
            print(f"version {version}: node {node} read {total:.0f}")
        if version:
            vc.unpublish(f"policy-v{version - 1}")
    vc.unpublish("policy-v2")


if __name__ == "__main__":
    main()
