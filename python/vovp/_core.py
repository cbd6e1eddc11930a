"""The connection under the package's clients: ``ClientCore`` owns the native client
(``vovp._native.Client``, the Rust client) and the rules every call on it follows, written here
once and nowhere else:

- A connection is used only by the process that opened it, and only while it is open: a forked
  child must not talk on its parent's socket (ConnectionError; its references are never
  released from the child, as the parent's connection owns them). The check costs a compare of
  two ints per call (``vovp._lease.FORKS`` counts this process's forks), and reads the pid only
  when that count or ``closed`` says something changed.
- A call that fails with ConnectionError closes the connection unless it reconnects
  (``connection_lost``): the daemon is gone, or the stream cannot be resynchronised. Every
  reference it held is then claimed (the connection's end released them all).

On those rules, the calls the package's clients share: the single get (``get1``), the puts
(``put``, ``put_array``, ``put_tensor_host``, ``put_batch``: every one the native client's one
put, ``put_with``, or its batch, with a ``PutOptions`` from ``put_options``), objects this
connection creates (``create``, ``seal``, ``seal_later``, ``abort``) and the *owners* that index
references as leases (``owner``, ``cuda_owner``, ``drop_owner``; see ``vovp._lease``, whose
leases name the core that holds them). Every other native method is reached through
``native``, which checks first and closes the connection when the call loses it.

Used by ``vovp.client`` (``Client.core``), ``vovp._puts``, ``vovp._lookup``,
``vovp._client_cuda``, ``vovp.plasma`` and ``vovp.reduction``.
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any, Optional, Tuple

import numpy as np

from . import _lease as L
from . import _native as N
from . import cuda as C
from ._args import object_name, version_number, wait_seconds
from ._lease import FORKS
from .errors import ConnectionError, GpuUnavailable, ObjectNotFound

if TYPE_CHECKING:
    import numpy.typing as npt

    from ._args import Metadata, Name
    from ._lease import Lease


class ClientCore:
    """One connection to a store, of this process (see the module docstring).

    ``path``: the daemon's socket; ``closed``; ``capacity`` and ``max_inline``: the store's,
    from its HELLO; ``inline_limit``: the largest put that goes in one PUT frame (the Rust
    client's CLIENT_INLINE_PUT, 256 KiB, or the store's ``max_inline`` if smaller).
    """

    def __init__(self, path: str, connect_timeout: float, release_delay: float,
                 reconnect: bool, shared_reads: bool, lend_puts: bool,
                 pipelined_puts: bool) -> None:
        self.path = path
        self.closed = True  # until HELLO succeeded
        self._pid = os.getpid()
        self._forks = FORKS[0]
        self._reconnect = reconnect
        # name -> lease of the owner of an object this connection created and has not sealed
        self._unsealed: dict[str, Optional[Lease]] = {}
        try:
            self._native_client = N.Client(
                path, float(connect_timeout or 0.0), bool(reconnect),
                float(release_delay or 0.0), bool(shared_reads), bool(lend_puts),
                bool(pipelined_puts))
        except ConnectionError as e:
            if "cannot connect" not in str(e):
                raise
            raise ConnectionError(
                f"no vovp store answers at {path} ({e}). Start one: `vovp-engine -m 1G -s "
                f"{path}` (installed with the package), or from Python "
                f"`vovp.init_client({path!r}, start=True)` / `vovp.start_store(socket=...)`"
            ) from None
        self._guarded = _Guarded(self)
        self.closed = False
        self.capacity: int = self._native_client.capacity
        self.max_inline: int = self._native_client.max_inline
        self.inline_limit: int = min(self.max_inline, N.INLINE_LIMIT)

    # -- the rules ------------------------------------------------------------------------------

    def usable_here(self) -> bool:
        """Whether this connection may be used: open, and opened by this process."""
        return not self.closed and self._pid == os.getpid()

    def check_usable(self) -> None:
        """ConnectionError unless ``usable_here()``."""
        if os.getpid() != self._pid:
            raise ConnectionError(
                "this vovp client was created in another process (fork); create a new one")
        if self.closed:
            raise ConnectionError("the vovp client is closed")

    @property
    def native(self) -> N.Client:
        """The native client's methods, once this connection is checked usable; a call that
        loses the connection closes it (``connection_lost``)."""
        if self.closed or FORKS[0] != self._forks:
            self.check_usable()
        return self._guarded  # type: ignore[return-value] # (forwards to N.Client's methods)

    def connection_lost(self) -> None:
        """A call failed with ConnectionError: without reconnect the connection is closed (the
        daemon is gone, or the stream cannot be resynchronised)."""
        if not self._reconnect:
            self.closed = True
            self._native_client.close()
            for lease in L.leases_of(self):
                L.claim(lease)

    def close(self) -> None:
        """Close the connection: the daemon releases every reference it held."""
        if self.closed:
            return
        self.closed = True
        self._native_client.close()
        for lease in L.leases_of(self):
            L.claim(lease)  # the connection's end released them all
        self._unsealed.clear()

    def flush(self) -> None:
        """Send the releases garbage collection queued (nothing from another process)."""
        if os.getpid() == self._pid:
            self.native.flush()

    # -- gets -----------------------------------------------------------------------------------

    def get1(self, name: Name, timeout: Optional[float], writable: bool = False,
             missing_ok: bool = False,
             newer_than: Optional[int] = None) -> Any:  # N.Object, or None when missing_ok
        """The single get: the native view of sealed object ``name`` (it holds the reference),
        or None when it is still missing and ``missing_ok``, else ObjectNotFound. ``timeout``:
        None = don't wait, seconds, negative = forever. ``newer_than``: only a version above
        it. Every get of one name takes this path (``get_tensor``, ``get_buffer``,
        ``to_device``, vovp.plasma, vovp.reduction): the checks are written out here rather
        than called."""
        if self.closed or FORKS[0] != self._forks:
            self.check_usable()
        if timeout is not None and (type(timeout) is not float or timeout < 0):
            timeout = wait_seconds(timeout)
        try:
            if newer_than:
                obj = self._native_client.get1(object_name(name), timeout, writable,
                                               version_number(newer_than))
            else:
                obj = self._native_client.get1(
                    name if type(name) is str else object_name(name), timeout, writable)
        except ConnectionError:
            self.connection_lost()
            raise
        if obj is None and not missing_ok:
            if newer_than:
                raise ObjectNotFound(
                    f"no version of {name!r} newer than {newer_than} was sealed in time", 1)
            raise ObjectNotFound(f"no sealed object named {name!r}", 1)
        return obj

    def make_writable(self, obj: Any) -> None:
        """View a got object through a private writable mapping (torch has no read-only
        tensors); ``obj`` is released if that fails."""
        try:
            self._native_client.make_writable(obj)
        except BaseException as e:
            obj.release()
            if isinstance(e, ConnectionError):
                self.connection_lost()
            raise

    # -- puts -----------------------------------------------------------------------------------

    def put(self, name: str, src: npt.NDArray[Any], options: N.PutOptions,
            metadata: bytes = b"") -> Any:  # an id, or None (not kept)
        """The put of C-contiguous array ``src`` with ``metadata`` as object ``name`` that
        keeps no reference (``Client.put``, vovp.plasma): the object id when it waits for the
        store's answer, None when ``options.pipelined``."""
        if self.closed or FORKS[0] != self._forks:
            self.check_usable()
        try:
            return self._native_client.put_with(name, src, options, metadata)
        except ConnectionError:
            self.connection_lost()
            raise

    def put_array(self, name: Name, src: npt.NDArray[Any], framework: int,
                  options: N.PutOptions) -> Optional[npt.NDArray[Any]]:
        """``put_tensor`` of numpy array ``src`` in one native call when the store keeps it as
        it is (C-contiguous, little-endian, a dtype the tensor header names): the result,
        leased; None, nothing sent, for an array to convert first. The native put reads its
        dtype, shape and bytes from one ``__array_struct__`` and writes the tensor header
        itself (``framework`` its last byte). ``options``: a kept put's (``put_options``)."""
        if self.closed or FORKS[0] != self._forks:
            self.check_usable()
        try:
            obj: Any = self._native_client.put_with(  # (kept: an Object, or None)
                name if type(name) is str else object_name(name), src, options, b"", None,
                framework)
        except ConnectionError:
            self.connection_lost()
            raise
        if obj is None:
            return None
        arr: npt.NDArray[Any] = obj.array()
        L.lease(arr, self, obj)
        return arr

    def put_tensor_host(self, name: str, src: npt.NDArray[Any], metadata: bytes,
                        options: N.PutOptions, view_dt: np.dtype[Any]) -> npt.NDArray[Any]:
        """The kept put of C-contiguous array ``src`` with tensor header ``metadata``, in one
        native call (inline, through a lend, or CREATE + the parallel copy + SEAL, as the
        native client picks; a small one comes back at once, its answer read later): the
        result as numpy array of ``view_dt`` and ``src``'s shape, leased."""
        if self.closed or FORKS[0] != self._forks:
            self.check_usable()
        try:
            obj: Any = self._native_client.put_with(  # (kept: an Object)
                name, src, options, metadata, (shown_kind(view_dt), view_dt.itemsize, src.shape))
        except ConnectionError:
            self.connection_lost()
            raise
        arr: npt.NDArray[Any] = obj.array()
        L.lease(arr, self, obj)
        if arr.dtype != view_dt:
            arr = arr.view(view_dt)  # (ml_dtypes' bfloat16, shown as its bits)
        return arr

    def put_batch(self, items: list[Tuple[str, Any, bytes, Any, bool]],
                  options: N.PutOptions) -> list[Any]:
        """``put_with`` of each (name, src, metadata, layout, writable) in one native call (the
        kept ones that may return before the store's answer go out together): per item its
        result or its exception."""
        return self.native.put_batch(items, options)

    # -- owners ---------------------------------------------------------------------------------

    def owner(self, obj: Any) -> Any:  # (a uint8 ndarray: Any, as numpy is no Buffer to mypy)
        """uint8 array over native ``obj``'s bytes, leased (``vovp._lease``); the reference
        lives as long as some array over it does. GpuUnavailable (the reference released) for
        a CUDA object."""
        if not obj.is_host:
            obj.release()
            raise GpuUnavailable(
                f"{obj.name!r} is a CUDA object: it has no host memory to map (get it with "
                "get_tensor, which returns a CUDA tensor)", 10)
        owner = obj.array()
        L.lease(owner, self, obj)
        return owner

    def cuda_owner(self, obj: Any) -> C.DeviceBuffer:
        """A device owner over a CUDA native ``obj``, indexed like ``owner``'s arrays.

        A got object is mapped here (CUDA IPC, by the native core through the gpu crate; the
        pool is opened once per process). On failure (no driver here: GpuUnavailable; a handle
        the driver refuses: GpuError) the reference is released at once.
        """
        if obj.cuda_ptr is None:
            try:
                C.driver()  # the reason, as this process sees its driver
                obj.map_cuda()
            except BaseException:
                obj.release()
                raise
        owner = C.DeviceBuffer(obj.cuda_ptr, obj.size, obj.location[1], None, obj)
        L.lease(owner, self, obj, cuda=True)
        return owner

    def drop_owner(self, owner: object) -> None:
        """Release ``owner``'s reference now (error paths; a created object's aborts it)."""
        lease = L.lease_of(owner)
        if lease is not None and L.claim(lease):
            if self._unsealed.get(lease.name) is lease:
                del self._unsealed[lease.name]
            L.give_back(lease)

    # -- created objects ------------------------------------------------------------------------

    def create(self, name: str, size: int, metadata: Metadata, ephemeral: bool,
               device: Optional[int] = None, replace: bool = False,
               version: Optional[int] = None) -> Any:
        """CREATE: the owner of the creator's reference (a writable uint8 array, or a device
        owner on cuda:``device``), unsealed until ``seal(name)`` (which seals it as exactly
        ``version`` when given)."""
        buf = self.native.create(name, size, bytes(metadata), ephemeral, device, replace,
                                 version)
        owner = self.owner(buf) if device is None else self.cuda_owner(buf)
        self._unsealed[name] = L.lease_of(owner)
        return owner

    def seal(self, name: str) -> int:
        """SEAL an object this connection created; the name's version it became."""
        version: int = self.native.seal(name)
        lease = self._unsealed.pop(name, None)
        if lease is not None:
            lease.version = version
        return version

    def seal_later(self, name: str) -> None:
        """SEAL without waiting for its reply (read in front of the next request's). For
        hand-offs (vovp.reduction): the receiver's GET waits for the seal anyway, so the
        sender need not pay a round trip before sending the name. A failure of such a seal is
        only reported later (logged); the receiver's GET then times out."""
        self.native.seal_later(name)
        self._unsealed.pop(name, None)

    def abort(self, name: str) -> None:
        """ABORT an unsealed object this connection created; its memory is freed."""
        self.native.abort(name)
        # The creator's reference went with the object; do not release it again later.
        lease = self._unsealed.pop(name, None)
        if lease is not None:
            L.claim(lease)

    # -- for tests ------------------------------------------------------------------------------

    def requests_sent(self) -> int:
        """Frames this connection sent so far (requests and releases): for tests that count
        round trips."""
        return self._native_client.last_request_id

    @property
    def unread_replies(self) -> int:
        """Replies of requests that did not wait for them, not read yet."""
        return self._native_client.unread_replies


