"""A node's agent: the one Ray actor per node (``vovp-agent-<node id>``, pinned to that node)
that owns the node's side of the cluster.

It connects to the node's ``vovp-engine`` (or starts one, which dies with it), pulls objects
other nodes hold into the local store (one transfer per name, however many local processes ask
at once), offers local objects to other nodes' agents (``_stream``), keeps the node's
DistTensor partitions (the creator's writable view, so pushes apply in place), and reports the
node's store and transfer numbers to Ray's metrics (``_metrics``).
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import Future
from typing import Any
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np
import ray

from .. import daemon
from .._copy import copy_into
from ..client import Client
from ..errors import (
    ConnectionError as VovpConnectionError,
    InvalidArgument,
    ObjectExists,
    ObjectLost,
    ObjectNotFound,
    VovpError,
)
from . import _stream
from ._directory import DIRECTORY_NAME, NAMESPACE
from ._metrics import NodeReporter

AGENT_PREFIX = "vovp-agent-"


def agent_name(node_id: str) -> str:
    return AGENT_PREFIX + node_id


def socket_for(template: str, node_id: str) -> str:
    """The store's socket on ``node_id``: ``{node}`` in the template becomes the node id's
    first 12 hex digits (nodes of one machine share /tmp; a socket path is at most 107 bytes)."""
    return template.replace("{node}", node_id[:12])


def alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


class HolderGone(Exception):
    """A holder's agent cannot be found: its node (and store) are gone."""


