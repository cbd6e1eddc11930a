"""The cluster's directory: which node holds which name. A named, detached Ray actor on the
head node (``DIRECTORY_NAME`` in the ``vovp`` namespace), so Ray keeps it, finds it and
restarts nothing of ours: it dies with the head, as the cluster does.

State, all in the actor's memory:
- ``objects``: name -> ``Entry`` (owner node, holder nodes, size, the object's metadata bytes
  verbatim so that a fetched copy is the same tensor type, version);
- ``dist``: DistTensor name -> its spec (shape, dtype, partition book);
- ``config``: what ``vovp.cluster.init`` chose (socket template, memory, engine, ...), read
  by agents of nodes that join later.

The actor is threaded: ``lookup`` may wait for a name to be published while other calls go on.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

DIRECTORY_NAME = "vovp-directory"
NAMESPACE = "vovp"


@dataclass
class Entry:
    name: str
    owner: str  # Ray node id (hex) of the node that published it
    size: int
    metadata: bytes
    version: int
    holders: list[str] = field(default_factory=list)  # node ids with a copy in their store


class Directory:
    def __init__(self):
        self._objects: dict[str, Entry] = {}
        self._dist: dict[str, dict[str, Any]] = {}
        self._versions: dict[str, int] = {}  # survives unpublish: versions only increase
        self._config = None
        self._changed = threading.Condition()

    def config(self, proposed=None):
        """The cluster's config; the first caller's ``proposed`` becomes it."""
        with self._changed:
            if self._config is None and proposed is not None:
                self._config = dict(proposed)
            return self._config

    def publish(self, name: str, node: str, size: int, metadata: bytes):
        """Record ``name`` as owned (and held) by ``node``. Returns the Entry, or None when
        the name is already published (ObjectExists for the caller)."""
        with self._changed:
            if name in self._objects or name in self._dist:
                return None
            version = self._versions.get(name, 0) + 1
            self._versions[name] = version
            entry = Entry(name, node, int(size), bytes(metadata), version, [node])
            self._objects[name] = entry
            self._changed.notify_all()
            return entry

    def lookup(self, name: str, timeout: float | None = None):
        """The Entry of ``name``; waits up to ``timeout`` seconds for it to be published
        (None: no wait). None when it is not published by then."""
        return self._wait_for(self._objects, name, timeout)

    def _wait_for(self, table: dict[str, Any], name: str, timeout: float | None) -> Any:
        """``table[name]``, waiting up to ``timeout`` seconds (None: no wait) for a publish
        or create_dist to add it; None when it is still missing."""
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        with self._changed:
            while name not in table:
                left = 0.0 if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(left)
            return table[name]

    def add_holder(self, name: str, node: str, version: int) -> bool:
        """``node`` has a copy of version ``version``; False when the name moved on (it was
        unpublished, or published again) and the copy is stale."""
        with self._changed:
            entry = self._objects.get(name)
            if entry is None or entry.version != version:
                return False
            if node not in entry.holders:
                entry.holders.append(node)
            return True

    def drop_holder(self, name: str, node: str, version: int) -> None:
        """``node`` no longer has a copy (evicted there, or the node died)."""
        with self._changed:
            entry = self._objects.get(name)
            if entry is not None and entry.version == version and node in entry.holders:
                entry.holders.remove(node)

    def unpublish(self, name: str):
        """Forget ``name``; returns its Entry (whose holders should delete their copies) or
        None when it was not published."""
        with self._changed:
            return self._objects.pop(name, None)

    def names(self) -> list[str]:
        with self._changed:
            return sorted(self._objects)

    # -- DistTensor specs ----------------------------------------------------------------------

    def create_dist(self, name: str, spec: dict[str, Any]) -> Any:
        """Record a DistTensor; returns (spec, created): the existing spec when ``name`` is
        already a DistTensor (created False), None when it is a published object."""
        with self._changed:
            if name in self._dist:
                return self._dist[name], False
            if name in self._objects:
                return None, False
            self._dist[name] = spec
            self._changed.notify_all()
            return spec, True

    def dist_spec(self, name: str, timeout: float | None = None):
        """The spec of DistTensor ``name``, waiting as ``lookup`` does."""
        return self._wait_for(self._dist, name, timeout)

    def drop_dist(self, name: str):
        with self._changed:
            return self._dist.pop(name, None)