# PutOptions by (ephemeral, replace, keep_reference, pipelined, writable): immutable, made once.
_PUT_OPTIONS: dict[Tuple[bool, bool, bool, bool, bool], N.PutOptions] = {}


def put_options(ephemeral: bool, replace: bool, keep_reference: bool, pipelined: bool,
                writable: bool = False, version: Optional[int] = None) -> N.PutOptions:
    """The native ``PutOptions`` of a put, made once per combination (a put passes it on
    every call; making one costs more than the lookup). ``version``: sealed as exactly that
    version (vovp.cluster's numbering), made anew each time."""
    if version is not None:
        return N.PutOptions(ephemeral=bool(ephemeral), replace=bool(replace),
                            keep_reference=bool(keep_reference), pipelined=bool(pipelined),
                            writable=bool(writable), version=int(version))
    key = (ephemeral, replace, keep_reference, pipelined, writable)
    options = _PUT_OPTIONS.get(key)
    if options is None:
        key = (bool(ephemeral), bool(replace), bool(keep_reference), bool(pipelined),
               bool(writable))
        options = _PUT_OPTIONS[key] = N.PutOptions(
            ephemeral=key[0], replace=key[1], keep_reference=key[2], pipelined=key[3],
            writable=key[4])
    return options


# The defaults, for the hot paths to pick without a lookup: put_tensor's (kept, returning
# before the store's answer where the client may), a torch tensor's (writable too), and put's
# (no reference, not waited for).
KEPT_LATER = put_options(False, False, True, True)
KEPT_LATER_WRITABLE = put_options(False, False, True, True, True)
RAW_LATER = put_options(False, False, False, True)


def shown_kind(view_dt: np.dtype[Any]) -> str:
    """The numpy kind the native core shows a result of dtype ``view_dt`` with: its own, or
    unsigned for one it has no kind for (ml_dtypes' bfloat16, kind 'V': its bits, which the
    caller then views as ``view_dt``)."""
    kind: str = view_dt.kind
    return kind if kind in "biufc" else "u"


class _Guarded:
    """The native client's methods, noting a lost connection (``ClientCore.connection_lost``)."""

    def __init__(self, core: ClientCore) -> None:
        self._core = weakref.proxy(core)  # (no cycle: dropping a client closes it at once)
        self._native_client = core._native_client

    def __getattr__(self, attr: str) -> Any:
        fn = getattr(self._native_client, attr)
        core = self._core

        def call(*args: Any) -> Any:
            try:
                return fn(*args)
            except ConnectionError:
                core.connection_lost()
                raise

        setattr(self, attr, call)  # found once per method
        return call
