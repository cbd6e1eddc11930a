"""Type stub of ``vovp._native``, the PyO3 extension built from ``python/src/*.rs``.

Keep in step with the Rust sources: every ``#[pyclass]``, ``#[pymethods]`` item,
``#[pyfunction]`` and ``m.add(...)`` of the module appears here, with the types its PyO3
conversions accept and return.
"""

import builtins
import os
from typing import Any, Final, Literal, Optional, Sequence, Tuple, Union, final

__all__ = [
    "open_pools",
    "cuda_device_count",
    "cuda_device_of",
    "cuda_copy_d2d",
    "cuda_copy_h2d",
    "cuda_copy_d2h",
    "cuda_mem_alloc",
    "cuda_mem_free",
    "cuda_sync_stream",
    "_cuda_simulate_library_names",
    "copy_bytes",
    "copy_hashed",
    "copy_hashed_many",
    "content_hash",
    "CONTENT_HASH_BLOCK",
    "encode_tensor_header",
    "decode_tensor_header",
    "TENSOR_MAGIC",
    "TENSOR_VERSION",
    "TENSOR_HEADER_SIZE",
    "DTYPES",
    "MAX_NDIM",
    "LEND_LIMIT",
    "__version__",
    "INLINE_LIMIT",
    "Client",
    "Object",
    "Buffer",
    "Subscription",
    "PutOptions",
]

# --- lib.rs ----------------------------------------------------------------------------------

__version__: Final[str]
# Objects up to this size go through one PUT frame (the Rust client's CLIENT_INLINE_PUT).
INLINE_LIMIT: Final[int]

# --- tensor.rs -------------------------------------------------------------------------------

TENSOR_MAGIC: Final[bytes]
TENSOR_VERSION: Final[int]
TENSOR_HEADER_SIZE: Final[int]
# (code, numpy-style name, item size) of every dtype the tensor header can name.
DTYPES: Final[Tuple[Tuple[int, str, int], ...]]
MAX_NDIM: Final[int]
# The largest object any lend takes.
LEND_LIMIT: Final[int]

def encode_tensor_header(
    code: int,
    shape: Sequence[int],
    byte_order: int = 0,
    device_type: int = 1,
    device_id: int = 0,
    framework: int = 0,
) -> bytes:
    """The tensor header; ValueError for what the format cannot say."""

def decode_tensor_header(meta: bytes) -> Tuple[int, Tuple[int, ...], int, int, int, int]:
    """(dtype code, shape, byte order, device type, device id, framework) of a header;
    vovp.ProtocolError when it is not one this build understands."""

# --- array.rs --------------------------------------------------------------------------------

def copy_bytes(dst: Any, src: Any) -> bool:
    """``dst[...] = src`` for two C-contiguous arrays of equal byte length (dtypes the caller
    checked), through the rayon pool's parallel copy, without the GIL; False (nothing copied)
    when they overlap."""

# --- content_hash.rs -------------------------------------------------------------------------

# Bytes per hashed block of the content hash (vovp_shm::content_hash, version 1).
CONTENT_HASH_BLOCK: Final[int]

def copy_hashed(dst: Any, src: Any) -> int:
    """``dst[...] = src`` byte for byte (C-contiguous, equal byte lengths, not overlapping:
    ValueError otherwise) and the 64-bit content hash of the bytes, computed in the same pass,
    split across the copy pool, without the GIL."""

def copy_hashed_many(dst: Any, offsets: Sequence[int], srcs: Sequence[Any]) -> list[int]:
    """``dst[offsets[i]:][:len] = srcs[i]`` byte for byte for every source (C-contiguous;
    ValueError when one does not fit, two overlap in ``dst``, or one overlaps ``dst``) and each
    one's content hash, in one job over the copy pool, without the GIL."""

def content_hash(src: Any) -> int:
    """The 64-bit content hash of a C-contiguous array's bytes (as ``copy_hashed``'s)."""

# --- cuda.rs ---------------------------------------------------------------------------------

def open_pools() -> int: ...
def cuda_device_count() -> int: ...
def cuda_device_of(ptr: int) -> int: ...
def cuda_copy_d2d(device: int, dst: int, src: int, nbytes: int) -> None: ...
def cuda_copy_h2d(device: int, dst: int, src: int, nbytes: int) -> None: ...
def cuda_copy_d2h(device: int, dst: int, src: int, nbytes: int) -> None: ...
def cuda_mem_alloc(device: int, nbytes: int) -> int: ...
def cuda_mem_free(device: int, ptr: int) -> None: ...
def cuda_sync_stream(stream: int) -> None: ...
def _cuda_simulate_library_names(names: Optional[Sequence[str]] = None) -> None: ...

# --- views.rs --------------------------------------------------------------------------------

