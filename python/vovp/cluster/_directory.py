"""The cluster's directory: the versions of every name and which nodes hold them. A named,
detached Ray actor on the head node (``DIRECTORY_NAME`` in the ``vovp`` namespace), so Ray keeps
it, finds it and restarts nothing of ours: it dies with the head, as the cluster does.

An asyncio actor: every method is a coroutine on one event loop, so state changes need no
locks (nothing awaits between a check and its change), and a call that waits (``lookup``,
``wait_newer``, ``dist_spec``) is a suspended coroutine, not a thread: thousands can wait
while other calls are answered at once (``max_concurrency`` bounds them, not threads).

State, all in the actor's memory:
- ``objects``: name -> ``Entry`` of its newest *committed* version: the node that made it,
  its size, its metadata bytes verbatim, the version, the nodes holding that version, and
  their transfer addresses (``ip:port`` of their engines, registered by each agent);
- ``versions``: name -> the last version number handed out (``reserve``); survives
  ``unpublish``, so versions of a name only increase, and a writer that reserved and died
  leaves a gap, never a visible half-made version;
- ``dist``: DistTensor name -> its spec (shape, dtype, partition book);
- ``config``: what ``vovp.cluster.init`` chose (socket template, memory, engine, the
  cluster's transfer key...), read by agents of nodes that join later.

Versions are the stores' versions: a writer reserves ``v`` here, puts it into its node's store
sealed as exactly ``v`` (``PutOptions.version``), then commits; a copy fetched to another node
is sealed there as ``v`` too (the engines' FETCH). So ``vovp.version_of`` of any copy, on any
node, is the cluster's version.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Optional

DIRECTORY_NAME = "vovp-directory"
NAMESPACE = "vovp"
AGENT_PREFIX = "vovp-agent-"


def agent_name(node_id: str) -> str:
    """The Ray actor name of ``node_id``'s agent (in ``NAMESPACE``)."""
    return AGENT_PREFIX + node_id


@dataclass
class Entry:
    name: str
    owner: str  # Ray node id (hex) of the node that committed this version
    size: int
    metadata: bytes
    version: int
    holders: list[str] = field(default_factory=list)  # node ids with this version in store
    addresses: dict[str, str] = field(default_factory=dict)  # holder -> its transfer port

    def copy(self) -> "Entry":
        return Entry(self.name, self.owner, self.size, self.metadata, self.version,
                     list(self.holders), dict(self.addresses))


async def _changed(events: dict[str, asyncio.Event], name: str, left: Optional[float]) -> bool:
    """Wait until ``name`` changes (its Event in ``events`` is set) or ``left`` seconds pass
    (None: no limit); False when the time ran out."""
    event = events.setdefault(name, asyncio.Event())
    try:
        await asyncio.wait_for(event.wait(), left)
        return True
    except asyncio.TimeoutError:
        return False


