"""A node's agent: the one Ray actor per node (``vovp-agent-<node id>``, pinned to that node)
that owns the node's side of the cluster.

It connects to the node's ``vovp-engine`` (or starts one, with ``--transfer <node ip>:0`` and
the cluster's transfer key, which dies with it) and registers the engine's transfer address
with the directory; the bytes of a fetch go engine to engine (``_fetch``), never through an
agent. It also fetches on request (``ensure``: broadcast's pushes), deletes copies
(``drop``: unpublish), keeps the node's DistTensor partitions (the creator's writable view, so
pushes apply in place), and reports the node's store and transfer numbers to Ray's metrics
(``_metrics``).
"""

from __future__ import annotations

import os
import threading
from typing import Any, Optional

import numpy as np
import ray

from .. import daemon
from ..client import Client, version_of
from ..errors import (
    ConnectionError as VovpConnectionError,
    InvalidArgument,
    ObjectNotFound,
    VovpError,
)
from . import _fetch
from ._directory import AGENT_PREFIX, agent_name
from ._fetch import alive_nodes, directory_handle
from ._metrics import NodeReporter

__all__ = ["AGENT_PREFIX", "Agent", "agent_name", "alive_nodes", "socket_for"]


def socket_for(template: str, node_id: str) -> str:
    """The store's socket on ``node_id``: ``{node}`` in the template becomes the node id's
    first 12 hex digits (nodes of one machine share /tmp; a socket path is at most 107 bytes)."""
    return template.replace("{node}", node_id[:12])


# The engine's transfer counters (TRANSFER_INFO) as the agent reports them.
TRANSFER_COUNTERS = {"fetches": "transfers", "fetches_shared": "transfers_shared",
                     "fetches_failed": "transfers_failed", "bytes_received": "bytes_received",
                     "bytes_served": "bytes_sent", "streams_served": "streams_served"}


class Agent:
    def __init__(self, node_id: str, config: dict[str, Any]):
        self.node_id = node_id
        self._config = config
        self.socket = socket_for(config["socket"], node_id)
        self._engine: daemon.StoreProcess | None = None
        self._client = self._connect_or_start()
        self._transfer = self._client.transfer_address()
        if self._transfer is None:
            self.stop()
            raise VovpError(
                f"node {node_id}: the vovp-engine at {self.socket} serves no transfers: start "
                "it with --transfer <this node's ip>:0 and the cluster's key (the "
                "VOVP_TRANSFER_KEY variable or --transfer-key-file; "
                "vovp.cluster.init(start=False, transfer_key=...))")
        self._directory = directory_handle()
        _fetch.directory_call(self._directory.register.remote(node_id, self._transfer))
        self._lock = threading.Lock()
        self._parts: dict[str, tuple[Any, Any]] = {}
        self._part_versions: dict[str, int] = {}  # DistTensor name -> its partition's version  # DistTensor name -> (writable view, lock)
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
        env = {**os.environ, "VOVP_TRANSFER_KEY": self._config["transfer_key"]}
        try:
            # Started as vovp.start_store starts one: it dies with this agent, even when Ray
            # kills the agent with SIGKILL. The key travels in its environment, never on its
            # command line.
            self._engine = daemon.spawn(
                (), self._config.get("memory", "1G"), self.socket, False, 30,
                {"transfer": f"{ray.util.get_node_ip_address()}:0"},
                extra=tuple(socket_for(a, self.node_id)
                            for a in self._config.get("engine_args", ())), binary=binary,
                env=env)
        except FileNotFoundError as e:
            raise VovpError(f"node {self.node_id}: no vovp-engine to start ({e}); pass "
                            "engine= to vovp.cluster.init or run a daemon and pass socket=") from None
        except VovpConnectionError as e:
            raise VovpError(f"node {self.node_id}: {e}") from None
        return Client(self.socket)

    def info(self) -> dict[str, Any]:
        return {"node": self.node_id, "socket": self.socket, "pid": os.getpid(),
                "engine_pid": None if self._engine is None else self._engine.pid,
                "transfer": self._transfer}

    def stats(self) -> dict[str, int]:
        """The engine's transfer counters, under the names the agent reports them by
        (``TRANSFER_COUNTERS``; ``refused``: every refused stream, whatever the reason)."""
        counters = self._client.transfer_info()[1]
        out = {ours: int(counters.get(theirs, 0)) for theirs, ours in TRANSFER_COUNTERS.items()}
        out["refused"] = sum(int(v) for k, v in counters.items() if k.startswith("refused_"))
        return out

    def node_stats(self) -> dict[str, int]:
        """The node's store's STATS and its transfer counters, in one dict (what
        ``vc.stats()`` adds up and the agent reports to Ray's metrics)."""
        return {**self._client.stats(), **self.stats()}

    def reported(self) -> dict[str, int]:
        """What the agent last reported through ``ray.util.metrics``."""
        return self._reporter.reported()

    def stop(self) -> None:
        """Stop reporting; stop the engine this agent started (before Ray kills the agent)."""
        reporter = getattr(self, "_reporter", None)
        if reporter is not None:
            reporter.stop()
        self._client.close()
        if self._engine is not None:
            self._engine.stop()

    # -- fetch on request, delete --------------------------------------------------------------

    def ensure(self, name: str, timeout: Optional[float] = None, source: Optional[str] = None,
               newer_than: Optional[int] = None) -> dict[str, Any]:
        """Make a version of ``name`` (above ``newer_than``) present in this node's store, by
        the fetch walk (``_fetch``; ``source``: the holder to try first). Returns
        {"transferred": whether this call sent a FETCH, "version": the version here}."""
        got, transferred = _fetch.fetch_object(
            self._client, self._directory, self.node_id, name, newer_than=newer_than,
            timeout=timeout, framework="numpy", source=source, defer_note=False)
        version = version_of(got)
        del got
        return {"transferred": transferred, "version": version}

    def drop(self, name: str, version: Optional[int] = None) -> bool:
        """Delete the local copy of ``name`` (unpublish); with ``version``, only a copy of that
        version or an older one (a late fetch of an unpublished name)."""
        try:
            if version is not None:
                view = self._client.get_buffer(name)
                here = version_of(view)
                self._client.release(view)
                if here > version:
                    return False
            self._client.delete(name)
            return True
        except ObjectNotFound:
            return False

    # -- DistTensor partitions -----------------------------------------------------------------

    def dist_create(self, name: str, part: str, rows: int, row_shape, dtype: str) -> int:
        """Create this node's partition (zeros) as the store object ``part``; the agent keeps
        the creator's writable view for pushes, and with it a reference: never evicted.
        Returns its store version (what a GATHER of its rows names)."""
        with self._lock:  # held throughout: two processes attaching at once create it once
            if name in self._parts:
                return self._part_versions[name]
            view = self._client.create_tensor(part, (int(rows), *row_shape), np.dtype(dtype))
            try:
                view[...] = 0
                version = self._client.seal(part)
            except BaseException:
                self._client.abort(part)
                raise
            self._parts[name] = (view, threading.Lock())
            self._part_versions[name] = version
            return version

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
            self._part_versions.pop(name, None)
        if held is not None:
            self._client.release(held[0])
        self.drop(part)

    def _part(self, name):
        with self._lock:
            held = self._parts.get(name)
        if held is None:
            raise ObjectNotFound(f"node {self.node_id} has no partition of {name!r}", 1)
        return held
