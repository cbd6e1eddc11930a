"""The fetch walk: how a name's version gets into this node's store, and the control calls
it makes (``call``, ``directory_call``), for any process of the cluster (a user's process or
a node's agent).

The walk (``fetch_object``)::

    local store: a version above ``newer_than`` here?  -- yes --> done, zero-copy
     `- no: the location cache (name -> Entry) when its version is above ``newer_than``,
        else ONE control message: directory.wait_newer(name, newer_than, timeout), which
        waits (a suspended coroutine in the directory, no polling) for a committed version
        above it and answers its Entry: version, holders, their engines' transfer addresses
        FETCH(holder address, name, version) to this node's own engine, from this process:
        the engine mints a ticket, pulls the bytes over TCP straight into its store and seals
        them as exactly that version; concurrent FETCHes of one version on one node share one
        transfer, whatever process sent them; no Python touches the bytes
        directory.add_holder(name, this node, version), not awaited (an unpublish that raced
        it: the directory itself tells this node's agent to delete the copy)

A holder whose FETCH fails is checked against Ray's node table (and its agent): a dead one is
dropped from the directory (``drop_node``, its store died with it) and the next holder tried;
a live one that no longer holds the version (replaced or evicted there) is dropped as a
holder of it. When every holder failed, the directory is asked once more (a newer version or
a new holder may have come); with none left: ObjectLost naming the dead nodes, or VovpError
with a live holder's failure.

Per-process caches (reset in a forked or new process): the location cache (name -> the Entry
of the version last fetched here, replaced by newer ones) and node -> transfer address.
"""

from __future__ import annotations

import os
import queue
import random
import re
import threading
import time
from typing import Any, Callable, Optional

import ray

from ..client import Client
from ..errors import ObjectLost, ObjectNotFound, StaleVersion, TransferFailed, VovpError
from ._directory import DIRECTORY_NAME, NAMESPACE, Entry, agent_name

# A directory call that does not wait still gets an answer within this (a head node that died
# without Ray noticing yet must not hang the caller).
CONTROL_TIMEOUT = 60.0
# Seconds a holder's agent has to answer "are you alive" after its transfer failed.
ALIVE_TIMEOUT = 5.0
# Rounds of the walk (a directory answer and its holders) before a fetch gives up: each round
# follows a newer version or drops dead, empty or replaced holders.
ATTEMPTS = 16
# Seconds to wait for the commit of a version a holder had already (its writer commits right
# after its put) before going on with the holders of the version asked for.
MOVED_ON_WAIT = 5.0
# A holder's refusal of a version it replaced names the one it has (transport's holder.rs).
_PRESENT = re.compile(r"present version: (\d+)")

_lock = threading.Lock()
_caches: dict[str, Any] = {"pid": None, "locations": {}, "addresses": {}, "notes": None}


def _cache() -> dict[str, Any]:
    with _lock:
        if _caches["pid"] != os.getpid():
            _caches.update(pid=os.getpid(), locations={}, addresses={}, notes=None)
        return _caches


def reset() -> None:
    """Forget every cached location and address (``vovp.cluster.shutdown``)."""
    with _lock:
        _caches.update(pid=None, locations={}, addresses={}, notes=None)


def _note_holder(directory: Any, name: str, node: str, version: int) -> None:
    """``directory.add_holder(name, node, version)``, sent by a thread of this process after
    the fetch returned: submitting a Ray call costs ~0.5 ms here, which a first fetch of a
    small tensor need not wait for (nobody awaits the answer either: see ``add_holder``)."""
    cache = _cache()
    with _lock:
        notes = cache["notes"]
        if notes is None:
            notes = cache["notes"] = queue.SimpleQueue()
            threading.Thread(target=_send_notes, args=(notes,), name="vovp-holder-notes",
                             daemon=True).start()
    notes.put((directory, name, node, version))


def _send_notes(notes: "queue.SimpleQueue[tuple[Any, str, str, int]]") -> None:
    while True:
        directory, name, node, version = notes.get()
        try:
            directory.add_holder.remote(name, node, version)
        except Exception:  # noqa: BLE001 - a directory gone: the next call says so
            continue