class Directory:
    def __init__(self) -> None:
        self._objects: dict[str, Entry] = {}
        self._dist: dict[str, dict[str, Any]] = {}
        self._versions: dict[str, int] = {}  # the last version handed out, per name
        self._transfer: dict[str, str] = {}  # node id -> its engine's transfer address
        # name -> every node that held any version of it (unpublish deletes all their copies)
        self._seen: dict[str, set[str]] = {}
        self._config: Optional[dict[str, Any]] = None
        # name -> an Event set (and replaced) when the name changes: waiters of one name wake
        # only for it.
        self._changed: dict[str, asyncio.Event] = {}
        self._dist_changed: dict[str, asyncio.Event] = {}

    async def config(self, proposed: Optional[dict[str, Any]] = None) -> Any:
        """The cluster's config; the first caller's ``proposed`` becomes it."""
        if self._config is None and proposed is not None:
            self._config = dict(proposed)
        return self._config

    async def register(self, node: str, address: str) -> None:
        """``node``'s engine serves transfers at ``address`` (an agent, when it starts)."""
        self._transfer[node] = address

    async def transfer_address(self, node: str) -> Optional[str]:
        return self._transfer.get(node)

    # -- versions --------------------------------------------------------------------------

    async def reserve(self, name: str, replace: bool) -> Optional[int]:
        """The next version of ``name`` for a writer to put and then ``commit``: two racing
        writers get two versions. None when ``name`` is published and not ``replace`` (or is
        a DistTensor): ObjectExists for the caller."""
        if name in self._dist or (not replace and name in self._objects):
            return None
        version = self._versions.get(name, 0) + 1
        self._versions[name] = version
        return version

    async def claim(self, name: str, version: int, replace: bool) -> tuple[str, int]:
        """``reserve`` of exactly ``version`` (an object already stored under ``name`` on the
        caller's node, published as it is): ("ok", version); ("exists", 0) as ``reserve``'s
        None; ("taken", last) when the cluster gave the name ``version`` or a later one."""
        if name in self._dist or (not replace and name in self._objects):
            return "exists", 0
        last = self._versions.get(name, 0)
        if version <= last:
            return "taken", last
        self._versions[name] = int(version)
        return "ok", int(version)

    async def commit(self, name: str, version: int, node: str, size: int, metadata: bytes,
                     replace: bool) -> tuple[str, Optional[Entry]]:
        """``version`` of ``name`` is sealed in ``node``'s store: make it the name's current
        version, visible everywhere. Returns ("ok", entry); ("exists", entry) when not
        ``replace`` and a version is published already; ("stale", entry) when a newer version
        was committed meanwhile (a racing replace: that one stays current); ("dist", None) for
        a DistTensor's name."""
        if name in self._dist:
            return "dist", None
        current = self._objects.get(name)
        if current is not None and not replace:
            return "exists", current.copy()
        if current is not None and current.version >= version:
            return "stale", current.copy()
        self._versions[name] = max(self._versions.get(name, 0), int(version))
        entry = Entry(name, node, int(size), bytes(metadata), int(version), [node])
        self._address(entry, node)
        self._objects[name] = entry
        self._seen.setdefault(name, set()).add(node)
        self._notify(name)
        return "ok", entry.copy()

    async def lookup(self, name: str, timeout: Optional[float] = None) -> Optional[Entry]:
        """The Entry of ``name``'s current version; waits up to ``timeout`` seconds for it to be
        published (None: no wait). None when it is not published by then."""
        return await self.wait_newer(name, 0, timeout)

    async def wait_newer(self, name: str, version: Optional[int],
                         timeout: Optional[float] = None) -> Optional[Entry]:
        """The Entry of ``name``'s current version once it is above ``version`` (None or 0:
        any), waiting up to ``timeout`` seconds (None: no wait; negative: no limit) without
        polling: a commit wakes the waiters of its name. None when there is none by then."""
        floor = int(version or 0)
        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        while True:
            entry = self._objects.get(name)
            if entry is not None and entry.version > floor:
                return entry.copy()
            if timeout is None:
                return None
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            if not await _changed(self._changed, name, left):
                return None

    async def add_holder(self, name: str, node: str, version: int) -> str:
        """``node`` has a copy of ``version``: "ok" (recorded), "old" (a newer version is
        current: the copy stays, for whoever holds it, unrecorded), "gone" (unpublished: the
        directory tells the node's agent to delete its copy, so a fetch that raced the
        unpublish leaves nothing behind, even when its caller did not wait for this answer)."""
        entry = self._objects.get(name)
        if entry is None:
            if self._versions.get(name, 0) >= version:
                self._tell_drop(node, name, version)
            return "gone"
        if entry.version != version:
            self._seen.setdefault(name, set()).add(node)
            return "old"
        if node not in entry.holders:
            entry.holders.append(node)
            self._address(entry, node)
        self._seen.setdefault(name, set()).add(node)
        return "ok"

    async def drop_holder(self, name: str, node: str, version: int) -> None:
        """``node`` no longer has ``version`` (evicted or replaced there, or the node died)."""
        entry = self._objects.get(name)
        if entry is not None and entry.version == version and node in entry.holders:
            entry.holders.remove(node)
            entry.addresses.pop(node, None)

    async def drop_node(self, node: str) -> None:
        """``node`` died: it holds nothing any more (its store died with it)."""
        self._transfer.pop(node, None)
        for seen in self._seen.values():
            seen.discard(node)
        for entry in self._objects.values():
            if node in entry.holders:
                entry.holders.remove(node)
                entry.addresses.pop(node, None)

    async def unpublish(self, name: str) -> Optional[Entry]:
        """Forget ``name``; returns its Entry with ``holders`` every node that held any
        version of it (they should delete their copies), or None when it was not published.
        Its version numbers are not reused."""
        entry = self._objects.pop(name, None)
        seen = self._seen.pop(name, set())
        if entry is None:
            return None
        self._notify(name)
        entry.holders = sorted(seen | set(entry.holders))
        return entry

    async def names(self) -> list[str]:
        return sorted(self._objects)

    def _address(self, entry: Entry, node: str) -> None:
        address = self._transfer.get(node)
        if address is not None:
            entry.addresses[node] = address

    def _notify(self, name: str) -> None:
        event = self._changed.pop(name, None)
        if event is not None:
            event.set()

    def _tell_drop(self, node: str, name: str, version: int) -> None:
        """Ask ``node``'s agent to delete its copy of ``name`` at ``version`` or below (not
        awaited: the agent may be gone with its node, and then so is the copy)."""
        import ray

        try:
            agent = ray.get_actor(agent_name(node), namespace=NAMESPACE)
            agent.drop.remote(name, version)
        except Exception:  # noqa: BLE001 - no agent: its node and store are gone
            pass

    # -- DistTensor specs ----------------------------------------------------------------------

    async def create_dist(self, name: str, spec: dict[str, Any]) -> Any:
        """Record a DistTensor; returns (spec, created): the existing spec when ``name`` is
        already a DistTensor (created False), None when it is a published object."""
        if name in self._dist:
            return self._dist[name], False
        if name in self._objects:
            return None, False
        self._dist[name] = spec
        event = self._dist_changed.pop(name, None)
        if event is not None:
            event.set()
        return spec, True

    async def dist_spec(self, name: str, timeout: Optional[float] = None) -> Any:
        """The spec of DistTensor ``name``, waiting up to ``timeout`` seconds (None: no wait)
        for its creation; None when there is none by then."""
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        while name not in self._dist:
            left = 0.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return None
            if not await _changed(self._dist_changed, name, left):
                return None
        return self._dist[name]

    async def drop_dist(self, name: str) -> Any:
        return self._dist.pop(name, None)
