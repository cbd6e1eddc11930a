"""Leases: this process's index of the store references the Python layer handed out.

Every reference the daemon grants is held by a native view (``vovp._native.Object``, or
``Buffer`` for an object this client created), which releases it when garbage collected (see
``vovp.client``). What the Python layer hands out is made over that view: an *owner* (numpy's
array over a host object, ``vovp.cuda.DeviceBuffer`` over a CUDA one) and views of it. A
``Lease`` is a weak reference to the owner with what is known of the reference (object id,
name, address range); ``LEASES`` (id(owner) -> Lease) is only an index: ``Client.release(arr)``
and ``find_lease(arr)`` (``vovp._lookup``) find the reference behind an array by its owner, or
by address (torch tensors), and ``release`` gives it back early through the native view.

One lease per reference: ``lease()`` makes and indexes the lease of an owner ``vovp._core``
makes. A host owner's fields are read from its native view (the owner's ``base``) the first
time one is asked: most results die unasked (a ``put_tensor`` whose result is dropped at
once), and reading them up front was a fifth of what a lease cost. ``vovp.plasma`` keeps
one record per object in use, its entry, which is a ``Lease`` subclass: ``lease(..., entry=entry)`` fills it in and indexes it only when an address lookup
needs it, through a finder (``register_finder``), because indexing cost a quarter of a
drop-in get.

This module imports nothing of vovp's: ``vovp._core``, ``vovp._lookup``, ``vovp.cuda`` and
``vovp.plasma`` use it. Its interface to them: ``Lease``, ``lease``, ``lease_all``, ``lease_of``,
``leases_of``, ``lease_at``, ``claim``, ``give_back``, ``release_owner``, ``register_finder``,
``FORKS``, ``LEASES``.
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any, Callable, List, Optional

if TYPE_CHECKING:
    _Ref = weakref.ref[Any]
else:
    _Ref = weakref.ref

# Forks of this process so far (a child's clients see their parent's count change): cheaper
# on every call than comparing os.getpid().
FORKS = [0]
os.register_at_fork(after_in_child=lambda: FORKS.__setitem__(0, FORKS[0] + 1))

# id(owner) -> Lease. Module-level so lookups by address see every client's objects.
LEASES: dict[int, Lease] = {}

# Finders of store memory handed out without an indexed lease, asked by address when no lease
# matches: functions (address, cuda) -> lease or None, which index the lease they return.
_FINDERS: list[Callable[[int, bool], Optional[Lease]]] = []


class Lease(_Ref):
    """Weak reference to an owner (array or device buffer): where a reference's bytes are.

    ``client``: the connection that holds the reference (``vovp._core.ClientCore``); ``oid``, ``name``:
    the object's; ``start``, ``size``: its bytes in this process (host: the address of the
    first byte; CUDA: the device address); ``segment``, ``offset``: where the store keeps a
    host object (None for CUDA); ``obj``: weak reference to the native view; ``token``: whoever
    pops it releases the reference (or gives it up): list.pop is atomic, so an explicit
    release() racing garbage collection releases once.
    """

    __slots__ = ("key", "client", "_oid", "name", "start", "size", "token", "cuda", "obj",
                 "segment", "offset", "_version", "_later")

    key: int
    client: Any  # vovp._core.ClientCore (vovp.plasma's: its vovp.Client's)
    _oid: Optional[int]  # None: a pipelined put's, whose reply is still to be read
    name: str
    start: int
    size: int
    token: List[bool]
    cuda: bool
    obj: Callable[[], Any]  # weak reference to the native view
    segment: Optional[int]
    offset: Optional[int]
    _version: int  # the name's version the object is (0 until a created object is sealed)
    _later: bool  # set: the fields above are read from the native view when first asked

    # Only for a slot not set yet: the fields of a lease `lease()` made are read here, from
    # its owner's native view, when the first of them is asked for (see the module docstring).
    def __getattr__(self, attr: str) -> Any:
        if attr not in _READ_LATER or not _is_set(self, "_later"):
            raise AttributeError(attr)
        del self._later  # (filled once: an attribute missing after this is an error)
        owner = self()
        native = None if owner is None else owner.base
        if native is None:  # the owner is gone, and with it what its lease knew
            self.obj = _gone
            fields: tuple[Any, ...] = (None, "", 0, 0, None, None, 0)
        else:
            self.obj = weakref.ref(native)
            fields = native.lease_fields
        version = self._version  # (None, or the version seal set meanwhile: it stays)
        (self._oid, self.name, self.start, self.size, self.segment, self.offset,
         self._version) = fields
        if version is not None:
            self._version = version
        return object.__getattribute__(self, attr)

    # A pipelined put_tensor's result comes back before the store's answer (its id and version
    # come with it): they are asked of the native view the first time they are needed, which
    # reads that answer (and raises the put's error, if the store refused it).
    def _resolve(self) -> None:
        obj = self.obj()
        if obj is None:
            raise LookupError("the store's answer to this put was not read before its view "
                              "was released")
        self._oid, self._version = obj.id, obj.version

    @property
    def oid(self) -> int:
        """The object id."""
        if self._oid is None:
            self._resolve()
        return self._oid  # type: ignore[return-value]

    @property
    def known_oid(self) -> Optional[int]:
        """The object id, or None while a pipelined put's answer is unread (not read here)."""
        return self._oid

    @property
    def version(self) -> int:
        """The name's version the object is (0 until a created object is sealed)."""
        if self._oid is None:
            self._resolve()
        return self._version

    @version.setter
    def version(self, v: int) -> None:
        self._version = v