class Agent:
    def __init__(self, node_id: str, config: dict[str, Any]):
        self.node_id = node_id
        self._config = config
        self._transport = config.get("transport", "stream")
        self._stall = float(config.get("stall_timeout", 30.0))
        self.socket = socket_for(config["socket"], node_id)
        self._engine: daemon.StoreProcess | None = None
        self._client = self._connect_or_start()
        self._server = _stream.StreamServer(ray.util.get_node_ip_address(), self._stall)
        self._directory = ray.get_actor(DIRECTORY_NAME, namespace=NAMESPACE)
        self._lock = threading.Lock()
        self._inflight: dict[str, Future[dict[str, Any]]] = {}
        self._agents: dict[str, Any] = {}  # node id -> actor handle
        self._parts: dict[str, tuple[Any, Any]] = {}  # DistTensor name -> (writable view, lock)
        self._counters = {"transfers": 0, "bytes_received": 0, "offers": 0}
        self._reporter = NodeReporter(node_id, self.node_stats,
                                      float(config.get("metrics_interval", 10.0)))

    # -- the node's store ----------------------------------------------------------------------

    def _connect_or_start(self) -> Client:
        try:
            return Client(self.socket)
        except VovpConnectionError:
            pass
        if not self._config.get("start", True):
            raise VovpConnectionError(f"no vovp-engine answers at {self.socket} on node "
                                      f"{self.node_id} (vovp.cluster.init(start=False))")
        binary = self._config.get("engine")
        if not binary or not os.access(binary, os.X_OK):
            binary = None
        try:
            # Started as vovp.start_store starts one: it dies with this agent, even when Ray
            # kills the agent with SIGKILL.
            self._engine = daemon.spawn(
                (), self._config.get("memory", "1G"), self.socket, False, 30, {},
                extra=tuple(socket_for(a, self.node_id)
                            for a in self._config.get("engine_args", ())), binary=binary)
        except FileNotFoundError as e:
            raise VovpError(f"node {self.node_id}: no vovp-engine to start ({e}); pass "
                            "engine= to vovp.cluster.init or run a daemon and pass socket=") from None
        except VovpConnectionError as e:
            raise VovpError(f"node {self.node_id}: {e}") from None
        return Client(self.socket)

    def info(self) -> dict[str, Any]:
        return {"node": self.node_id, "socket": self.socket, "pid": os.getpid(),
                "engine_pid": None if self._engine is None else self._engine.pid,
                "address": self._server.address}

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._counters)
        out["bytes_sent"] = self._server.bytes_sent
        return out

    def node_stats(self) -> dict[str, int]:
        """The node's store's STATS and this agent's counters, in one dict (what
        ``vc.stats()`` adds up and the agent reports to Ray's metrics)."""
        return {**self._client.stats(), **self.stats()}

    def reported(self) -> dict[str, int]:
        """What the agent last reported through ``ray.util.metrics``."""
        return self._reporter.reported()

    def stop(self) -> None:
        """Stop serving; stop the engine this agent started (before Ray kills the agent)."""
        self._reporter.stop()
        self._server.close()
        self._client.close()
        if self._engine is not None:
            self._engine.stop()

    # -- fetch: bring a name into this node's store --------------------------------------------

    def ensure(self, name: str, timeout: float | None = None, source: str | None = None,
               transport: str | None = None) -> dict[str, Any]:
        """Make ``name`` present in this node's store, pulling it from a holder (``source``
        first when given) unless it is here already. Concurrent calls for one name share one
        transfer. ``transport`` overrides the cluster's ("stream" or "ray"; the benchmark
        compares them). Returns {"transferred": bool, "version": int | None}."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._client.contains(name):
                return {"transferred": False, "version": None}
            with self._lock:
                existing = self._inflight.get(name)
                if existing is None:
                    pending: Future[dict[str, Any]] = Future()
                    self._inflight[name] = pending
            if existing is None:
                break
            pending = existing
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                return pending.result(left)  # a follower keeps to its own timeout
            except (TimeoutError, FutureTimeout):
                if not pending.done():
                    raise TimeoutError(f"{name!r} did not arrive within {timeout} s") \
                        from None
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                continue  # the leader's own wait ran out, ours has not: try again
            except ObjectNotFound:
                if deadline is None:
                    raise
                continue  # the leader did not wait for a publish; this caller may
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            result = self._pull(name, timeout, source, transport or self._transport)
            pending.set_result(result)
            return result
        except BaseException as e:
            pending.set_exception(e)
            raise
        finally:
            with self._lock:
                del self._inflight[name]

    def _pull(self, name, timeout, source, transport):
        deadline = None if timeout is None else time.monotonic() + timeout
        entry = ray.get(self._directory.lookup.remote(name, timeout))
        if entry is None:
            if self._client.contains(name):  # published and put here meanwhile
                return {"transferred": False, "version": None}
            if timeout is None:
                raise ObjectNotFound(f"{name!r} is not published in the vovp cluster", 1)
            raise TimeoutError(f"{name!r} was not published within {timeout} s")
        lost = []
        holders = [h for h in entry.holders if h != self.node_id]
        random.shuffle(holders)  # spread readers over every copy, not just the owner's
        if source is not None and source != self.node_id:
            # broadcast's relay: the source may have its copy before the directory has
            # recorded it (add_holder is not awaited); a source without one answers None.
            if source in holders:
                holders.remove(source)
            holders.insert(0, source)
        # No look at Ray's node table on the way: a call to a dead node's agent fails at once
        # (RayActorError), and only then is the holder's state checked.
        for holder in holders:
            try:
                moved = self._pull_from(holder, entry, deadline, transport)
            except (_stream.TransferBroken, ray.exceptions.RayActorError, HolderGone) as e:
                # Broken mid-way: the holder's agent (and with it, its store) or its node died,
                # or the holder stalled. Only a dead holder is a lost copy; else say why.
                if self._holder_alive(holder):
                    raise VovpError(f"transfer of {name!r} from node {holder} failed: {e}") \
                        from None
                lost.append(holder)
                self._directory.drop_holder.remote(name, holder, entry.version)
                continue
            if moved is None:  # evicted (or deleted) there
                self._directory.drop_holder.remote(name, holder, entry.version)
                continue
            # Awaited: an unpublish (or a new version) may have come while the bytes moved,
            # and then this copy is stale and must go, or it would be served as current.
            if moved and not ray.get(self._directory.add_holder.remote(
                    name, self.node_id, entry.version)):
                self.drop(name)
                raise ObjectNotFound(f"{name!r} was unpublished while it was being fetched", 1)
            with self._lock:
                self._counters["transfers"] += moved
                self._counters["bytes_received"] += entry.size * moved
            return {"transferred": bool(moved), "version": entry.version}
        if lost:
            raise ObjectLost(f"{name!r} is lost: it was held only by node(s) "
                             f"{', '.join(lost)}, which died (Ray reports them dead or their "
                             "vovp agent is gone)")
        raise ObjectLost(f"{name!r} is lost: no node holds a copy any more (evicted from every "
                         "store that had it)")

    def _holder_alive(self, holder) -> bool:
        """Whether ``holder``'s agent still answers (a dead node's agent does not)."""
        if holder not in alive_nodes():
            return False
        try:
            ray.get(self._agent_of(holder).info.remote(), timeout=self._stall)
            return True
        except (HolderGone, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def _agent_of(self, node):
        """The agent of ``node`` (cached: ``ray.get_actor`` asks Ray's GCS every time)."""
        handle = self._agents.get(node)
        if handle is None:
            try:
                handle = ray.get_actor(agent_name(node), namespace=NAMESPACE)
            except ValueError:  # Ray knows no such actor: it died with its node
                raise HolderGone(f"node {node} has no vovp agent") from None
            self._agents[node] = handle
        return handle

    def _pull_from(self, holder, entry, deadline, transport):
        """Copy ``entry`` from ``holder`` into this store: 1 when it moved, 0 when it was
        here already, None when ``holder`` does not have it."""
        agent = self._agent_of(holder)
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            if transport == "ray":
                offer = ray.get(agent.read.remote(entry.name), timeout=left)
            else:
                offer = ray.get(agent.offer.remote(entry.name), timeout=left)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"{entry.name!r}: node {holder} did not answer in time") \
                from None
        if offer is None:
            return None
        size, metadata = offer[0], offer[1]
        try:
            dst = self._client.create(entry.name, size, metadata)
        except BaseException as e:
            if transport != "ray":
                agent.withdraw.remote(offer[3])  # the ticket will not be claimed
            if isinstance(e, ObjectExists):
                return 0
            raise
        try:
            if transport == "ray":
                copy_into(dst, offer[2])
            else:
                _stream.receive(offer[2], offer[3], memoryview(dst.data), self._stall)
            self._client.seal(entry.name)
        except BaseException:
            # Nothing half-made stays visible: an unsealed object is invisible to GET, and the
            # abort frees it.
            self._client.abort(entry.name)
            raise
        self._client.release(dst)
        return 1

    def offer(self, name: str):
        """Offer the local copy of ``name`` to one stream transfer: (size, metadata, address,
        ticket), or None when this store does not have it."""
        got = self._give(name)
        if got is None:
            return None
        view, metadata = got
        ticket = self._server.offer(view, lambda: self._client.release(view))
        return (view.nbytes, metadata, self._server.address, ticket)

    def withdraw(self, ticket: bytes) -> None:
        """The receiver of ``ticket``'s offer gave up before connecting: release it now."""
        self._server.withdraw(ticket)

    def read(self, name: str):
        """transport="ray": the object's bytes through Ray's object store (for comparison)."""
        got = self._give(name)
        if got is None:
            return None
        view, metadata = got
        return (view.nbytes, metadata, np.frombuffer(view, dtype=np.uint8))

    def _give(self, name):
        """(view holding a reference, metadata) of the local copy for another node, counted
        as an offer; None when this store does not have it."""
        try:
            got = self._client.get_buffer(name, with_metadata=True)
        except ObjectNotFound:
            return None
        with self._lock:
            self._counters["offers"] += 1
        return got

    def drop(self, name: str) -> bool:
        """Delete the local copy of ``name`` (unpublish)."""
        try:
            self._client.delete(name)
            return True
        except ObjectNotFound:
            return False

    # -- DistTensor partitions -----------------------------------------------------------------

    def dist_create(self, name: str, part: str, rows: int, row_shape, dtype: str) -> None:
        """Create this node's partition (zeros) as the store object ``part``; the agent keeps
        the creator's writable view for pushes, and with it a reference: never evicted."""
        with self._lock:  # held throughout: two processes attaching at once create it once
            if name in self._parts:
                return
            view = self._client.create_tensor(part, (int(rows), *row_shape), np.dtype(dtype))
            try:
                view[...] = 0
                self._client.seal(part)
            except BaseException:
                self._client.abort(part)
                raise
            self._parts[name] = (view, threading.Lock())

    def dist_pull(self, name: str, local_ids):
        view, _ = self._part(name)
        return view[local_ids]

    def dist_push(self, name: str, local_ids, rows, op) -> None:
        """A callable ``op`` is the caller's code run here, under the partition's lock: like
        everything sent to a Ray actor it is trusted (vovp.cluster's module doc, "Trust model"),
        and a handler that hangs holds up every push to this partition."""
        view, lock = self._part(name)
        with lock:  # pushes to one partition apply one at a time: "add" loses nothing
            if op == "assign":
                view[local_ids] = rows
            elif op == "add":
                np.add.at(view, local_ids, rows)
            elif callable(op):
                op({name: view}, name, local_ids, rows)
            else:
                raise InvalidArgument(f"push op must be 'assign', 'add' or a callable, got "
                                      f"{op!r}")

    def dist_drop(self, name: str, part: str) -> None:
        with self._lock:
            held = self._parts.pop(name, None)
        if held is not None:
            self._client.release(held[0])
        self.drop(part)

    def _part(self, name):
        with self._lock:
            held = self._parts.get(name)
        if held is None:
            raise ObjectNotFound(f"node {self.node_id} has no partition of {name!r}", 1)
        return held