# (id, name, address, size, segment, offset, version): what the Python layer's lease records
# (id None and version 0 while a pipelined put's reply is unread; segment and offset None for
# a CUDA object).
_LeaseFields = Tuple[Optional[int], str, int, int, Optional[int], Optional[int], int]
# ("host", None) or ("cuda", device index).
_Location = Tuple[Literal["host", "cuda"], Optional[int]]

@final
class Object:
    """A sealed object's view: holds one store reference until released or collected.
    Not constructible from Python (``Client.get``/``get1``/``put_with``/``put_batch`` make them)."""

    @property
    def id(self) -> int:
        """The object id (a pending put's: once its reply is read; its error if it failed)."""
    @property
    def pending(self) -> bool:
        """Whether the store's answer to this put is still to be read."""
    @property
    def name(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def metadata(self) -> bytes: ...
    @property
    def version(self) -> int:
        """The name's version this object is (1 for a name's first object, +1 per replace)."""
    def set_layout(self, kind: str, itemsize: int, shape: Sequence[int]) -> None:
        """Show the bytes to numpy with this dtype kind, item size and shape (exactly the
        object's size; ValueError otherwise), before any array is made."""
    @property
    def location(self) -> _Location: ...
    @property
    def place(self) -> Optional[Tuple[int, int]]: ...
    @property
    def lease_fields(self) -> _LeaseFields: ...
    @property
    def address(self) -> int: ...
    @property
    def cuda_ptr(self) -> Optional[int]: ...
    def map_cuda(self) -> int: ...
    @property
    def __array_struct__(self) -> object: ...  # a PyCapsule
    def array(self) -> Any:
        """``numpy.asarray(self)`` (a numpy array over the bytes, ``.base`` this object), made
        through numpy's C API at the cost of a call."""
    @property
    def __array_interface__(self) -> dict[str, Any]: ...
    @property
    def is_host(self) -> bool: ...
    @property
    def host_fields(self) -> Optional[Tuple[int, int, bytes]]: ...
    @property
    def readonly(self) -> bool: ...
    def release(self) -> bool: ...
    @property
    def released(self) -> bool: ...

@final
class Buffer:
    """An object this client created (unsealed until ``Client.seal``); holds the creator's
    reference. Not constructible from Python (``Client.create`` makes them)."""

    @property
    def id(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def address(self) -> int: ...
    @property
    def lease_fields(self) -> _LeaseFields: ...
    @property
    def location(self) -> _Location: ...
    @property
    def place(self) -> Optional[Tuple[int, int]]: ...
    @property
    def cuda_ptr(self) -> Optional[int]: ...
    @property
    def __array_struct__(self) -> object: ...  # a PyCapsule
    def array(self) -> Any:
        """As ``Object.array``."""
    @property
    def is_host(self) -> bool: ...
    @property
    def __array_interface__(self) -> dict[str, Any]: ...
    def release(self) -> bool: ...

# --- subscription.rs -------------------------------------------------------------------------

# (kind, name, size, metadata) of one notification.
_Notification = Tuple[Literal["sealed", "deleted", "evicted"], str, int, bytes]

@final
class Subscription:
    """A notification stream (SUBSCRIBE on a connection of its own); made by
    ``Client.subscribe``."""

    def next(self, timeout: Optional[float] = None) -> Optional[_Notification]: ...
    def close(self) -> None: ...

# --- put.rs ----------------------------------------------------------------------------------

@final
class PutOptions:
    """How ``Client.put_with`` / ``put_batch`` put: the Rust client's ``PutOptions``, and
    whether a kept result is writable. Immutable; make one per kind of put and reuse it."""

    def __init__(
        self,
        *,
        ephemeral: bool = False,
        replace: bool = False,
        keep_reference: bool = False,
        pipelined: bool = False,
        writable: bool = False,
        device: Optional[int] = None,
        version: Optional[int] = None,
    ) -> None:
        """``device``: a CUDA device, which a put refuses (GpuError: it copies host bytes;
        create the object on the device and write it there). ``version``: seal as exactly
        this version of the name (above its present one, else StaleVersion)."""
    @property
    def version(self) -> Optional[int]:
        """Seal as exactly this version of the name (above its present one, else
        ``StaleVersion``); None: the next version."""
    @property
    def ephemeral(self) -> bool:
        """Deleted at its last release."""
    @property
    def replace(self) -> bool:
        """The name may be taken: the put becomes its next version."""
    @property
    def keep_reference(self) -> bool:
        """The put answers with the store's copy (an ``Object``), else its id or None."""
    @property
    def pipelined(self) -> bool:
        """The put may return before the store's answer (``Client.sync`` reports failures);
        a kept one only on a client with ``release_delay``."""
    @property
    def writable(self) -> bool:
        """A kept result is writable (a private mapping, or in place for this client's own
        large objects)."""
    @property
    def device(self) -> Optional[int]:
        """The CUDA device named, or None (host memory)."""

# (kind, itemsize, shape): how a kept result shows its bytes to numpy.
_Layout = Tuple[str, int, Sequence[int]]

# --- client.rs -------------------------------------------------------------------------------

@final
class Client:
    """A connection to a ``vovp-engine`` daemon."""

    def __init__(
        self,
        path: Union[str, os.PathLike[str]],
        connect_timeout: float = 0.0,
        reconnect: bool = False,
        release_delay: float = 0.0,
        shared_reads: bool = True,
        lend_puts: bool = True,
        pipelined_puts: bool = True,
    ) -> None: ...
    @property
    def capacity(self) -> int: ...
    @property
    def max_inline(self) -> int: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...
    def get(
        self, names: Sequence[str], timeout: Optional[float] = None, writable: bool = False
    ) -> builtins.list[Optional[Object]]: ...
    def get1(
        self,
        name: str,
        timeout: Optional[float] = None,
        writable: bool = False,
        newer_than: int = 0,
    ) -> Optional[Object]:
        """``newer_than``: only a version above it is found (and waited for)."""
    def put_with(
        self,
        name: str,
        src: Any,
        options: PutOptions,
        metadata: bytes = b"",
        layout: Optional[_Layout] = None,
        framework: Optional[int] = None,
    ) -> Union[Object, int, None]:
        """The one put: the bytes of C-contiguous array ``src`` with ``metadata`` as object
        ``name``, the way the Rust client's route picks. Kept: the store's copy (shown with
        ``layout`` when given; pending while a pipelined put's answer is unread); else the new
        object's id, or None when ``pipelined``. With ``framework``, ``src`` is a tensor stored
        as it is: its header and layout made from the array (``metadata``, ``layout`` unused),
        None, nothing sent, for an array that cannot be."""
    def put_batch(
        self,
        items: Sequence[Tuple[str, Any, bytes, Optional[_Layout], bool]],
        options: PutOptions,
    ) -> builtins.list[Union[Object, int, None, BaseException]]:
        """``put_with`` of each (name, src, metadata, layout, writable) with ``options`` (the
        item's ``writable`` or the options'), kept ones batched (the small lend in one write,
        those that wait inline in one round trip): per item its result or its exception."""
    def create(
        self,
        name: str,
        size: int,
        metadata: bytes = b"",
        ephemeral: bool = False,
        device: Optional[int] = None,
        replace: bool = False,
        version: Optional[int] = None,
    ) -> Buffer: ...
    def sync(self) -> None: ...
    def seal_later(self, name: str) -> None: ...
    @property
    def unread_replies(self) -> int: ...
    @property
    def last_request_id(self) -> int: ...
    def seal(self, name: str) -> int:
        """The name's version the object became."""
    def abort(self, name: str) -> None: ...
    def contains(self, name: str) -> bool: ...
    def delete(self, name: str) -> None: ...
    def evict(self, nbytes: int) -> int: ...
    def list(self) -> builtins.list[dict[str, Any]]:
        """Dicts with name (str), id, size (int), device ("cpu"/"cuda"), device_type,
        device_id (int), sealed, ephemeral (bool), refcount (int), last_access (float, unix
        seconds), metadata (bytes), version (int)."""
    def make_writable(self, obj: Object) -> None: ...
    def subscribe(self) -> Subscription: ...
    def stats(self) -> dict[str, int]: ...
    def fetch_from(
        self,
        source: str,
        name: str,
        version: int,
        streams: int = 0,
        timeout: Optional[float] = None,
        base_version: Optional[int] = None,
        base_ranges: Optional[Sequence[Tuple[int, int]]] = None,
        writable: bool = False,
    ) -> Object:
        """FETCH: ``name`` at ``version`` copied engine to engine from ``source``
        (``"ip:port"``, the holder's ``transfer_address()``) into this store, sealed as that
        version; the object (one reference). A version this store has (or a newer one) comes
        without a transfer. ``base_version``/``base_ranges``: ``(offset, len)`` ranges copied
        from this store's older version instead. Raises ``TransferFailed``, ``StaleVersion``,
        ``ObjectNotFound`` (no such base), ``OutOfMemory``; ``VovpError`` without a key."""
    def gather_from(
        self,
        source: str,
        name: str,
        version: int,
        row_bytes: int,
        ids: Any,
        into: str,
        timeout: Optional[float] = None,
    ) -> Object:
        """GATHER: rows ``ids`` (ints, or a uint64/int64 array) of ``name`` at ``version`` on
        ``source`` as a new ephemeral object ``into`` (``len(ids) * row_bytes`` bytes, in the
        ids' order)."""
    def transfer_address(self) -> Optional[str]:
        """The engine's transfer port (``"ip:port"``), None without ``--transfer``."""
    def transfer_info(self) -> Tuple[Optional[str], dict[str, int]]:
        """The transfer port and the engine's transfer counters."""
    def metrics(self) -> str: ...