_new_lease = Lease.__new__

# What a lease made by `lease()` reads from its native view when first asked: the native
# view's `lease_fields` and the weak reference to it (`_version` starts as None: a version
# seal sets meanwhile stays).
_READ_LATER = ("_oid", "name", "start", "size", "segment", "offset", "obj")


def _is_set(lease: Lease, field: str) -> bool:
    try:
        object.__getattribute__(lease, field)
        return True
    except AttributeError:
        return False


def _gone() -> None:
    """The native view of a lease whose owner died before its fields were read."""
    return None


def _lease_died(lease: Lease) -> None:
    # Runs inside garbage collection: never raise. The native object releases itself.
    try:
        if LEASES.get(lease.key) is lease:
            del LEASES[lease.key]
    except BaseException:  # noqa: BLE001 (interpreter shutdown)
        pass


def lease(owner: Any, client: Any, obj: Any, cuda: bool = False,
          entry: Optional[Lease] = None) -> Lease:
    """Index the lease of ``owner`` over native view ``obj`` held through ``client`` (a CUDA
    owner: its ``ptr`` is the device address) and return it: a new Lease, or ``entry``, a
    Lease of ``owner`` made without one's fields (vovp.plasma's entries) filled in now. Every
    get's path: one call."""
    self = _new_lease(Lease, owner, _lease_died) if entry is None else entry
    self.key = key = id(owner)
    self.client = client
    self.cuda = cuda
    self.token = [True]
    if entry is None and not cuda and owner.base is obj:
        self._later = True  # (its fields are read when first asked)
        self._version = None  # type: ignore[assignment] # (filled with them)
    else:
        (self._oid, self.name, self.start, self.size, self.segment, self.offset,
         self._version) = obj.lease_fields
        if cuda:
            self.start = owner.ptr
        self.obj = weakref.ref(obj)
    LEASES[key] = self
    return self


def lease_all(owners: List[Any], client: Any, objs: List[Any]) -> None:
    """``lease(owner, client, obj)`` of each host owner over its native view, in one call: a
    batch's (``get_tensors``, ``put_tensors``). The same fields as ``lease``'s, written out
    here because a call per tensor was a tenth of a batched get."""
    new, died, index = Lease.__new__, _lease_died, LEASES
    for owner, obj in zip(owners, objs):
        if owner.base is not obj:
            lease(owner, client, obj)  # (an owner that is no native view's array)
            continue
        self = new(Lease, owner, died)
        self.key = key = id(owner)
        self.client = client
        self.cuda = False
        self.token = [True]
        self._later = True  # (its fields are read when first asked)
        self._version = None  # type: ignore[assignment] # (filled with them)
        index[key] = self


def lease_of(owner: object) -> Optional[Lease]:
    """The lease of ``owner`` itself, or None."""
    lease = LEASES.get(id(owner))
    return lease if lease is not None and lease() is owner else None


def leases_of(client: object) -> list[Lease]:
    """Every lease held through ``client``."""
    return [lease for lease in list(LEASES.values()) if lease.client is client]


def claim(lease: Lease) -> bool:
    """Take the right to release ``lease``'s reference; False if someone already did."""
    try:
        lease.token.pop()
        return True
    except IndexError:
        return False


def give_back(lease: Lease) -> None:
    """Release ``lease``'s reference now (it was claimed)."""
    obj = lease.obj()
    if obj is not None:
        obj.release()


def release_owner(owner: object) -> bool:
    """Release the reference behind an owner now (``CudaTensor.release``)."""
    lease = lease_of(owner)
    if lease is None or not claim(lease):
        return False
    give_back(lease)
    return True


def lease_at(addr: int, cuda: bool) -> Optional[Lease]:
    """The live lease whose bytes hold ``addr`` (host or device address), or None."""
    for lease in list(LEASES.values()):
        if lease() is None:
            if LEASES.get(lease.key) is lease:  # (indexed by a finder: no callback removes it)
                del LEASES[lease.key]
            continue
        if lease.cuda != cuda or not lease.token:
            continue
        start = lease.start
        if start <= addr < start + lease.size or (addr == start and lease.size == 0):
            return lease
    for find in _FINDERS:
        found = find(addr, cuda)
        if found is not None:
            return found
    return None


def register_finder(find: Callable[[int, bool], Optional[Lease]]) -> None:
    """Ask ``find(address, cuda)`` (-> an indexed lease or None) when no lease holds an
    address."""
    _FINDERS.append(find)
