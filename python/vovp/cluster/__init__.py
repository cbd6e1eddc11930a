"""vovp across machines, on Ray: versioned names on every node, weight sync, partitioned
tensors pulled by id.

    import vovp.cluster as vc
    vc.init()                                   # joins (or starts) the Ray cluster
    vc.publish("weights", w, replace=True)      # writer: the name's next version, cluster-wide
    w = vc.fetch("weights", newer_than=v, timeout=60)   # reader: a newer one, zero-copy
    v = vc.version_of(w)
    vc.register_transport()                     # @ray.method(tensor_transport="vovp")

Every node runs its own vovp store (``vovp-engine``, serving transfers to the other engines
on a TCP port of the node's Ray IP) and exactly one agent (a Ray actor pinned to the node that
starts the engine); a directory actor on the head node numbers every name's versions and
records which nodes hold the current one. Ray provides the membership, the failure detection
and the control messages; the bytes go from one node's engine straight into the other's (Rust,
several TCP streams, no Python). Needs ``pip install "vovp[cluster]"`` (Ray). The package is
pure Python over ``vovp.Client``; vovp has no cluster layer of its own.

Modules (dependencies run one way, up this list):

- ``__init__``: the public surface; fails early without Ray (saying how to install it).
- ``_api``: the calls (``init``, ``publish``, ``fetch``, ``broadcast``, ``unpublish``,
  ``client``, ``transfer_address``...), per-process handle caches, and publish's steps
  (``reserve``, ``put_version``, ``commit``).
- ``_agent``: ``Agent``, one per node (``vovp-agent-<node id>``, hard node affinity,
  ``num_cpus=0``, created with ``get_if_exists`` by whoever needs it first, so nodes that join
  later get theirs on first use): starts the node's engine with ``--transfer <node ip>:0``
  and the cluster's key, registers its transfer address, fetches for ``broadcast``, deletes
  for ``unpublish``, keeps DistTensor partitions, reports metrics (``_metrics``).
- ``_fetch``: the fetch walk (local store, location cache, directory, FETCH to this node's
  engine, failures) and ``call``/``directory_call``.
- ``_directory``: ``Directory``, a named detached **asyncio** actor (``vovp-directory``,
  namespace ``vovp``) pinned to the head node: per name the newest committed version, its
  size, metadata, holders and their transfer addresses; version numbers; DistTensor specs;
  the cluster's config (the first ``init`` fixes it, the transfer key included).
- ``_dist``: ``DistTensor``: partition books, ``pull`` (GATHERs) / ``push`` fan-out.
- ``_state``: ``publish_state``/``fetch_state``: a state dict as one versioned object (its
  layout, the writer's hashed copy, the receiver's unchanged ranges).

Nodes are named by Ray node id, never by IP (every node of a local cluster is 127.0.0.1);
stores of nodes that share a machine get sockets from a template (``socket="...{node}..."``).

Versions. A cluster version is a store version: ``publish(name, t, replace=True)`` asks the
directory for the next number (``reserve``: two racing writers get two), puts ``t`` into its
node's store sealed as exactly that version (``PutOptions.version``), then tells the directory
(``commit``), which makes it current and wakes the readers waiting for it. Only committed
versions are offered to other nodes: a writer that dies between reserve and commit leaves the
previous version current everywhere (and a gap in the numbers); only its own node's store,
which sealed the put, shows that version to local gets. A fetched copy is sealed in
the receiving store as the same version, so ``vc.version_of`` (``vovp.version_of``) of any
copy is the cluster's version. A store's replace keeps whatever readers hold: a node's old
version is freed with its last local holder.

Fetch (process P on node B; ``newer_than=v``)::

    P: B's store has a version > v?  -- yes --> done (zero-copy)
     `- no: P -> directory.wait_newer(name, v, timeout)    one control message; it answers
              when a version > v is committed: {version, holders, their transfer addresses}
              (skipped when P's location cache knows a holder of such a version)
            P -> B's engine: FETCH(holder address, name, version)   the engine mints a
              one-time ticket, pulls over several TCP streams from the holder's engine into
              its store, seals; every FETCH of that version on B shares the one transfer
            P -> directory.add_holder(name, B, version)   not awaited
    P: the tensor, zero-copy from B's store

Failures: a FETCH from a dead holder fails (connection refused or reset: TransferFailed); the
walk then asks Ray's node table (and the holder's agent): a dead node is dropped from every
entry (``drop_node``: its store died with it) and the next holder tried; when none is left,
``ObjectLost`` names the dead nodes. A holder alive but without the version any more
(replaced, evicted) is dropped as its holder. A reader node that dies takes its copies with
it. A fetch that completes after an ``unpublish``: its late ``add_holder`` makes the
directory tell that node's agent to delete the copy. The directory dies with the head node,
as the Ray cluster does: every call to it is bounded (``wait`` + 60 s) and fails with a
VovpError naming it, never hangs. A node that comes back is a new Ray node: new id, new
agent, empty store.

Broadcast: rounds in which every holder is the source of up to ``fanout`` nodes lacking the
newest version (their agents send FETCH to their engines), newest copies first; ``fanout=1``
is a binomial tree.

DistTensor: partition k is the store object ``<name>/part-<k>`` on ``nodes[k]``, created (zeros)
by that node's agent, which keeps the creator's writable view (the store lets a creator write
after its seal) and applies pushes under a per-partition lock (``"add"`` uses ``np.add.at``:
repeated ids add up). An id-map partition's book is itself a published object (``<name>/book``),
fetched once per node. ``pull`` groups ids by partition and sends one GATHER per remote
partition to this node's engine (in parallel, from a small thread pool), which pulls those rows
from the holder's engine into an ephemeral scratch object (no Ray call, no Ray object store);
local rows come from the zero-copy local view meanwhile; every row is scattered into the ids'
order and the scratch objects released (gone).

State dicts (``_state``): ``publish_state`` makes a whole dict one store object, versioned as
any name, its tensors copied straight into it and hashed in the same pass; ``fetch_state``
moves it in one FETCH per node, naming the tensors whose hashes did not change since the
version the node holds as base ranges (copied locally, not sent), and returns views.

Trust model: Ray runs whatever code reaches it, so anyone who can reach the Ray cluster can call
the agents (read or delete any published object, push into DistTensors) and read the
cluster's transfer key, which travels in Ray's control path (the directory's config, the
agents' engine environments): run Ray on a private network. An engine serves a transfer only
for a one-time ticket MACed with that key (PROTOCOL.md, "Transfers between engines"; stolen
and replayed tickets get nothing: tests/tests/transfer.rs); the bytes are not encrypted. A
push handler (``op=callable``) is the caller's code run in the owning agent under the
partition's lock: trusted, like everything sent to Ray.

Known limits: an agent is a threaded actor (64 threads) for DistTensor pushes and broadcast;
fetches and waits do not go through it. CUDA objects across nodes are not supported
(``publish`` takes host tensors); RDMA/NCCL data paths are not used. A real network's failure
modes (a half-open TCP connection) rely on the engines' ``--write-timeout``
(``stall_timeout``).
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
    transfer_address,
    version_of,
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
from ._state import State, fetch_state, publish_state


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
    "publish_state",
    "fetch_state",
    "State",
    "register_transport",
    "ObjectLost",
    "transfer_address",
    "version_of",
]
