"""vovp across machines, on Ray: the same names on every node, weight broadcast, partitioned
tensors pulled by id.

    import vovp.cluster as vc
    vc.init()                                   # joins (or starts) the Ray cluster
    vc.publish("weights", torch.randn(1024, 1024))
    w = vc.fetch("weights")                     # on any node: zero-copy from the local store
    vc.register_transport()                     # @ray.method(tensor_transport="vovp")

Every node runs its own vovp store and exactly one agent (a Ray actor pinned to the node);
a directory actor on the head node records which node holds which name. Ray provides the
membership, the failure detection and the control messages; the bytes go from one node's store
straight into the other's (ARCHITECTURE.md, "Across machines"). Needs ``pip install
"vovp[cluster]"`` (Ray).
"""

from __future__ import annotations

try:
    import ray  # noqa: F401 - only to fail early, with how to install it
except ImportError as e:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        'vovp.cluster needs Ray: pip install "vovp[cluster]" (or pip install "ray>=2.9")'
    ) from e

from ..errors import ObjectLost
from ._api import (
    DEFAULT_SOCKET,
    agent_stats,
    broadcast,
    client,
    delete,
    fetch,
    init,
    names,
    node_id,
    nodes,
    publish,
    shutdown,
    stats,
    unpublish,
)
from ._dist import DistTensor


def register_transport() -> None:
    """Register vovp as Ray's tensor transport "vovp" (``@ray.method(tensor_transport="vovp")``
    for CPU torch tensors; ``_ray_transport``). Imported on first use: only recent Rays have the
    direct-transport API (alpha; tested with Ray 2.60), and the rest of vovp.cluster works
    with older ones."""
    from ._ray_transport import register_transport as register

    register()


__all__ = [
    "init",
    "shutdown",
    "client",
    "publish",
    "fetch",
    "unpublish",
    "delete",
    "broadcast",
    "names",
    "nodes",
    "node_id",
    "agent_stats",
    "stats",
    "DistTensor",
    "register_transport",
    "ObjectLost",
]
