"""The calls of ``vovp.cluster`` (re-exported by its ``__init__``) and the per-process
handles they share: the directory, the agents, this process's client of its node's store
(``directory_actor``, ``agent_actor``, ``call``: the package's, and the tests' and benches'),
and the nodes' transfer addresses (``transfer_address``). ``_dist`` and ``_state`` build on
them; nothing here knows DistTensor.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import threading
import time
from typing import Any, Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .. import tensor as T
from .._puts import put_host
from .._args import object_name
from ..client import Client, version_of
from ..daemon import key_hex
from ..errors import InvalidArgument, ObjectExists, ObjectLost, ObjectNotFound, VovpError
from . import _fetch
from ._agent import Agent, agent_name, alive_nodes
from ._directory import DIRECTORY_NAME, NAMESPACE, Directory
from ._fetch import CONTROL_TIMEOUT, call, directory_call

__all__ = ["DEFAULT_SOCKET", "call", "directory_call", "version_of"]

# Engines that agents start: the store of a node of a local cluster is one of several on
# this machine, so the default socket carries the node.
DEFAULT_SOCKET = os.path.join(tempfile.gettempdir(), "vovp-{node}.sock")

# Calls in the directory at once (asyncio: a waiting call is a suspended coroutine, no
# thread): every process's newer_than waits, with room for the calls that do not wait.
MAX_WAITS = 100_000

_state_lock = threading.Lock()
_state: dict[str, Any] = {"pid": None, "directory": None, "client": None, "agents": {}}


def init(address: str | None = None, *, socket: str | None = None, memory: str | int = "1G",
         engine: str | None = None, start: bool = True, stall_timeout: float = 30.0,
         engine_args: tuple[str, ...] | list[str] = (), spill_dir: str | None = None,
         spill_max: str | int | None = None, metrics_interval: float = 10.0,
         transfer_key: bytes | str | None = None, timeout: float = 60.0,
         **ray_init_args: Any) -> None:
    """Join the Ray cluster at ``address`` (as ``ray.init``; starts a local one when there is
    none) unless this process is connected already, and give every node a store and an agent.

    ``socket``: the store's socket path on each node; ``{node}`` in it is replaced by the
    node's id (its first 12 hex digits), needed when several nodes share one machine. When
    nothing answers there the agent starts ``vovp-engine -m memory -s socket --transfer
    <node ip>:0`` with the cluster's transfer key in its environment (``engine``: the binary;
    default $VOVP_ENGINE_BIN, then PATH) and stops it with itself. ``start=False`` makes a
    missing daemon an error: run each node's daemon yourself with ``--transfer <node ip>:0``
    and the cluster's key (``VOVP_TRANSFER_KEY`` or ``--transfer-key-file``), and pass that
    key here (``transfer_key``: 32 bytes or 64 hex digits; a daemon without ``--transfer`` is
    an error naming the flag). ``transfer_key`` default: 32 random bytes, made by the first
    ``init``. ``stall_timeout``: seconds a transfer stream may make no progress before it
    fails (the engines' ``--write-timeout``).
    ``spill_dir`` / ``spill_max``: every node's store spills to that directory instead of
    evicting (``{node}`` in it is replaced as in ``socket``: each store needs a directory of
    its own), at most ``spill_max`` bytes (``vovp-engine --spill-dir/--spill-max``).
    ``metrics_interval``: seconds between each agent's reports to Ray's metrics
    (``ray.util.metrics``: the node's store STATS and transfer counters; see ``stats``).

    The first ``init`` of a cluster fixes these settings (kept by the directory); later calls,
    from any process, use them. Nodes that join later get their agent when first used.
    """
    if not ray.is_initialized():
        ray.init(address=address, **ray_init_args)
    engine = engine or os.environ.get("VOVP_ENGINE_BIN")
    if spill_max is not None and spill_dir is None:
        raise InvalidArgument("spill_max needs spill_dir")
    try:
        key = secrets.token_hex(32) if transfer_key is None else key_hex(transfer_key)
    except ValueError as e:
        raise InvalidArgument(f"transfer_key: {e}") from None
    spill = ([] if spill_dir is None else ["--spill-dir", str(spill_dir)]) + (
        [] if spill_max is None else ["--spill-max", str(spill_max)])
    stall = ["--write-timeout", str(max(1, int(round(float(stall_timeout)))))]
    proposed = {"socket": socket or DEFAULT_SOCKET, "memory": str(memory), "engine": engine,
                "start": bool(start), "stall_timeout": float(stall_timeout),
                "engine_args": list(engine_args) + spill + stall,
                "metrics_interval": float(metrics_interval), "transfer_key": key}
    directory = directory_actor()
    directory_call(directory.config.remote(proposed), timeout)
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
        _state.update(pid=None, directory=None, client=None, agents={}, node=None)
    _fetch.reset()


def node_id() -> str:
    """This process's Ray node id (hex; cached: a process does not change nodes)."""
    state = _local()
    node = state.get("node")
    if node is None:
        node = state["node"] = ray.get_runtime_context().get_node_id()
    return str(node)


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


def transfer_address(node: str) -> str:
    """The ``"ip:port"`` where ``node``'s engine serves transfers (cached per process: one
    call the first time). ObjectLost when the node has no agent (it died)."""
    address = _fetch.transfer_address(directory_actor(), node)
    if address is None:
        info = call(agent_actor(node).info.remote(), CONTROL_TIMEOUT)
        address = info["transfer"]
        _fetch.remember_address(node, address)
    return str(address)


def publish(name: str, tensor: Any = None, replace: bool = False) -> Any:
    """Put ``tensor`` (numpy or torch, as ``put_tensor``) into this node's store under
    ``name`` as the name's next cluster-wide version, and make that version current
    everywhere; returns the store's copy (``version_of`` of it: the version).

    The directory numbers the version first (two racing publishes get two versions), this
    process puts it into its node's store sealed as exactly that version, then the directory
    makes it current (the newer of two racing ones stays current). Until then every node keeps
    serving the previous version; a writer that dies in between leaves only a gap in the
    numbers. ``replace=False``: ObjectExists when ``name`` is published already. With no
    tensor, publish the object already stored here under ``name`` (its version must be above
    every version the cluster gave the name). Readers keep the versions they hold; a node's
    old version goes with its last holder there.
    """
    c = client()
    me = node_id()
    if tensor is None:
        try:
            view, metadata = c.get_buffer(name, with_metadata=True)
        except ObjectNotFound:
            raise ObjectNotFound(f"nothing named {name!r} in this node's store to publish",
                                 1) from None
        version, size = version_of(view), view.nbytes
        c.release(view)
        status, last = directory_call(directory_actor().claim.remote(name, version, replace))
        if status == "exists":
            raise ObjectExists(f"{name!r} is already published in the vovp cluster", 2)
        if status != "ok":
            raise ObjectExists(f"{name!r}: the object stored here is version {version}, and "
                               f"the cluster has given the name version {last} already: "
                               "publish it as a tensor (vc.publish(name, t, replace=True))", 2)
        commit(name, version, size, metadata, replace, None)
        return None
    version = reserve(name, replace)
    result, size, metadata = put_version(c, name, tensor, version, replace)
    commit(name, version, size, metadata, replace, me)
    return result


def reserve(name: str, replace: bool) -> int:
    """The directory's next version of ``name`` for this writer (``publish``'s first step);
    ObjectExists when ``name`` is published and not ``replace``, or is a DistTensor."""
    version = directory_call(directory_actor().reserve.remote(name, bool(replace)))
    if version is None:
        raise ObjectExists(f"{name!r} is already published in the vovp cluster", 2)
    return int(version)


def put_version(c: Client, name: str, tensor: Any, version: int, replace: bool) \
        -> tuple[Any, int, bytes]:
    """``put_tensor(name, tensor, replace=replace)`` sealed as exactly ``version`` in this
    node's store (``PutOptions.version``; StaleVersion when this store has that version or a
    newer one already); (the store's copy, its size, its metadata)."""
    plan = T.plan_host_put(tensor)
    if plan is None:
        raise InvalidArgument("vovp.cluster publishes host tensors (numpy, CPU torch); move a "
                              "CUDA tensor to the host first")
    result = put_host(c.core, object_name(name), plan, False, False, replace, version=version)
    src, _, store_dt, _, meta, _ = plan
    return result, int(src.size) * store_dt.itemsize, bytes(meta)


def commit(name: str, version: int, size: int, metadata: bytes, replace: bool,
           put_here: Optional[str]) -> None:
    """``publish``'s last step: ``version`` of ``name``, sealed in this node's store, becomes
    current cluster-wide. ObjectExists (and the copy ``put_here`` deleted) when another
    publish without ``replace`` won the name."""
    status, _ = directory_call(directory_actor().commit.remote(
        name, int(version), node_id(), int(size), bytes(metadata), bool(replace)))
    if status in ("exists", "dist"):
        if put_here is not None:
            _delete_version(client(), name, version)
        raise ObjectExists(f"{name!r} is already published in the vovp cluster"
                           + (" (as a DistTensor)" if status == "dist" else ""), 2)
    # "stale": a racing publish committed a newer version first; it stays current, and this
    # one was current for no one (the numbers still say which came first).


def _delete_version(c: Client, name: str, version: int) -> None:
    try:
        view = c.get_buffer(name)
        here = version_of(view)
        c.release(view)
        if here == version:
            c.delete(name)
    except ObjectNotFound:
        pass


def fetch(name: str, timeout: float | None = None, framework: str | None = None,
          writable: bool = False, newer_than: int | None = None) -> Any:
    """The tensor published as ``name``, from this node's store, zero-copy.

    ``newer_than=v``: a version above ``v`` (``vc.version_of`` of the one you hold),
    waiting up to ``timeout`` for one to be published anywhere (no polling: the directory
    answers when it is). Without it: the version this node has, else the current one.
    When this node has no such version, this process asks its node's engine to copy it from
    a node that has it (one control message to the directory, none when this process knows
    a holder already); every process on this node then gets it by name (``fetch`` or plain
    ``get_tensor``), and concurrent fetches of one version on one node cause one transfer.
    ``timeout``: None = a version must be published already (ObjectNotFound otherwise);
    seconds = wait up to that long (TimeoutError). Raises ObjectLost when every node holding
    it died; VovpError naming the directory when the head node is gone.
    ``framework``/``writable`` as in ``get_tensor``.
    """
    got, _ = _fetch.fetch_object(client(), directory_actor(), node_id(), name,
                                 newer_than=newer_than, timeout=timeout, framework=framework,
                                 writable=writable)
    return got


def broadcast(name: str, nodes: list[str] | None = None, timeout: float | None = None,
              fanout: int = 4) -> list[str]:
    """Copy the newest version of ``name`` into the store of every node (or of ``nodes``)
    that lacks it, so that the next get there is local. Returns the nodes that received a
    copy.

    A tree: in each round every node that has the version has up to ``fanout`` nodes that
    do not fetch it from itself (their agents send FETCH to their engines), so the writer is
    one sender among many and n nodes take about log_(fanout+1)(n) rounds. ``fanout=1`` is a
    binomial tree; a fanout of at least the number of nodes is a star (everyone pulls from
    the writer at once), which is fastest while the writer's bandwidth is not the limit.
    """
    if int(fanout) < 1:
        raise InvalidArgument(f"fanout must be at least 1, got {fanout!r}")
    deadline = None if timeout is None else time.monotonic() + timeout
    entry = directory_call(directory_actor().lookup.remote(name, timeout), wait=timeout)
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
        refs = [agent_actor(dst).ensure.remote(name, left, src, entry.version - 1)
                for src, dst in pairs]
        call(refs, left)
        sent = [dst for _, dst in pairs]
        have = sent + have  # the new copies send first: the writer is not everyone's source
        done += sent
        todo = todo[len(pairs):]
    return done


def unpublish(name: str) -> bool:
    """Remove ``name`` cluster-wide: from the directory and from every store holding a copy
    (memory is freed when the last local holder releases it). False when not published."""
    entry = directory_call(directory_actor().unpublish.remote(name))
    _fetch.forget(name)
    if entry is None:
        return False
    alive = alive_nodes()
    refs = [agent_actor(n).drop.remote(name, entry.version) for n in entry.holders
            if n in alive]
    call(refs, 60.0)
    return True


delete = unpublish


def names() -> list[str]:
    """Every published name."""
    return directory_call(directory_actor().names.remote())


def agent_stats(node: str | None = None) -> dict[str, int]:
    """Transfer counters of a node's engine (default: this node's), as its agent names them:
    ``transfers`` (one per transfer into this store), ``transfers_shared`` (FETCHes that
    joined one), ``transfers_failed``, ``bytes_received``, ``bytes_sent``,
    ``streams_served``, ``refused``."""
    return call(agent_actor(node or node_id()).stats.remote(), 60.0)


def stats(per_node: bool = False) -> dict[str, Any]:
    """The cluster's stores and transfers: every node's store STATS (PROTOCOL.md's fields:
    ``capacity``, ``used_bytes``, ``objects``...) and transfer counters (``agent_stats``),
    summed over the nodes alive, with
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
            _state.update(pid=os.getpid(), directory=None, client=None, agents={}, node=None)
        return _state


def directory_actor():
    state = _local()
    if state["directory"] is None:
        if not ray.is_initialized():
            raise VovpError("vovp.cluster is not initialized: call vovp.cluster.init() first")
        # Pinned to the head node: the directory lives as long as the cluster does.
        state["directory"] = ray.remote(Directory).options(
            name=DIRECTORY_NAME, namespace=NAMESPACE, lifetime="detached",
            get_if_exists=True, num_cpus=0, max_concurrency=MAX_WAITS, max_restarts=0,
            resources={"node:__internal_head__": 0.001}).remote()
    return state["directory"]


def agent_actor(node: str):
    """The agent of ``node``, created on first use (a node that joined after ``init``)."""
    state = _local()
    handle = state["agents"].get(node)
    if handle is None:
        config = directory_call(directory_actor().config.remote())
        if config is None:
            raise VovpError("vovp.cluster is not initialized: call vovp.cluster.init() first")
        handle = ray.remote(Agent).options(
            name=agent_name(node), namespace=NAMESPACE, lifetime="detached",
            get_if_exists=True, num_cpus=0, max_concurrency=64, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote(node, config)
        state["agents"][node] = handle
    return handle
