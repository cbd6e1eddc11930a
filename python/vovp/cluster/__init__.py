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
straight into the other's. Needs ``pip install "vovp[cluster]"`` (Ray). The package is pure
Python over ``vovp.Client``; vovp has no cluster layer of its own.

Modules (dependencies run one way, down this list):

- ``__init__``: the public surface; fails early without Ray (saying how to install it).
- ``_api``: the calls (``init``, ``publish``, ``fetch``, ``broadcast``, ``unpublish``,
  ``client``...), per-process handle caches, ``call`` (actor exceptions come out as themselves,
  Ray's timeouts as ``TimeoutError``, a dead agent as ``VovpError``).
- ``_directory``: ``Directory``, a named detached actor (``vovp-directory``, namespace ``vovp``)
  pinned to the head node by its ``node:__internal_head__`` resource: name -> ``Entry`` (owner
  node, holder nodes, size, the object's metadata bytes verbatim, version), DistTensor specs,
  the cluster's config (the first ``init`` fixes it). Threaded: ``lookup(name, timeout)`` waits
  on a condition.
- ``_agent``: ``Agent``, one per node (``vovp-agent-<node id>``, hard node affinity,
  ``num_cpus=0``, threaded, created with ``get_if_exists`` by whoever needs it first, so nodes
  that join later get theirs on first use): the node's store, pulls, offers, DistTensor
  partitions.
- ``_stream``: the data path: ``StreamServer`` (one listener per agent on the node's Ray IP) and
  ``receive``.
- ``_dist``: ``DistTensor``: partition books, ``pull``/``push`` fan-out.

Nodes are named by Ray node id, never by IP (every node of a local cluster is 127.0.0.1);
stores of nodes that share a machine get sockets from a template (``socket="...{node}..."``).

Fetch (process P on node B, name N owned by node A)::

    P: local get(N) -- hit --> done (zero-copy)
     `- miss: agent_B.ensure(N): one in flight per name; other callers wait on its Future
          agent_B: directory.lookup(N) -> Entry{holders, size, metadata, version}
          agent_B: agent_A.offer(N) -> (size, metadata, (ip, port), ticket)
                   agent_A holds a reference until the stream is done or 60 s pass
          agent_B: create(N, size, metadata) in B's store; TCP connect, send the ticket;
                   agent_A: sendall(view of A's store memory); agent_B: recv_into(the object)
          agent_B: seal(N)  (any failure: abort; the unsealed object was never visible)
          agent_B: directory.add_holder(N, B, version)  (not awaited)
    P: local get(N) -> zero-copy

Why a TCP stream and not Ray's object transfer: bytes returned through Ray land in the receiving
node's Ray object store, and one more copy puts them into vovp's; the stream writes them into
the object the agent created, one copy on the receiver. Measured side by side (BENCHMARKS.md,
"Across machines") the Ray path (``transport="ray"``, kept for that comparison) reaches about a
third of the stream's throughput. What remains on one machine is page faults of the fresh
destination pages (a raw loopback probe: 0.7 GB/s into fresh pages, 2.0 GB/s into touched ones).

Broadcast: rounds in which every holder sends to up to ``fanout`` nodes lacking the object,
newest copies first; ``fanout=1`` is a binomial tree.

DistTensor: partition k is the store object ``<name>/part-<k>`` on ``nodes[k]``, created (zeros)
by that node's agent, which keeps the creator's writable view (the store lets a creator write
after its seal) and applies pushes under a per-partition lock (``"add"`` uses ``np.add.at``:
repeated ids add up). An id-map partition's book is itself a published object (``<name>/book``),
fetched once per node. ``pull`` groups ids by partition, sends one ``dist_pull`` per remote node
(rows come back through Ray), gathers local rows from the zero-copy local view meanwhile, and
scatters every row into the ids' order.

Failures: a call to a dead node's agent fails at once (``RayActorError``); a stream that ends
early or stalls for ``stall_timeout`` seconds fails. Either way the agent asks whether the holder
is alive (Ray's node table, then the agent itself); a dead holder is dropped from the entry and
the next one tried; when none is left, ``ObjectLost`` names the dead nodes. A live holder whose
transfer broke is a ``VovpError`` saying why. A node that comes back is a new Ray node: new id,
new agent, empty store. The directory dies with the head node, as the Ray cluster does.

Trust model: Ray runs whatever code reaches it, so anyone who can reach the Ray cluster can call
the agents (read or delete any published object, push into DistTensors): run Ray on a private
network. The stream listener sends only to a connection presenting a live one-time 128-bit
ticket, which only an agent call hands out; the bytes are not encrypted. A push handler
(``op=callable``) is the caller's code run in the owning agent under the partition's lock:
trusted, like everything sent to Ray.

Known limits: the directory and each agent are threaded actors with 64 threads; a call that
waits (a ``lookup`` or ``dist_spec`` with a timeout, a follower of an in-flight fetch) holds one
for its wait, so more than 64 simultaneous waits on one actor queue the calls behind them (bounded
by their timeouts); an asyncio directory would lift it. Not tested on one machine: RDMA/NCCL data
paths (Ray's direct tensor transport, NIXL) would replace ``_stream`` for GPU-resident or
InfiniBand clusters; CUDA objects across nodes are not supported (``fetch`` of a CUDA object's
name fails in ``offer``, which has no host bytes to send); a real network's failure modes (a
half-open TCP connection) rely on ``stall_timeout``.
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