def remember_address(node: str, address: str) -> None:
    """Cache ``node``'s transfer address in this process (learnt from its agent)."""
    _cache()["addresses"][node] = address


def forget(name: str) -> None:
    """Drop ``name`` from this process's location cache (unpublish)."""
    _cache()["locations"].pop(name, None)


def alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def call(refs: Any, timeout: Optional[float]) -> Any:
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


def directory_call(ref: Any, timeout: Optional[float] = None, wait: Optional[float] = None) \
        -> Any:
    """``call`` of a directory method: ``wait`` is how long the method itself may wait (its
    own timeout argument); the answer is awaited that long plus ``CONTROL_TIMEOUT``, so a
    directory that is gone (its head node died) is a VovpError naming it, never a hang."""
    limit = CONTROL_TIMEOUT if wait is None or wait < 0 else wait + CONTROL_TIMEOUT
    if timeout is not None:
        limit = timeout
    try:
        return ray.get(ref, timeout=limit)
    except ray.exceptions.RayTaskError as e:
        cause = e.cause
        if isinstance(cause, BaseException):
            raise cause from None
        raise
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as e:
        raise VovpError(
            f"the vovp directory (Ray actor {DIRECTORY_NAME!r} on the head node) did not "
            f"answer within {limit:g} s or is gone: the head node died or is unreachable, "
            f"and the cluster's names with it ({type(e).__name__})") from None


def directory_handle() -> Any:
    """The directory, looked up by name (a process that did not start it)."""
    try:
        return ray.get_actor(DIRECTORY_NAME, namespace=NAMESPACE)
    except ValueError:
        raise VovpError("vovp.cluster is not initialized (no vovp directory): call "
                        "vovp.cluster.init() first") from None


def transfer_address(directory: Any, node: str) -> Optional[str]:
    """``node``'s engine's transfer address (cached per process: one directory call the first
    time; agents register theirs when they start)."""
    addresses = _cache()["addresses"]
    address: Optional[str] = addresses.get(node)
    if address is None:
        address = directory_call(directory.transfer_address.remote(node))
        if address is not None:
            addresses[node] = address
    return address


