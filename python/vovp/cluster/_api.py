"""The calls of ``vovp.cluster`` (re-exported by its ``__init__``) and the per-process
handles they share: the directory, the agents, this process's client of its node's store
(``directory_actor``, ``agent_actor``, ``call``: the package's, and the tests' and benches').
``_dist`` builds on them; nothing here knows DistTensor.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..client import Client, version_of
from ..errors import InvalidArgument, ObjectExists, ObjectLost, ObjectNotFound, VovpError
from ._agent import Agent, agent_name, alive_nodes
from ._directory import DIRECTORY_NAME, NAMESPACE, Directory

# Engines that agents start: the store of a node of a local cluster is one of several on
# this machine, so the default socket carries the node.
DEFAULT_SOCKET = os.path.join(tempfile.gettempdir(), "vovp-{node}.sock")

_state_lock = threading.Lock()
_state: dict[str, Any] = {"pid": None, "directory": None, "client": None, "agents": {}}


def init(address: str | None = None, *, socket: str | None = None, memory: str | int = "1G",
         engine: str | None = None, start: bool = True, transport: str = "stream",
         stall_timeout: float = 30.0, engine_args: tuple[str, ...] | list[str] = (),
         spill_dir: str | None = None, spill_max: str | int | None = None,
         metrics_interval: float = 10.0, timeout: float = 60.0,
         **ray_init_args: Any) -> None:
    """Join the Ray cluster at ``address`` (as ``ray.init``; starts a local one when there is
    none) unless this process is connected already, and give every node a store and an agent.

    ``socket``: the store's socket path on each node; ``{node}`` in it is replaced by the
    node's id (its first 12 hex digits), needed when several nodes share one machine. When
    nothing answers there the agent starts ``vovp-engine -m memory -s socket`` (``engine``:
    the binary; default $VOVP_ENGINE_BIN, then PATH) and stops it with itself; ``start=False``
    makes a missing daemon an error. ``transport``: "stream" (one TCP stream from the holder's
    store into the receiver's, one copy) or "ray" (through Ray's object store, for
    comparison). ``stall_timeout``: seconds without progress after which a transfer fails.
    ``spill_dir`` / ``spill_max``: every node's store spills to that directory instead of
    evicting (``{node}`` in it is replaced as in ``socket``: each store needs a directory of
    its own), at most ``spill_max`` bytes (``vovp-engine --spill-dir/--spill-max``).
    ``metrics_interval``: seconds between each agent's reports to Ray's metrics
    (``ray.util.metrics``: the node's store STATS and transfer counters; see ``stats``).

    The first ``init`` of a cluster fixes these settings (kept by the directory); later calls,
    from any process, use them. Nodes that join later get their agent when first used.
    """
    if transport not in ("stream", "ray"):
        raise InvalidArgument(f"transport must be 'stream' or 'ray', got {transport!r}")
    if not ray.is_initialized():
        ray.init(address=address, **ray_init_args)
    engine = engine or os.environ.get("VOVP_ENGINE_BIN")
    if spill_max is not None and spill_dir is None:
        raise InvalidArgument("spill_max needs spill_dir")
    spill = ([] if spill_dir is None else ["--spill-dir", str(spill_dir)]) + (
        [] if spill_max is None else ["--spill-max", str(spill_max)])
    proposed = {"socket": socket or DEFAULT_SOCKET, "memory": str(memory), "engine": engine,
                "start": bool(start), "transport": transport,
                "stall_timeout": float(stall_timeout),
                "engine_args": list(engine_args) + spill,
                "metrics_interval": float(metrics_interval)}
    directory = directory_actor()
    ray.get(directory.config.remote(proposed), timeout=timeout)
    agents = [agent_actor(n) for n in sorted(alive_nodes())]
    call([a.info.remote() for a in agents], timeout)


def shutdown() -> None:
    """Stop every agent (and the stores they started) and the directory; Ray keeps running.
    Every name is gone afterwards."""
    try:
        directory = ray.get_actor(DIRECTORY_NAME, namespace=NAMESPACE)
    except ValueError:
        directory = None
    for node in alive_nodes():
        try:
            agent = ray.get_actor(agent_name(node), namespace=NAMESPACE)
        except ValueError:
            continue
        try:
            ray.get(agent.stop.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - a dead agent has nothing left to stop
            pass
        ray.kill(agent)
    if directory is not None:
        ray.kill(directory)
    with _state_lock:
        if _state["client"] is not None:
            _state["client"].close()
        _state.update(pid=None, directory=None, client=None, agents={})


def node_id() -> str:
    """This process's Ray node id (hex)."""
    return ray.get_runtime_context().get_node_id()


def nodes() -> list[str]:
    """The ids of the nodes Ray reports alive, sorted."""
    return sorted(alive_nodes())


def client() -> Client:
    """This process's client of its node's store (one per process, made on first use)."""
    state = _local()
    if state["client"] is None or state["client"].closed:
        info = call(agent_actor(node_id()).info.remote(), 60.0)
        state["client"] = Client(info["socket"])
    return state["client"]


def publish(name: str, tensor: Any = None) -> Any:
    """Put ``tensor`` (numpy or torch, as ``put_tensor``) into this node's store under
    ``name`` and record it cluster-wide; returns the store's copy. With no tensor, publish
    the object already stored here under ``name``. Raises ObjectExists when ``name`` is
    published anywhere already."""
    c = client()
    result = None if tensor is None else c.put_tensor(name, tensor)
    if result is not None:
        # A put_tensor may return before the store answered: its refusal (a name taken by a
        # racing put here, a full store) is raised here, before another object of the name
        # could be published in its place. (A failed result is let go first: while it
        # lives, its part of this client's lend is kept for it.)
        try:
            version_of(result)
        except VovpError:
            del result
            raise
    try:
        view, metadata = c.get_buffer(name, with_metadata=True)
    except ObjectNotFound:
        raise ObjectNotFound(f"nothing named {name!r} in this node's store to publish", 1) \
            from None
    size = view.nbytes
    c.release(view)
    entry = call(directory_actor().publish.remote(name, node_id(), size, metadata), 60.0)
    if entry is None:
        if tensor is not None:
            c.delete(name)
        raise ObjectExists(f"{name!r} is already published in the vovp cluster", 2)
    return result


def fetch(name: str, timeout: float | None = None, framework: str | None = None,
          writable: bool = False) -> Any:
    """The tensor published as ``name``, from this node's store, zero-copy.

    When this node has no copy, its agent copies it once from a node that has one; every
    process on this node then gets it by name (``fetch`` or plain ``get_tensor``).
    Concurrent fetches of one name on one node cause one transfer. ``timeout``: None = the
    name must be published already (ObjectNotFound otherwise); seconds = wait up to that
    long for it to be published and to arrive (TimeoutError). Raises ObjectLost when every
    node holding it died. ``framework``/``writable`` as in ``get_tensor``.
    """
    c = client()
    deadline = None if timeout is None else time.monotonic() + timeout
    for _ in range(3):  # a fetched copy can be evicted before we get it: pull again
        try:
            return c.get_tensor(name, framework=framework, writable=writable)
        except ObjectNotFound:
            pass
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        call(agent_actor(node_id()).ensure.remote(name, left), left)
    return c.get_tensor(name, framework=framework, writable=writable)


def broadcast(name: str, nodes: list[str] | None = None, timeout: float | None = None,
              fanout: int = 4) -> list[str]:
    """Copy ``name`` into the store of every node (or of ``nodes``) that lacks it, so that
    the next get there is local. Returns the nodes that received a copy.

    A tree: in each round every node that has the object sends it to up to ``fanout`` nodes
    that do not, so the owner is one sender among many and n nodes take about
    log_(fanout+1)(n) rounds. ``fanout=1`` is a binomial tree; a fanout of at least the
    number of nodes is a star (everyone pulls from the owner at once), which is fastest
    while the owner's bandwidth is not the limit: on one machine with 3 nodes, a star
    delivered 3.4-3.5x a binomial tree (BENCHMARKS.md, "Across machines").
    """
    if int(fanout) < 1:
        raise InvalidArgument(f"fanout must be at least 1, got {fanout!r}")
    deadline = None if timeout is None else time.monotonic() + timeout
    entry = call(directory_actor().lookup.remote(name, timeout), timeout)
    if entry is None:
        if timeout is not None:
            raise TimeoutError(f"{name!r} was not published within {timeout} s")
        raise ObjectNotFound(f"{name!r} is not published in the vovp cluster", 1)
    alive = alive_nodes()
    targets = sorted(alive if nodes is None else set(nodes))
    unknown = [n for n in targets if n not in alive]
    if unknown:
        raise InvalidArgument(f"not alive nodes of this Ray cluster: {', '.join(unknown)}")
    have = [h for h in entry.holders if h in alive]
    if not have:
        raise ObjectLost(f"{name!r} is lost: every node that held it died "
                         f"({', '.join(entry.holders)})", 0)
    todo = [n for n in targets if n not in have]
    done = []
    while todo:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        pairs = list(zip([src for src in have for _ in range(int(fanout))], todo))
        refs = [agent_actor(dst).ensure.remote(name, left, src) for src, dst in pairs]
        call(refs, left)
        sent = [dst for _, dst in pairs]
        have = sent + have  # the new copies send first: the owner is not everyone's source
        done += sent
        todo = todo[len(pairs):]
    return done


def unpublish(name: str) -> bool:
    """Remove ``name`` cluster-wide: from the directory and from every store holding a copy
    (memory is freed when the last local holder releases it). False when not published."""
    entry = call(directory_actor().unpublish.remote(name), 60.0)
    if entry is None:
        return False
    alive = alive_nodes()
    refs = [agent_actor(n).drop.remote(name) for n in entry.holders if n in alive]
    call(refs, 60.0)
    return True


delete = unpublish


def names() -> list[str]:
    """Every published name."""
    return call(directory_actor().names.remote(), 60.0)


def agent_stats(node: str | None = None) -> dict[str, int]:
    """Counters of a node's agent (default: this node's): transfers, bytes_received,
    offers, bytes_sent."""
    return call(agent_actor(node or node_id()).stats.remote(), 60.0)


def stats(per_node: bool = False) -> dict[str, Any]:
    """The cluster's stores and transfers: every node's store STATS (PROTOCOL.md's fields:
    ``capacity``, ``used_bytes``, ``objects``...) and agent counters (``transfers``,
    ``bytes_received``, ``offers``, ``bytes_sent``), summed over the nodes alive, with
    ``nodes`` (how many). ``per_node=True``: {node id: its own dict} instead. The same numbers
    go to Ray's metrics as ``vovp_node_<field>{node}`` (every agent reports them on a timer)."""
    alive = sorted(alive_nodes())
    per = dict(zip(alive, call([agent_actor(n).node_stats.remote() for n in alive], 60.0)))
    if per_node:
        return per
    total: dict[str, Any] = {"nodes": len(per)}
    for values in per.values():
        for field, value in values.items():
            total[field] = total.get(field, 0) + value
    return total


# -- plumbing ----------------------------------------------------------------------------------


def _local():
    """This process's cached handles (reset in a forked or new process)."""
    with _state_lock:
        if _state["pid"] != os.getpid():
            _state.update(pid=os.getpid(), directory=None, client=None, agents={})
        return _state


def directory_actor():
    state = _local()
    if state["directory"] is None:
        if not ray.is_initialized():
            raise VovpError("vovp.cluster is not initialized: call vovp.cluster.init() first")
        # Pinned to the head node: the directory lives as long as the cluster does.
        state["directory"] = ray.remote(Directory).options(
            name=DIRECTORY_NAME, namespace=NAMESPACE, lifetime="detached",
            get_if_exists=True, num_cpus=0, max_concurrency=64, max_restarts=0,
            resources={"node:__internal_head__": 0.001}).remote()
    return state["directory"]


def agent_actor(node: str):
    """The agent of ``node``, created on first use (a node that joined after ``init``)."""
    state = _local()
    handle = state["agents"].get(node)
    if handle is None:
        config = call(directory_actor().config.remote(), 60.0)
        if config is None:
            raise VovpError("vovp.cluster is not initialized: call vovp.cluster.init() first")
        handle = ray.remote(Agent).options(
            name=agent_name(node), namespace=NAMESPACE, lifetime="detached",
            get_if_exists=True, num_cpus=0, max_concurrency=64, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote(node, config)
        state["agents"][node] = handle
    return handle


def call(refs, timeout):
    """ray.get with vovp's errors: the exception raised in an actor comes out as itself (not
    wrapped in RayTaskError), a timeout as TimeoutError, a dead agent as VovpError."""
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"vovp.cluster: no answer within {timeout} s") from None
    except ray.exceptions.RayTaskError as e:
        cause = e.cause
        if isinstance(cause, BaseException):
            raise cause from None
        raise
    except ray.exceptions.RayActorError as e:
        # Not ObjectLost by itself: the agent may have failed to start (a bad engine=, a
        # daemon that would not come up), and its node be alive. Callers that know which
        # node they asked turn it into ObjectLost when Ray reports that node dead.
        raise VovpError(f"a vovp agent is gone (it died, or failed to start): {e}") from None

