"""Plasma's Python API (``pyarrow.plasma`` of pyarrow 11) over the vovp daemon.

    import vovp.plasma as plasma              # was: import pyarrow.plasma as plasma
    client = plasma.connect("/tmp/vovp.sock")
    object_id = client.put(np.arange(10))     # pickle protocol 5, arrays out of band
    arr = client.get(object_id)               # zero-copy, read-only view of the store's memory

Everything Plasma's tests exercise behaves as in Plasma; README.md ("Moving from Plasma") lists
what differs. pyarrow is optional: when it is importable, buffers are ``pyarrow.Buffer`` objects
(as Plasma's were, so Arrow readers and writers take them) and errors derive from
``pyarrow.lib.ArrowException``; without it buffers are ``PlasmaBuffer`` (a uint8 numpy array
with ``to_pybytes()``) and errors derive from this module's ``ArrowException``. Either way every
error is also the matching ``vovp.VovpError`` subclass. ``VOVP_PLASMA_PYARROW=0`` ignores an
installed pyarrow.

How Plasma's model maps onto vovp
---------------------------------
Names. An ObjectID is stored under the vovp name ``plasma:<40 lowercase hex digits>``
(``ObjectID.name``, made here alone: any client that knows the id can name the object so). A
``str`` is accepted wherever an ObjectID is and is used as the vovp name as it is.

Layout. Plasma keeps an object's data and metadata side by side in shared memory and counts
both against the store's memory; so does this module: the vovp object holds ``data || metadata``
and its vovp metadata is a 24-byte header (``_HEADER``: magic ``VPLS``, version, flags, data
size, creation time), so metadata may be as large as the data (vovp's own metadata is capped at
64 KiB) and store-full/eviction sizes are Plasma's ``data_size + metadata_size``. An object
without Plasma metadata that ``put`` did not write has nothing for a header to say but its
creation time, and is stored without one: a plain vovp object, charged exactly its data as in
Plasma (so an object as large as the store fits; a header would cost a 64-byte unit more).
This process remembers the creation times of such objects it made (``_CREATED_AT``); for one
made elsewhere ``list`` reports the daemon's last access instead.

References. Plasma counts references in the client: ``create`` counts two (the returned buffer,
and one that ``seal`` gives back, so dropping the buffer before sealing does not abort the
object), each object returned by a get counts one, and when the count of an object reaches zero
the client releases it in the store. A ``PlasmaClient`` here has one ``_InUse`` entry per object
it uses, and the client's single vovp reference to it is held by the entry's *anchor*, which
every buffer handed out for the object is made from. A get's anchor is the native core's object
view itself (``vovp._native.Object``) when pyarrow is importable, its buffers
``pyarrow.foreign_buffer`` over its address with it as their base; without pyarrow it is numpy's
array over that object, its buffers views of the array; a created object's anchor is an array
over the creator's writable buffer. Every array, memoryview, slice or Arrow buffer made from a
handed-out buffer keeps the anchor alive (numpy stops collapsing ``.base`` chains at an array
whose base is not an array; an Arrow slice keeps its parent), and with it the reference: the
count is the anchor's own reference count, and the vovp reference goes with the last of them
("release on drop"; buffers keep their object alive, also once the PlasmaClient is garbage,
though not past ``disconnect``, which ends the connection). The entry itself is a weakref to
its anchor, plus, from ``create`` to ``seal``, a strong reference to the creator's array (the
count ``seal`` gives back). It is also the reference's lease (``vovp._lease.Lease``, the
index ``vovp.Client.release`` and ``find_lease`` search), indexed only when such a lookup by
address needs it. So a get costs no bookkeeping per buffer, and a second get of an
object in use is served from its anchor without asking the store, as in Plasma. An entry whose anchor has died is dead: the next get of
the object replaces it, and dead entries are swept when the table has doubled (nothing runs
inside garbage collection, so nothing there waits for the client's lock).

Releases of gets are sent the way vovp's own client sends them: with this client's next
request, or within 2 ms when it stays idle (``connect(..., deferred_release=False)``: at once,
as Plasma did; it costs a message and a wake-up of the store per get). The creator's reference
of an object whose buffers are gone by its seal (``seal``, ``put``...) is released at once.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import pickle
import shutil
import socket
import struct
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from . import _lease
from . import client as _vc
from . import daemon as _daemon
from . import errors as E
from ._args import byte_array
from ._copy import copy_into
from ._core import put_options
from ._lookup import find_lease
from ._sockets import recv_exactly
from ._native import Object as _NativeObject

if TYPE_CHECKING:
    import builtins
    import subprocess
    from collections.abc import Callable, Iterator
    from typing import TypeAlias

    # What a Plasma user names an object by: an ObjectID, or a str used as the vovp name.
    _Key: TypeAlias = "ObjectID | str"
    # A buffer handed out: pyarrow.Buffer when pyarrow is importable, else PlasmaBuffer.
    _Buffer: TypeAlias = Any
    # What holds a get's vovp reference: the native object, or a uint8 array over it (or over
    # the creator's buffer); see the module docstring.
    _Anchor: TypeAlias = Any
    # (entry, anchor) of an object in use.
    _Found: TypeAlias = tuple["_InUse", Any]
    _NDArrayU8: TypeAlias = np.ndarray[Any, np.dtype[np.uint8]]
else:
    _NDArrayU8 = np.ndarray


def _load_pyarrow() -> Any:
    if os.environ.get("VOVP_PLASMA_PYARROW", "1") == "0":
        return None
    try:
        import pyarrow  # noqa: PLC0415 (optional)
        return pyarrow
    except Exception:  # noqa: BLE001 (not installed, or broken, e.g. built for another numpy)
        return None


pa: Any = _load_pyarrow()

__all__ = [
    "ObjectID",
    "ObjectNotAvailable",
    "PlasmaBuffer",
    "PlasmaClient",
    "connect",
    "start_plasma_store",
    "ArrowException",
    "ArrowInvalid",
    "PlasmaObjectExists",
    "PlasmaObjectNotFound",
    "PlasmaStoreFull",
    "PlasmaObjectAlreadySealed",
    "PlasmaConnectionError",
]

# --- errors ------------------------------------------------------------------------------------

# (mypy reads the classes below: pyarrow's derive from the same builtins.)
if not TYPE_CHECKING and pa is not None:
    ArrowException = pa.lib.ArrowException
    ArrowInvalid = pa.lib.ArrowInvalid
    ArrowTypeError = pa.lib.ArrowTypeError
else:
    class ArrowException(Exception):
        """Base of every error of this module (pyarrow's class when pyarrow is importable)."""

    class ArrowInvalid(ValueError, ArrowException):
        """Invalid use of the API (pyarrow's ``ArrowInvalid`` when pyarrow is importable)."""

    class ArrowTypeError(TypeError, ArrowException):
        """pyarrow's ``ArrowTypeError`` when pyarrow is importable."""


class PlasmaObjectExists(ArrowException, E.ObjectExists):
    """create/put of an id that is already in the store."""


class PlasmaObjectNotFound(ArrowException, E.ObjectNotFound):
    """The object is not in the store (or, for seal/abort, not held by this client)."""

    __str__ = E.VovpError.__str__


class PlasmaStoreFull(ArrowException, E.OutOfMemory):
    """No room for the object even after evicting every unreferenced object."""


class PlasmaObjectAlreadySealed(ArrowTypeError, E.AlreadySealed):
    """seal (or abort) of an object that is already sealed (Plasma: a TypeError status)."""


class PlasmaConnectionError(ArrowException, E.ConnectionError):
    """The store cannot be reached, or the connection broke (also an ``IOError``)."""


# vovp error class -> the class raised here. Classes not listed get a subclass made on first
# use that mixes ArrowException into the vovp class (so both kinds of ``except`` work).
_PLASMA_ERRORS: dict[type[E.VovpError], type[Any]] = {
    E.ObjectExists: PlasmaObjectExists,
    E.ObjectNotFound: PlasmaObjectNotFound,
    E.OutOfMemory: PlasmaStoreFull,
    E.AlreadySealed: PlasmaObjectAlreadySealed,
    E.ConnectionError: PlasmaConnectionError,
}


def _plasma_error(err: E.VovpError) -> Exception:
    cls: type[Any] | None = _PLASMA_ERRORS.get(type(err))
    if cls is None:
        cls = type("Plasma" + type(err).__name__, (ArrowException, type(err)),
                   {"__module__": __name__, "__doc__": type(err).__doc__})
        _PLASMA_ERRORS[type(err)] = cls
    new: Any = cls(err.message if err.message else str(err), err.status)
    if isinstance(err, E.OutOfMemory):
        new.requested, new.available = err.requested, err.available
    return cast(Exception, new)


@contextlib.contextmanager
def _translated() -> Iterator[None]:
    try:
        yield
    except E.VovpError as err:
        if isinstance(err, ArrowException):
            raise
        raise _plasma_error(err) from err


# --- ObjectID ----------------------------------------------------------------------------------

_ID_PREFIX = "plasma:"
_ID_SIZE = 20


class ObjectID:
    """A 20-byte Plasma object id; stored in vovp under the name ``plasma:<hex>``."""

    __slots__ = ("_binary", "_name", "__weakref__")

    def __init__(self, object_id: bytes) -> None:
        if type(object_id) is not bytes or len(object_id) != _ID_SIZE:
            raise ValueError(f"Object ID must by 20 bytes, is {object_id!r}")
        self._binary = object_id
        self._name = _ID_PREFIX + object_id.hex()

    def binary(self) -> bytes:
        """The 20 bytes of the id."""
        return self._binary

    def hex(self) -> str:
        return self._binary.hex()

    @property
    def name(self) -> str:
        """The vovp name of this object (``plasma:`` and 40 hex digits)."""
        return self._name

    @staticmethod
    def from_random() -> "ObjectID":
        """A random id (from ``os.urandom``, so never the same in two processes)."""
        return ObjectID(os.urandom(_ID_SIZE))

    def __eq__(self, other: object) -> bool:
        if type(other) is not ObjectID:
            return False
        return self._binary == other._binary

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(self._binary)

    def __repr__(self) -> str:
        return f"ObjectID({self._binary.hex()})"

    def __reduce__(self) -> tuple[type[ObjectID], tuple[bytes]]:
        return (ObjectID, (self._binary,))


class ObjectNotAvailable:
    """Returned by ``get`` (the class itself, as in Plasma) for an object that did not appear
    within the timeout."""


def _name_of(key: object) -> str:
    if type(key) is ObjectID:
        return key._name
    if isinstance(key, str):
        return key
    raise TypeError(f"object ids are plasma.ObjectID (or str names), not {type(key).__name__}")


def _key_of(name: str) -> _Key:
    """The key a Plasma user knows an object by: an ObjectID for ``plasma:<hex>``, else the
    name."""
    if len(name) == len(_ID_PREFIX) + 2 * _ID_SIZE and name.startswith(_ID_PREFIX):
        try:
            return ObjectID(bytes.fromhex(name[len(_ID_PREFIX):]))
        except ValueError:
            pass
    return name


# --- object header and pickled layout ------------------------------------------------------------

# vovp metadata of an object written by this module: magic, version, flags, reserved,
# data_size (the object's bytes after it are the Plasma metadata), creation time (unix ms).
_HEADER = struct.Struct("<4sBBHQq")
_MAGIC = b"VPLS"
_VERSION = 1
_FLAG_PICKLED = 0x1  # written by put(): the data is _PICKLE_HEAD + pickle + out-of-band buffers

# Data of a put() object: magic, number of out-of-band buffers, pickle length; then one u64
# length per buffer; the pickle; each buffer at a 64-byte aligned offset (the object's data
# starts 64-byte aligned, so arrays come back aligned).
_PICKLE_HEAD = struct.Struct("<4sIQ")
_PICKLE_MAGIC = b"VPK5"
_ALIGN = 64


# A Plasma put: no reference kept, the store's answer waited for (its id, or its error).
_WAITED_PUT = put_options(ephemeral=False, replace=False, keep_reference=False, pipelined=False)


def _header(data_size: int, metadata_size: int, pickled: bool, created_ms: int) -> bytes:
    """The vovp metadata of a Plasma object: the header, or nothing for an object whose
    bytes are all data and not put()'s layout (read back as a native object: all data, no
    metadata, which is what it is)."""
    if metadata_size == 0 and not pickled:
        return b""
    return _HEADER.pack(_MAGIC, _VERSION, _FLAG_PICKLED if pickled else 0, 0, data_size,
                        created_ms)


def _parse_header(meta: bytes, size: int) -> tuple[int, int | None, bool, bool]:
    """(data_size, created_ms or None, pickled, plasma?) of a stored object. An object that
    this module did not write is all data, with its vovp metadata as Plasma metadata."""
    if len(meta) == _HEADER.size and meta[:4] == _MAGIC:
        _, version, flags, _, data_size, created = _HEADER.unpack(meta)
        if version == _VERSION and data_size <= size:
            return data_size, created, bool(flags & _FLAG_PICKLED), True
    return size, None, False, False


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


# Seal times of objects sealed in this process, for list()'s construct_duration:
# (name, created_ms) -> sealed_ms. Bounded: the oldest entries go first.
_SEALED_AT: collections.OrderedDict[tuple[str, int | None], int] = collections.OrderedDict()
_SEALED_AT_MAX = 1 << 16


def _remember_seal(name: str, created_ms: int | None) -> None:
    _SEALED_AT[(name, created_ms)] = _now_ms()
    while len(_SEALED_AT) > _SEALED_AT_MAX:
        _SEALED_AT.popitem(last=False)


# Creation times of the headerless objects made in this process, for list():
# (name, vovp object id) -> created_ms (the id tells a later object of the same name apart).
_CREATED_AT: collections.OrderedDict[tuple[str, int], int] = collections.OrderedDict()


def _remember_creation(name: str, header: bytes, holder: object, created_ms: int,
                       object_id: int | None = None) -> None:
    if header:
        return  # the header has it
    if object_id is None:
        lease = find_lease(holder)
        if lease is None:
            return
        object_id = lease.oid
    _CREATED_AT[(name, object_id)] = created_ms
    while len(_CREATED_AT) > _SEALED_AT_MAX:
        _CREATED_AT.popitem(last=False)


# --- buffers -------------------------------------------------------------------------------------


class PlasmaBuffer(_NDArrayU8):
    """Buffer handed out when pyarrow is not importable: a 1-D uint8 array over the store's
    memory (read-only unless returned by ``create``) with pyarrow.Buffer's common methods.
    With pyarrow importable, buffers are ``pyarrow.Buffer`` objects instead."""

    def to_pybytes(self) -> bytes:
        return self.tobytes()

    @property
    def is_mutable(self) -> bool:
        return bool(self.flags.writeable)

    @property
    def address(self) -> int:
        address: int = self.__array_interface__["data"][0]
        return address

    def equals(self, other: Any) -> bool:
        return self.tobytes() == memoryview(other).cast("B").tobytes()

    def slice(self, offset: int = 0, length: int | None = None) -> _NDArrayU8:
        end = len(self) if length is None else offset + length
        return self[offset:end]


_wrap: Callable[[_NDArrayU8], _Buffer]
_foreign: Any  # pyarrow.foreign_buffer, or None
if pa is not None:
    if not TYPE_CHECKING:  # (mypy reads the class above)
        PlasmaBuffer = pa.Buffer  # noqa: F811 (what create/get return when pyarrow is there)

    _wrap = pa.py_buffer  # (no Python function in between: it is on every get's path)
    # A pyarrow.Buffer over (address, size) whose base (kept alive by it) is the native object.
    _foreign = pa.foreign_buffer
else:
    def _wrap(view: _NDArrayU8) -> _Buffer:
        return view.view(PlasmaBuffer)

    _foreign = None

# The native core's sealed-object view (vovp._native.Object): with pyarrow, a get's anchor is
# the native object itself and its buffers are pyarrow.Buffers made with foreign_buffer, which
# skips numpy's array (np.asarray of the object cost a fifth of a get). Everything else an
# anchor serves (metadata, hash, unpickling) takes an array over it made when needed.


def _as_array(anchor: _Anchor) -> Any:
    """A uint8 array over an anchor's bytes (object + metadata)."""
    # (Any: to mypy, numpy's arrays are buffers, as hashlib and struct take, on Python >= 3.12
    # only.)
    return np.asarray(anchor) if type(anchor) is _NativeObject else anchor


def _data_buffer(entry: _InUse, anchor: _Anchor) -> _Buffer:
    """The buffer handed out for an object's data (``get_buffers``)."""
    ds = entry.data_size
    if type(anchor) is _NativeObject:
        return _foreign(anchor.address, ds, anchor)
    return _wrap(anchor if ds == len(anchor) else anchor[:ds])


def _metadata_buffer(entry: _InUse, anchor: _Anchor) -> _Buffer:
    """The buffer handed out for an object's Plasma metadata (``get_metadata``)."""
    if entry.foreign_meta is not None:
        return _wrap(np.frombuffer(entry.foreign_meta, np.uint8))
    ds = entry.data_size
    if type(anchor) is _NativeObject:
        return _foreign(anchor.address + ds, anchor.size - ds, anchor)
    return _wrap(anchor[ds:])


class _InUse(_lease.Lease):
    """An object this client uses (Plasma's client-side entry): a weak reference to the
    object's anchor, with what is known of the object. It is the reference's lease too (one
    record per reference), indexed only when an address lookup needs it (``_find_anchor``).
    Made by ``_entry`` with weakref.ref's own constructor and no callback (see the module
    docstring)."""

    __slots__ = ("holder", "sealed", "writable", "data_size", "created_ms", "pickled",
                 "foreign_meta")

    holder: Any  # the creator's owner array (create to seal), else None
    sealed: bool
    writable: bool
    data_size: int
    created_ms: int | None
    pickled: bool
    foreign_meta: bytes | None

    def live(self) -> bool:
        """Whether this client still uses the object (a buffer lives and its reference was
        not given back early, or it is being created)."""
        if self.holder is not None:
            return True
        anchor = self()
        return anchor is not None and not _released(anchor)


def _released(anchor: _Anchor) -> bool:
    """Whether the reference an anchor holds was given back before the anchor died
    (``vovp.Client.release`` of a view finds it by address): its bytes are no longer this
    client's, so the object must be asked of the store again."""
    x = anchor
    # Down the .base chain to the native object: at most anchor array, memoryview, owner array,
    # (object, capsule), object.
    for _ in range(6):
        if type(x) is _NativeObject:
            return x.released
        if type(x) is tuple:
            x = x[0]  # (numpy >= 1.23 keeps the __array_struct__ capsule beside the object)
        elif isinstance(x, memoryview):
            x = x.obj
        elif isinstance(x, np.ndarray):
            x = x.base
        else:
            return False  # a created object's (its creator's buffer): never released early
    return False


def _entry(anchor: _Anchor, name: str, sealed: bool, data_size: int, created_ms: int | None,
           pickled: bool, foreign_meta: bytes | None = None) -> _InUse:
    e = _InUse(anchor)
    e.name = name
    e.holder = None  # the creator's owner array, from create to seal
    e.sealed = sealed
    e.writable = False  # the anchor is create()'s writable one
    e.data_size = data_size
    e.created_ms = created_ms
    e.pickled = pickled
    e.foreign_meta = foreign_meta  # vovp metadata of an object this module did not write
    return e


def _read_only(anchor: _NDArrayU8) -> _NDArrayU8:
    """A read-only view of a writable anchor (a get of an object this client created)."""
    view = anchor.view()
    view.flags.writeable = False
    return view


# The entry table is swept of dead entries when it reaches twice its size after the last sweep
# (and at least this many entries).
_SWEEP_MIN = 1024


# --- the client ----------------------------------------------------------------------------------


# Every PlasmaClient of this process, for _find_anchor.
_CLIENTS: weakref.WeakSet[PlasmaClient] = weakref.WeakSet()


def _find_anchor(addr: int, cuda: bool) -> _lease.Lease | None:
    """The entry of the anchor of a get that holds ``addr``, indexed now as its lease (the
    lease index's finder: gets here do not index their entries); None if no anchor does."""
    if cuda:
        return None
    native: Any  # the native object, or what an array's base is
    for client in list(_CLIENTS):
        if client._closed or client._vovp.closed:
            continue  # (the connection's end released everything)
        for entry in list(client._in_use.values()):
            anchor = entry()
            if type(anchor) is _NativeObject:
                start, size, native = anchor.address, anchor.size, anchor
            elif isinstance(anchor, np.ndarray):
                start, size = anchor.__array_interface__["data"][0], anchor.nbytes
                # (numpy >= 1.23 keeps the __array_struct__ capsule beside the object in .base,
                # which numpy's annotations do not say.)
                base: Any = anchor.base
                native = base[0] if type(base) is tuple else base
            else:
                continue
            if not (start <= addr < start + size or addr == start):
                continue
            if _lease.lease_of(anchor) is not None:
                return None  # leased already (and released: the lease index skipped it)
            if not isinstance(native, _NativeObject):
                continue  # (leased anchors were found by the lease index already)
            return _lease.lease(anchor, client._vovp.core, native, entry=entry)
    return None


_lease.register_finder(_find_anchor)


class PlasmaClient:
    """A connection to the store with Plasma's client semantics (made by ``connect``)."""

    def __init__(self, store_socket_name: str, deferred_release: bool = True,
                 lend_puts: bool = True):
        # Plasma told the store of a release at once; vovp's own client lets releases ride
        # with its next request (or sends them within 2 ms), which saves a message per get.
        delay = _vc.RELEASE_DELAY if deferred_release else 0
        with _translated():
            self._vovp = _vc.Client(store_socket_name, release_delay=delay, lend_puts=lend_puts)
        self._core = self._vovp.core  # its connection: the single get, owners
        self._lend_limit = _vc.LEND_LIMIT if lend_puts else 0
        self._path = store_socket_name
        self._lock = threading.Lock()
        self._in_use: dict[str, _InUse] = {}  # vovp name -> _InUse (live or dead, see _insert)
        self._sweep_at = _SWEEP_MIN
        self._relay: _NotificationRelay | None = None  # notification relay, after subscribe()
        # Notification stream of evict(), after the first one.
        self._evict_watch: _NotifyStream | None = None
        self._closed = False
        # Objects up to this size are put in one PUT frame (data assembled here first).
        self._inline = min(self._vovp.max_inline, _vc.INLINE_LIMIT)
        _CLIENTS.add(self)

    # -- locking and entries ----------------------------------------------------------------

    def _acquire(self) -> None:
        self._lock.acquire()
        if self._closed:
            self._lock.release()
            raise PlasmaConnectionError("this PlasmaClient is disconnected")

    def _live(self, name: str) -> _InUse | None:
        """The live entry of ``name``, or None."""
        entry = self._in_use.get(name)
        return entry if entry is not None and entry.live() else None

    def _unsealed(self, name: str, not_ours: str, sealed: str, object_id: _Key) -> _InUse:
        """The live entry of ``name``, an object this client created and has not sealed:
        else PlasmaObjectNotFound (``not_ours``) or PlasmaObjectAlreadySealed (``sealed``), as
        Plasma's seal and abort raise them. The caller holds the lock."""
        entry = self._live(name)
        if entry is None:
            raise PlasmaObjectNotFound(f"{not_ours}: {object_id!r}", 1)
        if entry.sealed:
            raise PlasmaObjectAlreadySealed(f"{sealed}: {object_id!r}", 5)
        return entry

    def _insert(self, entry: _InUse) -> None:
        in_use = self._in_use
        in_use[entry.name] = entry  # (replacing a dead entry, if any)
        if len(in_use) >= self._sweep_at:
            self._sweep()

    def _sweep(self) -> None:
        """Drop the dead entries; the next sweep is when the table has doubled."""
        in_use = self._in_use
        # Entries whose anchor died (not e.live(), which also asks whether a live anchor's
        # reference was released early: such an entry is replaced by the next get, and this
        # test runs for an entry per get made since the last sweep).
        for name in [n for n, e in in_use.items() if e.holder is None and e() is None]:
            del in_use[name]
        self._sweep_at = max(_SWEEP_MIN, 2 * len(in_use))

    # -- properties -----------------------------------------------------------------------------

    @property
    def store_socket_name(self) -> str:
        return self._path

    def store_capacity(self) -> int:
        """The store's memory for objects, in bytes (vovp-engine's ``-m``)."""
        return self._vovp.capacity

    # -- create / seal / abort ----------------------------------------------------------------

    def create(self, object_id: _Key, data_size: int, metadata: bytes = b"") -> _Buffer:
        """Create an object of ``data_size`` bytes (plus ``metadata``) and return a writable
        buffer over its data; ``seal`` makes it immutable and visible.

        PlasmaObjectExists if the id is taken; PlasmaStoreFull if it does not fit even after
        evicting every unreferenced object.
        """
        name = _name_of(object_id)
        data_size = int(data_size)
        if data_size < 0:
            raise ValueError(f"data_size must be >= 0, got {data_size}")
        metadata = bytes(metadata)
        created = _now_ms()
        self._acquire()
        try:
            if self._live(name) is not None:
                raise PlasmaObjectExists(f"object {object_id!r} already exists")
            header = _header(data_size, len(metadata), False, created)
            with _translated():
                # (Any: see _as_array.)
                owner: Any = self._vovp.create(name, data_size + len(metadata), header)
            _remember_creation(name, header, owner, created)
            if metadata:
                owner[data_size:] = np.frombuffer(metadata, np.uint8)
            anchor = np.frombuffer(memoryview(owner), np.uint8)
            entry = _entry(anchor, name, False, data_size, created, False)
            entry.holder = owner  # the count seal gives back
            entry.writable = True
            self._insert(entry)
        finally:
            self._lock.release()
        return _wrap(anchor[:data_size] if metadata else anchor)

    def seal(self, object_id: _Key) -> None:
        """Seal an object this client created: immutable and visible to every client."""
        name = _name_of(object_id)
        self._acquire()
        try:
            entry = self._unsealed(name, "Seal() called on an object without a reference to it",
                                   "Seal() called on an already sealed object", object_id)
            with _translated():
                self._vovp.seal(name)
            entry.sealed = True
            _remember_seal(name, entry.created_ms)
            entry.holder = None  # a create buffer still alive keeps the reference
            if entry() is None:
                # That was the last count: the creator's reference goes now, not with the next
                # request (deferred releases are for gets), so that a new object is evictable
                # for others once its seal returned, as in Plasma.
                self._vovp.flush()
        finally:
            self._lock.release()

    def abort(self, object_id: _Key) -> None:
        """Abort an unsealed object this client created; its buffer must have been dropped."""
        name = _name_of(object_id)
        self._acquire()
        try:
            entry = self._unsealed(name, "abort of an object this client is not creating",
                                   "abort of a sealed object", object_id)
            if entry() is not None:
                raise ArrowInvalid("Plasma client cannot have a reference to the buffer.")
            with _translated():
                self._vovp.abort(name)
            del self._in_use[name]
            entry.holder = None  # vovp's abort already dropped the creator's reference
        finally:
            self._lock.release()

    # -- get ------------------------------------------------------------------------------------

    def _in_use_anchor(self, entry: _InUse, timeout_ms: int) -> _Found | None:
        """(entry, anchor) of an object in use here (``entry``); None if the store must be
        asked (no buffer left, or ours and not sealed yet). The caller holds the lock."""
        name = entry.name
        if entry.sealed:
            anchor = entry()
            if anchor is None or _released(anchor):
                return None  # dead: asked again, a new entry replaces it
            return entry, (_read_only(anchor) if entry.writable else anchor)
        if timeout_ms < 0:
            # Plasma aborts the process here: nobody else can seal it, so the get would never
            # return.
            raise ArrowInvalid(
                f"get with timeout_ms=-1 of {_key_of(name)!r}, which this client created and "
                "has not sealed, would never return; seal it first")
        return None  # the store waits the timeout for it, as Plasma's does

    def _ask(self, names: list[str], timeout_ms: int
             ) -> list[tuple[memoryview, bytes] | None]:
        """The store's replies for ``names`` (GET, waiting as ``timeout_ms`` says)."""
        timeout = None if timeout_ms == 0 else (-1 if timeout_ms < 0 else timeout_ms / 1000)
        try:
            return self._vovp.get_buffers(names, timeout)
        except E.VovpError as err:
            raise _plasma_error(err) from err

    def _new_entry(self, name: str, found: tuple[memoryview, bytes]) -> _Found:
        """(entry, anchor) of an object the store just gave us: ``found`` = (memoryview
        holding the vovp reference, vovp metadata)."""
        mv, meta = found
        return self._entry_of(name, np.frombuffer(mv, np.uint8), mv.nbytes, meta)

    def _entry_of(self, name: str, anchor: _Anchor, size: int, meta: bytes) -> _Found:
        """(entry, anchor) for ``anchor`` (a uint8 array, or the native object, that holds
        the vovp reference) of ``size`` bytes."""
        if meta:
            data_size, created, pickled, ours = _parse_header(meta, size)
        else:  # no header (and no metadata): all data
            data_size, created, pickled, ours = size, None, False, False
        entry = _entry(anchor, name, True, data_size, created, pickled, None if ours else meta)
        # self._insert(entry), written out (every get's path).
        in_use = self._in_use
        in_use[name] = entry
        if len(in_use) >= self._sweep_at:
            self._sweep()
        return entry, anchor

    def _fetch1(self, name: str, timeout_ms: int, data: bool = False) -> Any:
        """(entry, anchor) for one name, or with ``data=True`` the buffer ``get_buffers``
        hands out for its data; None when not available. See ``_fetch``. (Every get's path:
        written out rather than through _fetch's lists, and the buffer made here, not by the
        caller from a tuple: each Python call there was 2-3% of a get.)"""
        lock = self._lock
        lock.acquire()
        try:
            if self._closed:
                raise PlasmaConnectionError("this PlasmaClient is disconnected")
            entry = self._in_use.get(name)
            # (A sealed entry whose anchor died is left for the store, without a call.)
            if entry is not None and (not entry.sealed or entry() is not None):
                got = self._in_use_anchor(entry, timeout_ms)
                if got is not None:
                    return _data_buffer(*got) if data else got
            timeout = None if timeout_ms == 0 else (3.15e9 if timeout_ms < 0 else timeout_ms / 1000)
            core = self._core
            try:
                # vovp.Client's single get, without its memoryview and lease: the anchor is
                # the native object (or, without pyarrow, numpy's array over it), which holds
                # the reference (and keeps its connection open while it lives, also past this
                # client). Indexing the entry as a lease (for vovp.Client.release and
                # find_lease) cost a quarter of a get: _find_anchor does when an address is
                # looked up.
                obj = core.get1(name, timeout, False, True)
                if obj is None:
                    return None
                fields = obj.host_fields
                if fields is None:
                    core.owner(obj)  # (raises GpuUnavailable, releasing the reference)
                address, size, meta = fields
                anchor = obj if _foreign is not None else np.asarray(obj)
                entry, _ = self._entry_of(name, anchor, size, meta)
            except E.VovpError as err:
                raise _plasma_error(err) from err
            if not data:
                return entry, anchor
            if _foreign is not None:  # (_data_buffer's case, with the address read above)
                return _foreign(address, entry.data_size, obj)
            return _data_buffer(entry, anchor)
        finally:
            lock.release()

    def _fetch(self, names: list[str], timeout_ms: int) -> list[_Found | None]:
        """[(entry, anchor) or None (not available)] for ``names``, in order. Objects in use
        are served from their anchors, the others asked of the store in one GET (each gets an
        entry and an anchor)."""
        self._acquire()
        try:
            got: dict[str, _Found | None] = {}  # name -> (entry, anchor)
            ask = []
            in_use = self._in_use
            for name in names:
                if name not in got:
                    entry = in_use.get(name)
                    found = None if entry is None else self._in_use_anchor(entry, timeout_ms)
                    got[name] = found
                    if found is None:
                        ask.append(name)
            if ask:
                for name, reply in zip(ask, self._ask(ask, timeout_ms)):
                    if reply is not None:
                        got[name] = self._new_entry(name, reply)
            return [got[name] for name in names]
        finally:
            self._lock.release()

    def _anchors_for(self, object_ids: Sequence[_Key], timeout_ms: int
                     ) -> list[_Found | None]:
        """[(entry, anchor) or None] for ``object_ids``."""
        timeout_ms = int(timeout_ms)
        if type(object_ids) is list and len(object_ids) == 1:
            return [self._fetch1(_name_of(object_ids[0]), timeout_ms)]
        return self._fetch([_name_of(k) for k in object_ids], timeout_ms)

    def get_buffers(self, object_ids: Sequence[_Key], timeout_ms: int = -1,
                    with_meta: bool = False) -> list[Any]:
        """Buffers of the objects' data (None for an object not sealed within ``timeout_ms``:
        -1 waits forever, 0 not at all); waits until all are there or the time is up. With
        ``with_meta=True``, ``(metadata bytes, data buffer)`` tuples. Each buffer keeps its
        object alive and releases it when it (and everything made from it) is dropped."""
        if type(object_ids) is list and len(object_ids) == 1 and not with_meta:
            # The common case, without the lists: one get.
            key = object_ids[0]
            return [self._fetch1(key._name if type(key) is ObjectID else _name_of(key),
                                 int(timeout_ms), True)]
        out: list[Any] = []
        for found in self._anchors_for(object_ids, timeout_ms):
            if found is None:
                out.append((None, None) if with_meta else None)
                continue
            entry, anchor = found
            data = _data_buffer(entry, anchor)
            if with_meta:
                meta = entry.foreign_meta if entry.foreign_meta is not None else \
                    _as_array(anchor)[entry.data_size:].tobytes()
                out.append((meta, data))
            else:
                out.append(data)
        return out

    def get_metadata(self, object_ids: Sequence[_Key], timeout_ms: int = -1
                     ) -> list[_Buffer | None]:
        """Buffers of the objects' metadata (None when not available); like get_buffers."""
        out: list[_Buffer | None] = []
        for found in self._anchors_for(object_ids, timeout_ms):
            if found is None:
                out.append(None)
                continue
            out.append(_metadata_buffer(*found))
        return out

    def contains(self, object_id: _Key) -> bool:
        """Whether the object is sealed in the store (or in use by this client)."""
        name = _name_of(object_id)
        if self._live(name) is not None:
            return True
        with _translated():
            return self._vovp.contains(name)

    def hash(self, object_id: _Key) -> bytes:
        """8-byte digest of the object's data and metadata (BLAKE2b; Plasma used XXH64, so the
        values differ from Plasma's but equal objects still hash equal)."""
        [found] = self._anchors_for([object_id], 0)
        if found is None:
            raise PlasmaObjectNotFound(f"object {object_id!r} is not in the store", 1)
        entry, anchor = found
        h = hashlib.blake2b(digest_size=8)
        h.update(struct.pack("<Q", entry.data_size))
        h.update(_as_array(anchor))
        if entry.foreign_meta is not None:
            h.update(entry.foreign_meta)
        return h.digest()

    # -- put / get of Python objects and raw buffers -----------------------------------------------

    def _store(self, object_id: _Key, data_size: int, pieces: Sequence[tuple[int, Any]],
               metadata: bytes, pickled: bool) -> None:
        """Create, fill (``pieces``: (offset, bytes-like)) and seal an object; holds nothing."""
        name = _name_of(object_id)
        created = _now_ms()
        header = _header(data_size, len(metadata), pickled, created)
        total = data_size + len(metadata)
        self._acquire()
        try:
            if self._live(name) is not None:
                raise PlasmaObjectExists(f"object {object_id!r} already exists")
            try:
                one_piece = len(pieces) == 1 and not metadata
                if total <= self._inline or (one_piece and total <= self._lend_limit):
                    # One PUT frame: assembling a few hundred KiB costs less than a round trip.
                    # One piece up to a lend's largest object: the native put copies it into
                    # this client's lend and sends one PUBLISH (no CREATE round trip).
                    if one_piece:
                        blob = pieces[0][1]  # (put_raw_buffer, create_and_seal: no copy here)
                    else:
                        blob = bytearray(total)
                        for off, piece in pieces:
                            n = memoryview(piece).nbytes
                            blob[off:off + n] = piece
                        blob[data_size:] = metadata
                    # Waited for: Plasma raises PlasmaStoreFull / PlasmaObjectExists from the
                    # put itself; a pipelined put would report them only at sync().
                    oid = self._core.put(name, byte_array(blob), _WAITED_PUT, header)
                    _remember_creation(name, header, None, created, oid)
                else:
                    owner = self._vovp.create(name, total, header)
                    _remember_creation(name, header, owner, created)
                    try:
                        for off, piece in pieces:
                            src = np.frombuffer(piece, np.uint8)
                            copy_into(owner[off:off + src.size], src)
                        if metadata:
                            owner[data_size:] = np.frombuffer(metadata, np.uint8)
                        self._vovp.seal(name)
                    except BaseException:
                        with contextlib.suppress(E.VovpError):
                            self._vovp.abort(name)
                        raise
                    del owner  # releases the creator's reference (sealed: the object stays)
                    self._vovp.flush()  # now: see seal()
            except E.VovpError as err:  # (not _translated(): a context manager costs a µs)
                if isinstance(err, ArrowException):
                    raise
                raise _plasma_error(err) from err
            _remember_seal(name, created)
        finally:
            self._lock.release()

    def put_raw_buffer(self, value: Any, object_id: _Key | None = None, metadata: bytes = b"",
                       memcopy_threads: int = 6) -> _Key:
        """Store the bytes of any buffer-protocol object; returns its ObjectID."""
        target = object_id if object_id is not None else ObjectID.from_random()
        mv = memoryview(value)
        if not mv.c_contiguous:
            mv = memoryview(mv.tobytes())
        if mv.ndim != 1 or mv.format != "B":
            mv = mv.cast("B")
        self._store(target, mv.nbytes, [(0, mv)], bytes(metadata), pickled=False)
        return target

    def create_and_seal(self, object_id: _Key, data: Any, metadata: bytes = b"") -> None:
        """Store ``data`` (bytes) with ``metadata`` in one step; this client holds nothing."""
        mv = memoryview(data).cast("B") if not isinstance(data, bytes) else data
        self._store(object_id, len(mv), [(0, mv)], bytes(metadata), pickled=False)

    def put(self, value: Any, object_id: _Key | None = None, memcopy_threads: int = 6,
            serialization_context: object = None) -> _Key:
        """Store any picklable Python object; returns its ObjectID.

        Pickle protocol 5 with out-of-band buffers: numpy arrays (and other objects that
        export PickleBuffers) are copied once into the store and come back from ``get`` as
        read-only views of it. ``serialization_context`` (Arrow's deprecated serialization) is
        not supported: register reducers with ``copyreg`` instead.
        """
        if serialization_context is not None:
            raise NotImplementedError(
                "serialization_context (Arrow's deprecated pa.serialize) is not supported by "
                "vovp.plasma, which pickles (protocol 5); use copyreg / __reduce__ instead")
        target = object_id if object_id is not None else ObjectID.from_random()
        buffers: list[pickle.PickleBuffer] = []
        payload = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
        raws = []
        for b in buffers:
            try:
                raws.append(b.raw())
            except BufferError:  # a non-contiguous buffer: store a contiguous copy
                raws.append(memoryview(memoryview(b).tobytes()))
        head = _PICKLE_HEAD.pack(_PICKLE_MAGIC, len(raws), len(payload)) + \
            struct.pack(f"<{len(raws)}Q", *(r.nbytes for r in raws))
        pieces: list[tuple[int, bytes | memoryview]] = [(0, head), (len(head), payload)]
        end = len(head) + len(payload)
        for r in raws:
            end = -(-end // _ALIGN) * _ALIGN
            pieces.append((end, r))
            end += r.nbytes
        self._store(target, end, pieces, b"", pickled=True)
        return target

    def get(self, object_ids: _Key | Sequence[_Key], timeout_ms: int = -1,
            serialization_context: object = None) -> Any:
        """The value(s) ``put`` stored: a list for a list of ids, one value for one id.
        ``ObjectNotAvailable`` for an object not sealed within ``timeout_ms``."""
        if serialization_context is not None:
            raise NotImplementedError(
                "serialization_context (Arrow's deprecated pa.serialize) is not supported by "
                "vovp.plasma, which pickles (protocol 5)")
        single = isinstance(object_ids, (ObjectID, str)) or not isinstance(object_ids, Sequence)
        ids: list[Any] = [object_ids] if single else list(cast("Sequence[_Key]", object_ids))
        results = []
        # Unpickled outside the client's lock: reducers may run arbitrary code (even call back
        # into this client).
        for key, found in zip(ids, self._anchors_for(ids, timeout_ms)):
            if found is None:
                results.append(ObjectNotAvailable)
            else:
                results.append(_unpickle(key, *found))
        return results[0] if single else results

    # -- delete / list / evict --------------------------------------------------------------------

    def delete(self, object_ids: Sequence[_Key]) -> None:
        """Delete the objects: their ids disappear from the store now (buffers already handed
        out stay valid; the memory is freed when the last one is dropped). Ids that are not
        in the store (or not sealed) are ignored, as in Plasma."""
        names = [_name_of(k) for k in object_ids]
        for name in names:
            try:
                self._vovp.delete(name)
            except (E.ObjectNotFound, E.NotSealed):
                pass
            except E.VovpError as err:
                raise _plasma_error(err) from err

    def list(self) -> dict[_Key, dict[str, Any]]:
        """Every Plasma object in the store: {ObjectID (or str name): info}, info having
        data_size, metadata_size, ref_count (holders), state ("created"/"sealed"),
        create_time (unix seconds) and construct_duration (seconds; -1 while unsealed)."""
        with _translated():
            entries = self._vovp.list()
        out: dict[_Key, dict[str, Any]] = {}
        for e in entries:
            name = e["name"]
            data_size, created, _, ours = _parse_header(e["metadata"], e["size"])
            key = _key_of(name)
            if not ours and isinstance(key, str):
                continue  # a native vovp object: not a Plasma object
            if ours:
                metadata_size = e["size"] - data_size
            else:
                metadata_size = len(e["metadata"])
            last_access_ms = int(e["last_access"] * 1000)
            if created is None:
                created = _CREATED_AT.get((name, e["id"]), last_access_ms)
            if not e["sealed"]:
                duration = -1
            else:
                sealed = _SEALED_AT.get((name, created))
                # Sealed elsewhere: the daemon's last access is the seal or a later get, so
                # this is an upper bound.
                duration = round(((sealed if sealed is not None else last_access_ms)
                                  - created) / 1000)
                duration = max(duration, 0)
            out[key] = {
                "data_size": data_size,
                "metadata_size": metadata_size,
                "ref_count": e["refcount"],
                "create_time": created // 1000,
                "construct_duration": duration,
                "state": "sealed" if e["sealed"] else "created",
            }
        return out

    def evict(self, num_bytes: int) -> int:
        """Evict unreferenced sealed objects, least recently used first, until at least
        ``num_bytes`` (counting data + metadata, as Plasma does) are freed or none is left;
        returns the bytes freed.

        The daemon's EVICT counts its allocator's rounded-up blocks, so this asks it for one
        byte at a time (that evicts exactly one object: every object holds at least one
        block) and reads each evicted object's size from a notification stream of its own,
        opened at the first evict and kept. If other clients evict at the same moment, their
        objects may be counted instead of ours (the total is then approximate).
        """
        num_bytes = int(num_bytes)
        if num_bytes <= 0:
            return 0
        self._acquire()
        try:
            with _translated():
                # A fresh stream per call: one kept between calls falls behind in a busy store
                # (the daemon drops streams 4096 notifications behind), and telling a dropped
                # stream from a quiet one is a race. A new SUBSCRIBE costs one connection.
                if self._evict_watch is not None:
                    self._evict_watch.close()
                watch = self._evict_watch = _NotifyStream(self._vovp)
                total = 0
                while total < num_bytes:
                    freed = self._vovp.evict(1)
                    if freed == 0:
                        break
                    size = watch.next_evicted(timeout=5.0)
                    if size is None:  # no notification: count the daemon's bytes instead
                        total += freed
                        watch.close()
                        watch = self._evict_watch = _NotifyStream(self._vovp)
                    else:
                        total += size
        finally:
            self._lock.release()
        return total

    # -- notifications --------------------------------------------------------------------------

    def subscribe(self) -> None:
        """Receive a notification for every object sealed (and deleted or evicted) from now
        on, plus one for each object already sealed; read them with get_next_notification or
        from get_notification_socket()."""
        self._acquire()
        try:
            if self._relay is None:
                with _translated():
                    self._relay = _NotificationRelay(self._vovp)
        finally:
            self._lock.release()

    def get_notification_socket(self) -> socket.socket:
        """The socket notifications arrive on: each is an 8-byte native ``unsigned long``
        length and that many bytes for ``decode_notifications``."""
        return self._subscribed().user

    def get_next_notification(self) -> tuple[_Key, int, int]:
        """(ObjectID, data_size, metadata_size) of the next notification, waiting for it;
        sizes are -1 for an object that was deleted or evicted."""
        sock = self._subscribed().user
        (length,) = _LENGTH.unpack(recv_exactly(sock, _LENGTH.size, _stream_ended))
        ids, data_sizes, metadata_sizes = self.decode_notifications(
            recv_exactly(sock, length, _stream_ended))
        return ids[0], data_sizes[0], metadata_sizes[0]

    @staticmethod
    def decode_notifications(buf: Any) -> tuple[builtins.list[_Key], builtins.list[int],
                                                builtins.list[int]]:
        """([keys], [data sizes], [metadata sizes]) of one notification message."""
        buf = bytes(buf)
        try:
            (n,) = struct.unpack_from("<I", buf, 0)
            pos = 4
            keys: builtins.list[_Key] = []
            data_sizes: builtins.list[int] = []
            metadata_sizes: builtins.list[int] = []
            for _ in range(n):
                (length,) = struct.unpack_from("<H", buf, pos)
                pos += 2
                keys.append(_key_of(buf[pos:pos + length].decode()))
                pos += length
                ds, ms = struct.unpack_from("<qq", buf, pos)
                pos += 16
                data_sizes.append(ds)
                metadata_sizes.append(ms)
        except (struct.error, UnicodeDecodeError) as e:
            raise ArrowInvalid(f"not a vovp.plasma notification message: {e}") from None
        return keys, data_sizes, metadata_sizes

    def _subscribed(self) -> _NotificationRelay:
        if self._relay is None:
            raise ArrowInvalid("call subscribe() before reading notifications")
        return self._relay

    # -- connection -----------------------------------------------------------------------------

    def disconnect(self) -> None:
        """Close the connection: the store releases everything this client held (buffers
        from it must not be used afterwards)."""
        if self._closed:
            return
        self._closed = True
        # First the connections (this also wakes a thread waiting in a get), then the state.
        if self._relay is not None:
            self._relay.close()
        if self._evict_watch is not None:
            self._evict_watch.close()
        self._vovp.close()
        with self._lock:
            self._in_use.clear()

    def set_client_options(self, client_name: str, limit_output_memory: int) -> None:
        raise NotImplementedError("vovp has no per-client output memory quota")

    def debug_string(self) -> str:
        with _translated():
            return "\n".join(f"{k}: {v}" for k, v in self._vovp.stats().items())

    def __repr__(self) -> str:
        return f"<vovp.plasma.PlasmaClient {self._path!r}>"


def _unpickle(key: _Key, entry: _InUse, anchor: _Anchor) -> Any:
    if not entry.pickled:
        raise ArrowInvalid(f"object {key!r} was not stored by put(); read it with get_buffers()")
    data = _as_array(anchor)[:entry.data_size]
    try:
        magic, nbuf, plen = _PICKLE_HEAD.unpack_from(data, 0)
        if magic != _PICKLE_MAGIC:
            raise ValueError("bad magic")
        pos = _PICKLE_HEAD.size
        sizes = struct.unpack_from(f"<{nbuf}Q", data, pos)
        pos += 8 * nbuf
        payload = data[pos:pos + plen]
        end = pos + plen
        buffers: list[_NDArrayU8] = []
        for size in sizes:
            end = -(-end // _ALIGN) * _ALIGN
            buffers.append(data[end:end + size])
            end += size
        if end > entry.data_size:
            raise ValueError("layout runs past the data")
    except (struct.error, ValueError) as e:
        raise ArrowInvalid(f"object {key!r} is not a valid put() object: {e}") from None
    return pickle.loads(payload, buffers=buffers)


# --- notifications -------------------------------------------------------------------------------

_LENGTH = struct.Struct("L")  # Plasma's notification length prefix: a native unsigned long


def _stream_ended() -> PlasmaConnectionError:
    return PlasmaConnectionError("the notification stream ended")


def _notification(name: str, data_size: int, metadata_size: int) -> bytes:
    nb = name.encode()
    body = struct.pack("<IH", 1, len(nb)) + nb + struct.pack("<qq", data_size, metadata_size)
    return _LENGTH.pack(len(body)) + body


def _plasma_notification(kind: str, name: str, size: int, meta: bytes) -> bytes | None:
    """The Plasma notification for a vovp one, or None for objects that are not Plasma's."""
    data_size, _, _, ours = _parse_header(meta, size)
    if not ours and isinstance(_key_of(name), str):
        return None
    if kind != "sealed":
        return _notification(name, -1, -1)
    if ours:
        return _notification(name, data_size, size - data_size)
    return _notification(name, size, len(meta))


class _NotifyStream:
    """A SUBSCRIBE connection to the daemon (the native core's, so no segment mappings and
    no threads of its own): cheap to keep."""

    def __init__(self, vovp_client: _vc.Client) -> None:
        self._sub = vovp_client.core.native.subscribe()

    def next(self, timeout: float | None = None) -> tuple[str, str, int, bytes] | None:
        """(kind, name, data_size, metadata) of the next notification; None on timeout or
        after close(). E.ConnectionError when the daemon ended the stream."""
        return self._sub.next(timeout)

    def drain(self) -> bool:
        """Discard what has arrived; False if the stream has ended.

        After a backlog it waits until the stream has been quiet for 5 ms, so that the
        daemon's queue for this stream is flushed (a queue left full would get the stream
        dropped at the next notification, the one evict() waits for).
        """
        quiet = 0.0
        try:
            while self.next(timeout=quiet) is not None:
                quiet = 0.005
        except (E.ConnectionError, OSError):
            return False
        return True

    def next_evicted(self, timeout: float) -> int | None:
        """Size of the next 'evicted' notification; None if none came within ``timeout``."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                event = self.next(max(0.0, deadline - time.monotonic()))
                if event is None:
                    return None
                if event[0] == "evicted":
                    return event[2]
        except (E.ConnectionError, OSError):
            return None

    def close(self) -> None:
        self._sub.close()  # a next() waiting in another thread returns None


class _NotificationRelay:
    """Turns the daemon's NOTIFY stream into Plasma's notification socket.

    Plasma hands out a socket that carries length-prefixed notifications (users select/poll
    on it); the daemon speaks its own frames. A reader thread converts them into a queue and
    a writer thread feeds the queue into one end of a socketpair; the user gets the other end.
    Two threads so that a user who does not read only stalls the writer: the reader keeps
    draining the daemon, which drops subscribers that fall 4096 notifications behind.
    """

    def __init__(self, vovp_client: _vc.Client) -> None:
        self.user, self._feed = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._queue: collections.deque[bytes] = collections.deque()
        self._cv = threading.Condition()
        self._ended = False
        self._sub = _NotifyStream(vovp_client)  # registered in the daemon once this returns
        # Plasma first reports every object sealed before the subscription (one sealed while
        # subscribe() runs may be reported twice).
        for e in vovp_client.list():
            if e["sealed"]:
                msg = _plasma_notification("sealed", e["name"], e["size"], e["metadata"])
                if msg is not None:
                    self._queue.append(msg)
        threading.Thread(target=self._read, name="vovp-plasma-notify-read", daemon=True).start()
        threading.Thread(target=self._write, name="vovp-plasma-notify-write",
                         daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                event = self._sub.next()
                if event is None:  # closed
                    return
                kind, name, size, meta = event
                msg = _plasma_notification(kind, name, size, meta)
                if msg is not None:
                    with self._cv:
                        self._queue.append(msg)
                        self._cv.notify()
        except Exception:  # noqa: BLE001 (connection closed under us)
            pass
        finally:
            with self._cv:
                self._ended = True
                self._cv.notify()

    def _write(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._queue and not self._ended:
                        self._cv.wait()
                    if not self._queue:
                        return
                    msg = self._queue.popleft()
                self._feed.sendall(msg)
        except OSError:
            pass
        finally:
            self._feed.close()  # the user's end then reads EOF

    def close(self) -> None:
        self._sub.close()
        with self._cv:
            self._ended = True
            self._queue.clear()
            self._cv.notify()
        self.user.close()


# --- connecting and starting a store ---------------------------------------------------------------


def connect(store_socket_name: str | os.PathLike[str], num_retries: int = -1,
            deferred_release: bool = True, lend_puts: bool = True) -> PlasmaClient:
    """Connect to the store serving ``store_socket_name``; tries ``num_retries`` times, 0.1 s
    apart (-1: 50 times, Plasma's default). PlasmaConnectionError (an IOError) if it cannot.

    ``deferred_release`` (not in Plasma): by default releases go the way vovp's own client
    sends them, with this client's next request or within 2 ms when it stays idle, which
    saves a message (and a wake-up of the store) per get; other clients may find a dropped
    object still referenced (not yet evictable) for those 2 ms. ``False`` sends each release
    at once, as Plasma did. ``lend_puts`` (not in Plasma; default on, ``False`` opts out): see
    ``vovp.Client``.
    """
    attempts = 50 if num_retries < 0 else max(1, int(num_retries))
    for attempt in range(attempts):
        try:
            return PlasmaClient(os.fspath(store_socket_name), deferred_release, lend_puts)
        except PlasmaConnectionError:
            if attempt + 1 == attempts:
                raise
            time.sleep(0.1)
    raise AssertionError("unreachable")


@contextlib.contextmanager
def start_plasma_store(plasma_store_memory: int, use_valgrind: bool = False,
                       use_profiler: bool = False, plasma_directory: str | None = None,
                       use_hugepages: bool = False, external_store: str | None = None,
                       ) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Start a vovp-engine with ``plasma_store_memory`` bytes; yields ``(socket_name, process)``
    and kills the daemon (if still running) on exit.

    ``plasma_directory`` is passed as ``-d`` (a hugetlbfs mount there means huge pages);
    ``use_hugepages`` as ``--huge-pages``; ``use_valgrind``/``use_profiler`` run the daemon
    under valgrind / callgrind as Plasma did. ``external_store`` (Plasma's ``-e``, e.g.
    ``"hashtable://test"``: evicted objects went there and came back on a miss) is vovp's
    spilling: objects go to files in a fresh temporary directory instead of being evicted, and
    a get reads them back; the URL itself is not used. The directory goes with the store.
    """
    if use_valgrind and use_profiler:
        raise ValueError("Cannot use valgrind and profiler at the same time.")
    # The daemon is started as vovp.start_store starts one (vovp/daemon.py): it dies with this
    # process even if it is killed, and the socket's directory goes with it.
    prefix: tuple[str, ...] = ()
    if use_valgrind:
        prefix = ("valgrind", "--track-origins=yes", "--leak-check=full", "--error-exitcode=1")
    elif use_profiler:
        prefix = ("valgrind", "--tool=callgrind")
    spill_dir = None
    if external_store is not None:
        spill_dir = tempfile.mkdtemp(prefix="vovp-plasma-spill-")
    options = {"directory": plasma_directory, "huge_pages": bool(use_hugepages),
               "spill_dir": spill_dir}
    try:
        store = _daemon.spawn(prefix, int(plasma_store_memory), None, False,
                              60 if use_valgrind or use_profiler else 10, options)
        try:
            yield store.socket, store.process
        finally:
            store.stop()
    finally:
        if spill_dir is not None:
            shutil.rmtree(spill_dir, ignore_errors=True)
