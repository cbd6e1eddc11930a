"""The vovp client: ``vovp.Client``, the Python API (arguments, tensors, leases) over the native
core (``vovp._native``, the Rust client).

The connection, HELLO and SEGMENT, requests and replies, fd passing, segment mappings (read-only;
this client's own arenas writable; private copy-on-write mappings for writable views of
others' objects), request ids, deferred releases, reconnect and CUDA IPC mappings (through the
gpu crate) are the Rust client's (transport/client/src/), not a second implementation of
PROTOCOL.md. What every call on it must respect (this process only, closed on a lost
connection) is ``vovp._core``'s; put planning is ``vovp.tensor.plan_host_put`` and the host
routes ``vovp._puts``; CUDA objects are ``vovp._client_cuda``'s.

Zero-copy and reference lifetime
--------------------------------
Every reference the daemon grants comes back as a native ``Object`` (or ``Buffer``, for an
object this client created) that holds it and releases it when garbage collected. Its bytes
are exported to numpy (``__array_struct__``, also ``__array_interface__``): the *owner*,
``obj.array()`` (what ``numpy.asarray(obj)`` makes, made through numpy's C API), is a 1-D uint8
array over the shared mapping whose ``.base`` is the native object (``numpy.asarray`` of numpy
>= 1.23: the tuple of it and the capsule). numpy stops collapsing ``.base``
chains at the first base that is not an ndarray, so every array derived from a returned one
(slices, reshapes, ``torch.from_numpy``, ``memoryview(arr)``) keeps the owner, hence the native
object, hence the reference, alive; when the last one goes the Rust view's ``Drop`` releases
it (sent at once when the connection is idle, else ahead of the next request). A native object
also keeps its connection open, so a reference outlives the client that got it.

Leases (``vovp._lease``) are only an index of these references: ``release(arr)`` and
``find_lease(arr)`` (``vovp._lookup``) find the reference behind an array (by its owner, or
by address for torch tensors), and ``release`` gives it back early through the native object.

Fork: a child must not talk on its parent's socket. A client used in another process than the
one that created it raises ConnectionError, and references that reached a child are never
released from it (the parent's connection owns them); ``vovp.default_client()`` opens a new
connection per process.
"""

from __future__ import annotations

import builtins
import os
import weakref
from typing import (
    TYPE_CHECKING,
    Any,
    Iterable,
    Literal,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
    overload,
)

import numpy as np

from . import _lease as L
from . import _native as N
from . import _puts as P
from . import daemon
from . import tensor as T
from ._args import (
    byte_array,
    check_framework,
    metadata_bytes,
    object_name,
    wait_seconds,
)
from ._client_cuda import CudaObjects
from ._core import KEPT_LATER, KEPT_LATER_WRITABLE, RAW_LATER, ClientCore, put_options
from ._lookup import release
# Re-exported (``X as X``): vovp.client's names for them, used by examples, tests and benches.
from ._copy import copy_into as copy_into
from ._lookup import find_lease as find_lease
from ._lookup import version_of as version_of
from .errors import InvalidArgument, ObjectNotFound, ProtocolError

if TYPE_CHECKING:
    import numpy.typing as npt
    import torch

    from ._args import Metadata, Name
    from ._puts import BatchItem

DEFAULT_SOCKET = "/tmp/vovp.sock"

# Objects up to this size (the Rust client's CLIENT_INLINE_PUT, 256 KiB) go to the native put
# in any case (one PUT frame; through a lend, those of 64 KiB or more through its lend: copy +
# one PUBLISH); larger ones too when stored as they are (contiguous, little-endian), through
# a lend or CREATE + copy + SEAL.
INLINE_LIMIT = N.INLINE_LIMIT
# The largest object a lend takes: 4 MiB, a quarter of the largest lend (16 MiB); the native core
# falls back to CREATE + copy + SEAL itself where its lend cannot take one (a smaller store,
# --prefault). vovp.plasma's creates use it.
LEND_LIMIT = N.LEND_LIMIT
# (A choice of the Python client, not a store limit.) Garbage-collected references are
# released within this many seconds: the native core queues
# their RELEASEs, which ride in front of the next request or are sent by a small thread after
# this delay if the client stays idle (``release_delay=0``: each is sent when its view drops).
RELEASE_DELAY = 0.002

__all__ = ["Client", "init_client", "DEFAULT_SOCKET"]