def holder_alive(node: str) -> bool:
    """Whether ``node`` is alive in Ray's node table and its agent answers."""
    if node not in alive_nodes():
        return False
    try:
        agent = ray.get_actor(agent_name(node), namespace=NAMESPACE)
        ray.get(agent.info.remote(), timeout=ALIVE_TIMEOUT)
        return True
    except (ValueError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False


def local(c: Client, name: str, newer_than: Optional[int], framework: Optional[str],
          writable: bool) -> Any:
    """``name`` from this node's store (above ``newer_than`` when given), or None."""
    try:
        return c.get_tensor(name, framework=framework, writable=writable,
                            newer_than=newer_than or None)
    except ObjectNotFound:
        return None


def fetch_object(c: Client, directory: Any, me: str, name: str, *,
                 newer_than: Optional[int] = None, timeout: Optional[float] = None,
                 framework: Optional[str] = None, writable: bool = False,
                 source: Optional[str] = None, defer_note: bool = True,
                 fetch_args: Optional[Callable[[Entry], dict[str, Any]]] = None) \
        -> tuple[Any, bool]:
    """The walk of this module's doc: (the tensor, whether this call made a FETCH).
    ``timeout``: None = a version must be committed already (ObjectNotFound otherwise);
    seconds = wait that long for one (TimeoutError). ``source``: a holder to try first.
    ``defer_note``: the add_holder is submitted by a thread after the return (False: before
    it, so that the caller's next directory call finds this holder: broadcast's rounds).
    ``fetch_args(entry)``: more arguments for the FETCH of ``entry`` (``_state``'s base
    version and ranges)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    got = local(c, name, newer_than, framework, writable)
    if got is not None:
        return got, False
    locations = _cache()["locations"]
    floor = int(newer_than or 0)
    lost: list[str] = []
    # Failures as their messages: an exception's traceback holds this frame, whose locals
    # hold the tensor returned: a cycle only the cyclic GC frees, after the caller let go.
    failed: list[tuple[str, int, str]] = []
    tried: set[tuple[str, int]] = set()
    moved_on: Optional[int] = None  # a version some holder had replaced already
    cached: Optional[Entry] = locations.get(name) if newer_than is not None else None
    if cached is not None and cached.version <= floor:
        cached = None
    for attempt in range(ATTEMPTS):
        entry: Optional[Entry] = cached
        from_cache = entry is not None
        if entry is None and moved_on is not None:
            # A holder had a version above ``moved_on`` already: wait (briefly) for its
            # commit rather than take it from the holder, whose newer version may never be
            # committed (its writer died after the put).
            left = _left(deadline, name)
            briefly = MOVED_ON_WAIT if left is None else min(left, MOVED_ON_WAIT)
            entry = directory_call(directory.wait_newer.remote(name, moved_on, briefly),
                                   wait=briefly)
            moved_on = None
        if entry is None:
            wait = _left(deadline, name)
            entry = directory_call(directory.wait_newer.remote(name, floor, wait), wait=wait)
        if entry is None:
            got = local(c, name, newer_than, framework, writable)  # put here meanwhile
            if got is not None:
                return got, False
            if timeout is None:
                raise ObjectNotFound(f"{name!r} is not published in the vovp cluster"
                                     + (f" above version {floor}" if floor else ""), 1)
            raise TimeoutError(f"no version of {name!r}"
                               + (f" above {floor}" if floor else "")
                               + f" was published within {timeout} s")
        if me in entry.holders:
            got = local(c, name, entry.version - 1, framework, writable)
            if got is not None:
                return got, False
            directory.drop_holder.remote(name, me, entry.version)  # evicted here
        holders = [h for h in entry.holders if h != me and (h, entry.version) not in tried]
        random.shuffle(holders)  # spread readers over every copy, not just the writer's
        if source is not None and source in holders:
            holders.remove(source)
            holders.insert(0, source)
        if not holders and attempt > 0 and moved_on is None:
            break
        for holder in holders:
            tried.add((holder, entry.version))
            address = entry.addresses.get(holder) or transfer_address(directory, holder)
            if address is None:
                continue
            try:
                more = {} if fetch_args is None else fetch_args(entry)
                got = c.fetch_from(address, name, entry.version, timeout=_left(deadline, name),
                                   framework=framework, writable=writable, **more)
            except StaleVersion:  # a newer version was sealed here meanwhile
                got = local(c, name, newer_than, framework, writable)
                if got is not None:
                    return got, False
                continue
            except TransferFailed as e:
                present = _PRESENT.search(str(e))
                if present is not None and int(present.group(1)) > entry.version:
                    # Replaced there by a newer version (a writer faster than this reader):
                    # other holders may still have this one; else the directory's next.
                    directory.drop_holder.remote(name, holder, entry.version)
                    moved_on = entry.version
                    continue
                if from_cache:
                    # A location this process remembered: the name may have been unpublished
                    # (or the copy evicted) since. Ask the directory before judging the holder.
                    tried.discard((holder, entry.version))
                    break
                if holder_alive(holder):
                    # Alive: it evicted this version, or the transfer broke.
                    failed.append((holder, entry.version, str(e)))
                    directory.drop_holder.remote(name, holder, entry.version)
                else:
                    lost.append(holder)
                    directory.drop_node.remote(holder)
                continue
            if me not in entry.holders:
                entry.holders.append(me)
                if defer_note:
                    _note_holder(directory, name, me, entry.version)
                else:
                    directory.add_holder.remote(name, me, entry.version)
            known = locations.get(name)
            if known is None or known.version <= entry.version:
                locations[name] = entry
            return got, True
        cached = None
    locations.pop(name, None)
    if failed:
        holder, version, error = failed[-1]
        raise VovpError(f"fetch of {name!r} version {version} from node {holder} failed: "
                        f"{error}")
    if lost:
        raise ObjectLost(f"{name!r} is lost: it was held only by node(s) "
                         f"{', '.join(dict.fromkeys(lost))}, which died (Ray reports them dead "
                         "or their vovp agent is gone)", 0)
    raise ObjectLost(f"{name!r} is lost: no node holds a copy any more (evicted from every "
                     "store that had it)", 0)


def _left(deadline: Optional[float], name: str) -> Optional[float]:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"{name!r} did not arrive in time")
    return left