class Client:
    """A connection to a vovp store. Thread-safe; use one per process (see ``init_client``).

    Arrays returned by ``get_tensor``/``put_tensor`` are read-only views of the store's memory
    (sealed objects are immutable) unless ``writable=True`` is passed; torch tensors are always
    writable because torch has no read-only tensors - do not write to sealed objects.
    Do not use arrays from a client after ``close()``: the daemon is then free to reuse the
    memory.

    ``shared_reads`` (default on): gets of sealed host objects read the store's shared
    directory and record a hold in this client's own hold table, with no message to the
    daemon; everything else, and every get with ``shared_reads=False``, is a request.

    ``lend_puts`` (default on): puts of 64 KiB up to a lend's largest object (PROTOCOL.md,
    "Limits") are copied into a part of this client's own arena the store lends it and
    made objects with one message (no CREATE round trip). The store takes an empty, idle
    lend back when it is short of memory; a lend's memory
    comes back with its last object. Needs ``shared_reads``.

    ``pipelined_puts`` (default on): ``put`` below 64 KiB (256 KiB with ``lend_puts=False``),
    and ``put_tensor`` of a host tensor whose bytes and header take up to 4 KiB (or, with
    ``lend_puts``, of a C-contiguous little-endian one from 64 KiB up to what the lend takes),
    return once the request is
    written, without waiting for the store's answer (a write, not a round trip).
    ``put_tensor``'s result is the store's copy all the same: its bytes are written into a
    part of this client's arena the store lends it before the request goes out; the
    object's id and version (``vovp.version_of``) come with the answer, read when
    first needed. A name already published (or just put by this client) still fails at
    once; any process that learns of the name after ``put`` returned finds the object (the
    store waits for such puts before answering "missing"); this client's own later calls come
    after it. A put that fails in the store anyway (a name
    taken meanwhile by a racing put, full memory) is logged and raised by ``sync()``, not by
    the ``put`` (a ``put_tensor``'s also by ``version_of`` of its result, whose bytes stay
    readable). ``put(..., wait=True)`` waits for the answer (raising its error) and
    returns the object id. Needs ``shared_reads``.

    ``core`` is the connection underneath (``vovp._core.ClientCore``): the package's own
    interface to it (``vovp.plasma``, ``vovp.reduction``), not an API of its own.
    """

    def __init__(self, path: Optional[Union[str, os.PathLike[str]]] = None,
                 connect_timeout: float = 0.0,
                 release_delay: float = RELEASE_DELAY, reconnect: bool = False,
                 shared_reads: bool = True, lend_puts: bool = True,
                 pipelined_puts: bool = True):
        path = os.fspath(path) if path is not None else os.environ.get(
            "VOVP_SOCKET", DEFAULT_SOCKET)
        # CUDA objects go through a collaborator over the same connection.
        self.core = ClientCore(path, connect_timeout, release_delay, reconnect, shared_reads,
                               lend_puts, pipelined_puts)
        self._cuda = CudaObjects(self.core)
        self.capacity = self.core.capacity
        self.max_inline = self.core.max_inline

    # -- connection ---------------------------------------------------------------------------

    @property
    def path(self) -> str:
        """Socket path of the daemon."""
        return self.core.path

    @property
    def closed(self) -> bool:
        return self.core.closed

    def close(self) -> None:
        """Close the connection: the daemon releases every reference it held."""
        self.core.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.core.closed else f"capacity={self.capacity}"
        return f"<vovp.Client {self.core.path!r} {state}>"

    # -- releases -------------------------------------------------------------------------------

    def release(self, obj: object) -> bool:
        """Release the store reference behind ``obj`` now instead of at garbage collection.

        ``obj`` is an array / tensor / memoryview returned by this client (or any view of one),
        or an object id. Returns False when there was nothing (left) to release, so a double
        release is harmless. The array must not be used afterwards: the memory may be reused.
        """
        return release(self.core, obj)

    def flush(self) -> None:
        """Send the releases that garbage collection queued (normally sent within
        ``release_delay`` seconds, or with the next request)."""
        self.core.flush()

    # -- raw objects ----------------------------------------------------------------------------

    def create(self, name: Name, size: int, metadata: Metadata = b"",
               ephemeral: bool = False, replace: bool = False,
               version: Optional[int] = None) -> npt.NDArray[np.uint8]:
        """Create an unsealed object and return a writable uint8 array over its bytes.

        The returned array holds the creator's reference: keep it alive until ``seal(name)``
        (dropping it before aborts the object); after the seal it keeps the object alive and
        writable *for this client only* (other clients see the same physical memory).
        ``replace``: ``name`` may exist; the object becomes its next version at ``seal``.
        ``version``: it seals as exactly that version (above the name's present one, else
        StaleVersion at the seal), as ``put_with``'s ``PutOptions(version=)``.
        """
        size = int(size)
        if not 0 <= size < 2**64:
            raise InvalidArgument(f"size must be between 0 and 2**64 - 1 bytes, got {size}")
        owner: npt.NDArray[np.uint8] = self.core.create(
            object_name(name), size, metadata_bytes(metadata), ephemeral, None, replace,
            version)
        return owner

    def create_tensor(self, name: Name, shape: Any, dtype: npt.DTypeLike,
                      ephemeral: bool = False, replace: bool = False) -> npt.NDArray[Any]:
        """Create an unsealed tensor object; fill the returned writable array, then ``seal``."""
        dtype = np.dtype(dtype)
        code = T.numpy_code(dtype)
        store_dt = T.little_endian_dtype(dtype)
        shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(d) for d in shape)
        meta = T.encode_header(code, shape)
        size = store_dt.itemsize * int(np.prod(shape, dtype=np.int64))
        owner = self.create(name, size, meta, ephemeral, replace)
        return owner.view(store_dt).reshape(shape)

    def seal(self, name: Name) -> int:
        """Seal an object created by this client: it becomes immutable and visible to GET.
        Returns the name's version it became (1 for a new name; a replace's next one)."""
        return self.core.seal(object_name(name))

    def abort(self, name: Name) -> None:
        """Abort an unsealed object created by this client; its memory is freed."""
        self.core.abort(object_name(name))

    def put(self, name: Name, data: Any, metadata: Metadata = b"", ephemeral: bool = False,
            wait: bool = False, replace: bool = False) -> Optional[int]:
        """Store ``data`` (any bytes-like object) as a sealed object.

        The client keeps no reference: the object lives until deleted (or evicted when nobody
        holds it). ``ephemeral=True`` objects vanish when their last reference is released,
        so with ``put`` (which holds none) only a GET racing the put would see them.

        Returns None; a put below 64 KiB may return before the store answered (see
        ``pipelined_puts`` in ``Client``; ``sync()`` waits for the answers). ``wait=True``:
        wait for the store's answer and return the object id. ``replace``: ``name`` may
        exist already; this object becomes its next version (see ``put_tensor``).
        """
        options = (RAW_LATER if not (ephemeral or wait or replace)
                   else put_options(ephemeral, replace, False, not wait))
        result: Optional[int] = self.core.put(
            object_name(name), byte_array(data), options, metadata_bytes(metadata))
        return result

    def sync(self) -> None:
        """Wait for the store's answer to every put that did not wait for it; raises the
        first that failed since the last ``sync`` (each failure is raised by one ``sync``)."""
        self.core.native.sync()

    @overload
    def get_buffer(self, name: Name, timeout: Optional[float] = None,
                   writable: bool = False, *,
                   with_metadata: Literal[True],
                   newer_than: Optional[int] = None) -> Tuple[memoryview, bytes]: ...

    @overload
    def get_buffer(self, name: Name, timeout: Optional[float] = None,
                   writable: bool = False,
                   with_metadata: Literal[False] = False,
                   newer_than: Optional[int] = None) -> memoryview: ...

    def get_buffer(self, name: Name, timeout: Optional[float] = None, writable: bool = False,
                   with_metadata: bool = False, newer_than: Optional[int] = None
                   ) -> Union[memoryview, Tuple[memoryview, bytes]]:
        """A memoryview of a sealed object's bytes (read-only unless ``writable``).

        ``timeout``: None = don't wait, seconds to wait for the object to appear/be sealed,
        negative = forever. Raises ObjectNotFound when it is still missing.
        With ``with_metadata=True`` returns ``(memoryview, metadata bytes)``.
        ``newer_than``: only a version above it (see ``get_tensor``).
        """
        obj = self.core.get1(name, timeout, writable, newer_than=newer_than)
        mv = memoryview(self.core.owner(obj))
        return (mv, obj.metadata) if with_metadata else mv

    def get_buffers(self, names: Iterable[Name], timeout: Optional[float] = None,
                    writable: bool = False
                    ) -> builtins.list[Optional[Tuple[memoryview, bytes]]]:
        """Several objects in one GET: a list with ``(memoryview, metadata bytes)`` per name, or
        None for a name still missing or unsealed when ``timeout`` ran out.

        The daemon waits until *every* name is sealed or the timeout passes (``timeout`` as in
        ``get_buffer``), so a batch costs one round trip and one wait. Each memoryview holds its
        own reference, released like ``get_buffer``'s.
        """
        core = self.core
        objs = core.native.get([object_name(n) for n in names], wait_seconds(timeout),
                               writable)
        out: builtins.list[Optional[Tuple[memoryview, bytes]]] = []
        for i, obj in enumerate(objs):
            if obj is None:
                out.append(None)
                continue
            try:
                owner = core.owner(obj)
            except BaseException:
                for later in objs[i + 1:]:
                    if later is not None:
                        later.release()
                raise
            out.append((memoryview(owner), obj.metadata))
        return out

    def contains(self, name: Name) -> bool:
        """Whether a sealed object of that name exists."""
        return self.core.native.contains(object_name(name))

    def __contains__(self, name: Name) -> bool:
        return self.contains(name)

    def delete(self, name: Name) -> None:
        """Remove the name now; the memory is freed when the last holder releases it."""
        self.core.native.delete(object_name(name))

    def list(self) -> builtins.list[dict[str, Any]]:
        """Every object: dicts with name, id, size, device, sealed, ephemeral, refcount,
        last_access (unix seconds), metadata, and dtype/shape for tensor objects."""
        entries = self.core.native.list()
        for e in entries:
            meta = e["metadata"]
            if T.is_tensor_header(meta):
                try:
                    tm = T.decode_header(meta)
                    e["dtype"] = tm.dtype_name
                    e["shape"] = tm.shape
                except ProtocolError:
                    pass
        return entries

    def stats(self) -> dict[str, int]:
        """Store counters (the STATS fields of PROTOCOL.md)."""
        return self.core.native.stats()

    def metrics(self) -> str:
        """The daemon's metrics in the Prometheus text format (one METRICS request): what
        ``vovp-engine --metrics`` serves at ``/metrics``, with or without that endpoint. Read
        it with ``prometheus_client.parser.text_string_to_metric_families``; README.md,
        "Monitoring", lists the metrics."""
        return self.core.native.metrics()

    def evict(self, nbytes: int) -> int:
        """Evict unreferenced sealed objects until ``nbytes`` are free; returns bytes freed."""
        return self.core.native.evict(int(nbytes))

    # -- tensors --------------------------------------------------------------------------------

    @overload
    def put_tensor(self, name: Name, t: torch.Tensor, ephemeral: bool = False,
                   writable: bool = False, replace: bool = False) -> torch.Tensor: ...

    @overload
    def put_tensor(self, name: Name, t: npt.NDArray[Any], ephemeral: bool = False,
                   writable: bool = False, replace: bool = False) -> npt.NDArray[Any]: ...

    @overload
    def put_tensor(self, name: Name, t: Any, ephemeral: bool = False,
                   writable: bool = False, replace: bool = False) -> Any: ...

    def put_tensor(self, name: Name, t: Any, ephemeral: bool = False, writable: bool = False,
                   replace: bool = False) -> Any:
        """Store a numpy array or torch tensor (CPU or CUDA); return the store's copy, zero-copy.

        The result (numpy array, or torch tensor for torch input) is a view of the store's
        memory and holds one reference to the object until it and every view of it are
        garbage collected (or ``release``d). It is read-only unless ``writable`` (torch
        tensors are always writable). Non-contiguous input is made C-contiguous and
        big-endian input is converted to little-endian during the copy.

        A CUDA torch tensor becomes a CUDA object on its device (device-to-device copy) and
        the result is a torch tensor on that device aliasing the store's device memory; any
        other object with ``__cuda_array_interface__`` goes through ``put_cuda``. Without a
        usable CUDA driver in this process they raise GpuUnavailable (with the reason).

        ``replace=True``: ``name`` may already exist; the new tensor becomes the name's next
        version when it is sealed, in one step (gets from then on return it, gets before
        returned the previous version, and the name is never missing in between). Whoever
        holds the previous version keeps it, unchanged; its memory goes with its last holder.
        ``vovp.version_of(result)`` is the version it became. Without it, an existing name
        raises ObjectExists.

        A host tensor whose bytes and header take up to 4 KiB, or (``lend_puts``) a
        C-contiguous little-endian one of 64 KiB up to what the lend takes (PROTOCOL.md,
        "Limits"), returns without waiting for the store's answer (``pipelined_puts``
        in ``Client``): a name already published still raises ObjectExists at once, but one
        taken meanwhile by another client's racing put is raised by ``sync()`` (and by
        ``version_of`` of the result), not here. While such a failed result lives, the part
        of the arena it is in is kept for it, so once that lend is full this client's larger
        puts wait for the store again. A small one's torch (or ``writable``) result views the
        store's copy through a private mapping: writes to it stay in this process. A larger
        one's is the store's copy itself, in this client's own arena (writes to it are seen by
        every reader: do not write to stored tensors); on a store without client arenas
        (``--prefault``) it is a private mapping too.
        """
        # An array stored as it is (C-contiguous, little-endian, a dtype the header names), a
        # torch tensor's numpy view included, goes in one native call that reads its dtype,
        # shape and bytes itself; any other is planned and converted (vovp._puts).
        if type(t) is np.ndarray:
            options = (KEPT_LATER if not (ephemeral or replace or writable)
                       else put_options(ephemeral, replace, True, True, writable))
            arr = self.core.put_array(name, t, T.FRAMEWORK_UNSPECIFIED, options)
            if arr is not None:
                return arr
        elif (plain := T.plain_cpu_numpy(t)) is not None:
            options = (KEPT_LATER_WRITABLE if not (ephemeral or replace)
                       else put_options(ephemeral, replace, True, True, True))
            arr = self.core.put_array(name, plain, T.FRAMEWORK_TORCH, options)
            if arr is not None:
                return T.torch_of_numpy(arr)
        plan = T.plan_host_put(t)
        if plan is None:
            return self._cuda.put_tensor(name, t, ephemeral, writable, replace)
        return P.put_host(self.core, object_name(name), plan, ephemeral, writable, replace)

    def put_tensors(self, tensors: Union[Mapping[Any, Any], Iterable[Tuple[Name, Any]]],
                    ephemeral: bool = False, writable: bool = False,
                    replace: bool = False) -> dict[str, Any]:
        """``put_tensor`` of every ``name -> tensor`` item of a mapping (or of (name, tensor)
        pairs); returns ``{name: store's copy}`` in the same order.

        Small host tensors (up to the inline limit) are pipelined: their puts go out together
        (one message for several) and their replies are read later, as a single small
        ``put_tensor``'s are. Larger ones and
        CUDA tensors are put one after the other, each as ``put_tensor`` puts it (so one of
        64 KiB up to what the lend takes does not wait for the store's answer either). If any
        put fails here, the first error is raised after all were attempted; the others stay
        stored (``delete`` them if needed). A pipelined put the store refuses is raised by
        ``sync()`` and by ``version_of`` of its result, not here.
        """
        items: builtins.list[Tuple[Name, Any]] = list(
            tensors.items() if hasattr(tensors, "items") else tensors)
        results: dict[str, Any] = {}  # filled in input order: placeholders first
        error: Optional[BaseException] = None
        sequential = []  # CUDA and large tensors: put_tensor one by one
        batch: builtins.list[BatchItem] = []
        batch_bytes = 0
        core, plan_host_put = self.core, T.plan_host_put
        inline_limit = core.inline_limit
        for name, t in items:
            try:
                if type(name) is not str:
                    name = object_name(name)
                plan = plan_host_put(t)  # put_tensor's planning
            except Exception as e:  # noqa: BLE001 (raised once the others are stored)
                error = error or e
                continue
            results[name] = None
            if plan is None or plan[0].nbytes > inline_limit:  # CUDA, or large
                sequential.append((name, t))
                continue
            src, code, store_dt, view_dt, meta, torch_in = plan
            if src.dtype is not store_dt or not src.flags.c_contiguous:
                src = np.ascontiguousarray(src, dtype=store_dt)
            batch.append((name, src, view_dt, src.shape, code, torch_in, meta))
            batch_bytes += src.nbytes
            # Bounded batches: the daemon's replies must never fill our receive buffer while
            # we are still sending.
            if len(batch) >= 64 or batch_bytes >= (4 << 20):
                error = P.put_batch(core, batch, results, ephemeral, writable,
                                    replace) or error
                batch, batch_bytes = [], 0
        if batch:
            error = P.put_batch(core, batch, results, ephemeral, writable, replace) or error
        for name, t in sequential:
            try:
                results[name] = self.put_tensor(name, t, ephemeral, writable, replace=replace)
            except Exception as e:  # noqa: BLE001
                error = error or e
                results.pop(name, None)
        if error is not None:
            raise error
        return results

    def get_tensor(self, name: Name, timeout: Optional[float] = None,
                   framework: Optional[str] = None, writable: bool = False,
                   newer_than: Optional[int] = None) -> Any:
        """The tensor stored under ``name``, zero-copy.

        ``timeout``: None = don't wait, seconds to wait, negative = forever; raises
        ObjectNotFound when missing. ``framework``: None returns what was put: a torch tensor
        for an object put from torch (recorded in its tensor header) when this process can
        import torch, otherwise a numpy array (read-only unless ``writable``); "numpy" or
        "torch" (via torch.from_numpy, no copy) force one.
        An object without a tensor header comes back as a 1-D uint8 array.
        A waiting GET occupies this client's connection: other threads' requests on the same
        client queue behind it (use a separate client for long waits).

        CUDA objects come back aliasing the store's device memory (mapped through CUDA IPC):
        with framework None as a torch CUDA tensor when torch is installed and sees CUDA,
        otherwise as a ``vovp.cuda.CudaTensor`` (``__cuda_array_interface__``, DLPack,
        ``.to_numpy()``); "torch" or "cuda" (CudaTensor) force one. "numpy" is refused for
        them (TypeError): there is no host memory to view; ``.to_numpy()`` copies. Without a
        CUDA driver in this process a CUDA object raises GpuUnavailable.

        ``newer_than=v``: only a version of ``name`` above ``v`` (``vovp.version_of`` of a
        tensor you hold), waiting up to ``timeout`` for one to be sealed, then ObjectNotFound:
        how a reader follows a name that a writer replaces (``put_tensor(replace=True)``).
        """
        if framework is not None:
            check_framework(framework)
        # The single get's path (the shared directory, else one GET), not a batch of one: a
        # typed get costs a raw get plus the header's plan (issue 27).
        obj = self.core.get1(name, timeout, writable, newer_than=newer_than)
        return self._tensor_from_obj(obj, name, framework, writable)

    def get_tensors(self, names: Iterable[Name], timeout: Optional[float] = None,
                    framework: Optional[str] = None,
                    writable: bool = False) -> builtins.list[Any]:
        """``[get_tensor(n) for n in names]`` in one call (the shared directory, else one GET
        of the names it lacks).

        ``timeout`` bounds the wait for all of them together (None: don't wait). When any is
        still missing, raises ObjectNotFound naming the missing ones and holds nothing.
        ``framework`` and ``writable`` apply to every result, as in ``get_tensor``.
        """
        check_framework(framework)
        names = list(names)
        if not names:
            return []
        core = self.core
        objs: builtins.list[Any] = core.native.get(
            [n if type(n) is str else object_name(n) for n in names], wait_seconds(timeout),
            writable)
        missing = [n for n, o in zip(names, objs) if o is None]
        if missing:
            for o in objs:
                if o is not None:
                    o.release()
            shown = ", ".join(repr(n) for n in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ObjectNotFound(f"no sealed object named {shown}{more}", 1)
        out: builtins.list[Any] = []
        # The common case written out (numpy results of host tensors): no call per tensor
        # but numpy's, and the leases made in one call; the rest through _tensor_from_obj.
        plain = framework in (None, "numpy", "np") and not writable
        # A header saying torch makes a torch result only with framework None and torch
        # importable (asked only then: the question imports torch).
        header_torch = T.FRAMEWORK_TORCH if framework is None else -1
        plain_arrays: builtins.list[Any] = []
        plain_objs: builtins.list[Any] = []
        i = 0
        try:
            for i, obj in enumerate(objs):
                fast = obj.tensor_plan if plain else None
                if fast is not None and (fast[1] != header_torch or not T.torch_importable()):
                    arr = obj.array()
                    plain_arrays.append(arr)
                    plain_objs.append(obj)
                    out.append(arr)
                    continue
                out.append(self._tensor_from_obj(obj, names[i], framework, writable))
        except BaseException:
            for later in objs[i + 1:]:
                later.release()
            raise
        finally:
            L.lease_all(plain_arrays, core, plain_objs)
        return out

    def _tensor_from_obj(self, obj: Any, name: Name, framework: Optional[str],
                         writable: bool) -> Any:
        """The result of ``get_tensor`` for a granted reference (released on failure)."""
        # The common case: a host tensor the native core shows numpy as it is (its header
        # parsed and its dtype and shape set natively).
        fast = obj.tensor_plan
        shown = fast is not None and framework != "cuda"
        if shown:
            code, header_framework = fast
        else:
            plan = None
            if not obj.is_host:
                return self._cuda.tensor_of(obj, name, framework, writable)
            if framework == "cuda":
                obj.release()
                raise TypeError(f"{name!r} is a host object; framework='cuda' is for CUDA "
                                "objects (copy it to a device with to_device)")
            meta = obj.metadata
            code, header_framework = T.UINT8, T.FRAMEWORK_UNSPECIFIED
            if meta[:4] == T.MAGIC:
                try:
                    plan = T.get_plan(meta)
                    if plan[4] != T.DEVICE_CPU:
                        raise ProtocolError(
                            f"{name!r} is a host object with a CUDA tensor header")
                    if plan[3] != obj.size:
                        raise ProtocolError(
                            f"{name!r}: tensor header describes {plan[3]} bytes, object has "
                            f"{obj.size}")
                except BaseException:
                    obj.release()
                    raise
                code, header_framework = plan[0], plan[5]
        # A torch tensor (``framework``, else what the header recorded, when torch can be
        # imported) views the object writable: torch has no read-only tensors.
        if framework is None:
            torch_out = header_framework == T.FRAMEWORK_TORCH and T.torch_importable()
        else:
            torch_out = framework == "torch"
        if torch_out and not writable:
            self.core.make_writable(obj)
        if shown:
            arr = obj.array()
            L.lease(arr, self.core, obj)
        else:
            arr = self.core.owner(obj)
            if plan is not None:
                arr = arr.view(plan[1]).reshape(plan[2])
        return T.numpy_to_torch(arr, code) if torch_out else arr

    # -- CUDA objects (vovp._client_cuda) --------------------------------------------------------

    def put_cuda(self, name: Name, ptr: Any, nbytes: Optional[int] = None,
                 dtype: Any = None, shape: Any = None,
                 device: Optional[int] = None, ephemeral: bool = False,
                 writable: bool = False, framework: str = "cuda",
                 stream: Optional[int] = None, replace: bool = False) -> Any:
        """Store device memory as a CUDA tensor object; return the store's copy, zero-copy.

        ``ptr``: a device address (int) with ``nbytes``/``dtype`` (default uint8)/``shape``
        (default 1-D), or any object with ``__cuda_array_interface__`` (C-contiguous; its
        shape, dtype and stream are used). ``device``: the ordinal to store on; by default the
        device ``ptr`` lives on (asked from the driver). ``stream``: a CUDA stream handle to
        wait for before copying (the interface's own ``stream`` is honoured too).

        Creates the object on the device, copies device-to-device into the store's memory,
        waits for the copy, seals. Returns a ``CudaTensor`` (read-only unless ``writable``),
        or a torch tensor with ``framework="torch"``; it holds one reference like every
        result. Raises GpuUnavailable when this process has no usable CUDA driver (or the
        daemon has none), before anything is created. ``replace``: as ``put_tensor``'s.
        """
        return self._cuda.put_cuda(name, ptr, nbytes, dtype, shape, device, ephemeral,
                                   writable, framework, stream, replace)

    def to_device(self, name: Name, new_name: Name, device: int = 0,
                  ephemeral: bool = False, framework: Optional[str] = None,
                  writable: bool = False, timeout: Optional[float] = None) -> Any:
        """Store a copy of object ``name`` on cuda:``device`` under ``new_name``.

        A host object is copied host-to-device straight from the store's mapping; a CUDA
        object device-to-device (e.g. to another GPU). The tensor header, if any, is kept
        with its device fields updated. Returns the new object like ``get_tensor`` would
        (``framework``: None, "torch" or "cuda"); the source's reference is released before
        returning. GpuUnavailable without a usable CUDA driver.
        """
        return self._cuda.to_device(name, new_name, device, ephemeral, framework, writable,
                                    timeout)

    # -- transfers between engines (vovp.cluster's data path) -------------------------------

    def fetch_from(self, address: str, name: Name, version: int, *, streams: int = 0,
                   timeout: Optional[float] = None, base_version: Optional[int] = None,
                   base_ranges: Optional[Sequence[Tuple[int, int]]] = None,
                   framework: Optional[str] = None, writable: bool = False) -> Any:
        """``name`` at ``version``, copied by this client's engine from the engine whose
        transfer port is ``address`` (``"ip:port"``: that engine's ``transfer_address()``)
        into this store, sealed here as exactly that version; returned as ``get_tensor``
        returns it (``vovp.version_of`` gives the version; every process here then gets it by
        name). The bytes go engine to engine (several TCP streams, no Python); a version this
        store has already (or a newer one) is returned without a transfer, and concurrent
        fetches of one name and version share one transfer.

        ``base_version`` with ``base_ranges`` (``(offset, len)`` byte ranges, the same in both
        versions): those ranges are copied from this store's ``base_version`` of the name
        instead of fetched (tensors that did not change). ``streams``: TCP streams at most
        (0: by size); ``timeout``: seconds for the whole transfer (None: 60).

        Raises TransferFailed (the holder refused, died or stalled; nothing is visible),
        StaleVersion (a newer version was made here meanwhile), ObjectNotFound (no such base
        here), OutOfMemory; VovpError when this engine has no transfer key.
        """
        if framework is not None:
            check_framework(framework)
        ranges = None if base_ranges is None else [(int(o), int(n)) for o, n in base_ranges]
        obj = self.core.native.fetch_from(address, object_name(name), version, streams,
                                          timeout, base_version, ranges, writable)
        return self._tensor_from_obj(obj, name, framework, writable)

    def gather_from(self, address: str, name: Name, version: int, row_bytes: int, ids: Any,
                    into: Name, timeout: Optional[float] = None) -> Any:
        """Rows ``ids`` (a sequence of ints or a uint64/int64 array; repeats allowed) of
        ``name`` at ``version``, held by the engine at ``address``: row ``i`` is bytes
        ``i * row_bytes ..`` of it. Returns a read-only uint8 array of
        ``len(ids) * row_bytes`` bytes (``.view(dtype).reshape(...)`` it), the rows in the
        order of ``ids``, viewing a new ephemeral object ``into`` of this store (gone once no
        array views it). Errors as ``fetch_from``'s; a row past the end is TransferFailed.
        """
        obj = self.core.native.gather_from(address, object_name(name), version, row_bytes,
                                           ids, object_name(into), timeout)
        return self.core.owner(obj)

    def transfer_address(self) -> Optional[str]:
        """The ``"ip:port"`` this client's engine serves transfers at (``start_store(...,
        transfer=...)``, ``vovp-engine --transfer``), None when it serves none."""
        address: Optional[str] = self.core.native.transfer_address()
        return address

    def transfer_info(self) -> Tuple[Optional[str], dict[str, int]]:
        """The transfer port (as ``transfer_address``) and the engine's transfer counters:
        streams served, refusals by reason (``refused_bad_mac``, ``refused_expired``,
        ``refused_replayed``, ``refused_not_held``, ``refused_malformed``), fetches (one per
        transfer; ``fetches_shared`` joined one), bytes received and copied from a base."""
        info: Tuple[Optional[str], dict[str, int]] = self.core.native.transfer_info()
        return info

    def subscribe(self) -> Subscription:
        """A new connection that yields notifications: (kind, name, size, metadata) tuples,
        kind being "sealed", "deleted", "evicted" or "replaced" (a new version took the name:
        one notification, no "deleted" of the old one). Close it with ``.close()``."""
        return Subscription(self.core.path)


class Subscription:
    """Notification stream (SUBSCRIBE): iterate to receive events as they happen."""

    def __init__(self, path: Optional[Union[str, os.PathLike[str]]]) -> None:
        self._client = Client(path)
        self._sub: Optional[N.Subscription] = self._client.core.native.subscribe()

    def __iter__(self) -> Subscription:
        return self

    def __next__(self) -> Tuple[str, str, int, bytes]:
        while True:
            if self._sub is None:
                raise StopIteration
            try:
                event = self._sub.next(None)
            except (ConnectionError, OSError):
                raise StopIteration from None
            if event is None:
                raise StopIteration
            return event

    def close(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            sub.close()
        self._client.close()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# The most recent init_client() of this process: (weak reference to the client, its path, pid).
# init_reduction() without an argument sends through it (the seed's
# ``client = vovp.init_client(path); vovp.init_reduction()``). Weak: dropping the client must
# still close it; its path is remembered.
_last_init: dict[str, Any] = {"ref": None, "path": None, "pid": None}


def init_client(path: Optional[Union[str, os.PathLike[str]]] = None,
                connect_timeout: float = 0.0,
                reconnect: bool = False, shared_reads: bool = True,
                lend_puts: bool = True, pipelined_puts: bool = True, *, start: bool = False,
                memory: Union[int, str] = "1G", **store_options: Any) -> Client:
    """Connect to the daemon at ``path`` (default: $VOVP_SOCKET or /tmp/vovp.sock).

    ``start=True``: if nothing answers there, start a store at ``path`` first (``memory`` and
    ``store_options`` as for ``vovp.start_store``; it goes away with this process). Processes
    doing this at once end with one store, all connected to it. Without it a missing daemon
    is a ``vovp.ConnectionError`` that names the socket and both ways to start one.

    The client becomes this process's default for ``vovp.init_reduction()``.
    ``reconnect=True``: if the daemon goes away (restarted, killed), the next call connects
    again and is retried once; objects that died with the old daemon are not found, arrays
    got before keep their (old, intact) memory. ``shared_reads``, ``lend_puts``,
    ``pipelined_puts``: see ``Client``."""
    if start:
        path = os.fspath(path) if path is not None else os.environ.get(
            "VOVP_SOCKET", DEFAULT_SOCKET)
        daemon.ensure_store(path, memory, **store_options)
    client = Client(path, connect_timeout, reconnect=reconnect, shared_reads=shared_reads,
                    lend_puts=lend_puts, pipelined_puts=pipelined_puts)
    _last_init.update(ref=weakref.ref(client), path=client.path, pid=os.getpid())
    return client


def last_init_client() -> Tuple[Optional[Client], Optional[str]]:
    """(client or None, path or None) of this process's most recent ``init_client``.

    A forked child has made none: its parent's record does not count (the child then follows
    $VOVP_SOCKET, which the parent's ``init_reduction`` exported)."""
    if _last_init["path"] is None or _last_init["pid"] != os.getpid():
        return None, None
    client = _last_init["ref"]()
    if client is None or client.closed:
        client = None
    return client, _last_init["path"]
