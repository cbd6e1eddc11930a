"""CUDA support of the pure-Python client: the driver through ctypes, IPC mappings, copies.

The driver (``libcuda.so.1``, then ``libcuda.so``) is loaded at first use, never at import, so
``import vovp`` works on machines without a GPU. Every way the driver can be unusable (library
missing, an entry point missing, ``cuInit`` failing, no device) becomes
``vovp.GpuUnavailable(reason)``; the reason is computed once and cached, since none of them
fixes itself while the process runs.

This mirrors the Rust client (``gpu/src/ipc.rs``, ``gpu/src/driver.rs``):

* Everything runs in each device's **primary context** (the one the CUDA runtime, hence
  PyTorch and CuPy, uses), so the pointers handed out are valid in those frameworks without any
  context juggling. Primary contexts are retained once and never released: releasing the last
  reference would destroy every allocation in them, and re-creating one costs ~100 ms.
  Unlike the Rust client, each batch of driver calls *restores* the context that was current on
  the calling thread before (get / set / set back): a Python thread may be running torch code on
  another device, and changing its current context would change ``torch.cuda.current_device()``
  under its feet. (``cuCtxPushCurrent`` would do the same, but get/set is what the fake driver
  of ``gpu/fake-cuda`` implements.)
* Store pools are mapped by the native core (the gpu crate's ``vovp_gpu::ipc``), once per
  (device, pool, handle) and closed with their last view; this module checks the driver (the
  clear GpuUnavailable reasons) and does the copies.
* Copies run on a pooled, blocking stream of the device's primary context and synchronise it
  before returning, so the bytes are in place (and a source buffer may be freed) when the call
  returns. A synchronous ``cuMemcpyDtoD`` is *not* synchronous with respect to the host, which
  is why the stream is needed.

Limits (same as Rust): a process cannot open an IPC handle it exported itself (only the daemon
exports), and device ordinals are the daemon's: client and daemon must see the same devices in
the same order (same ``CUDA_VISIBLE_DEVICES``). CUDA does not survive ``fork``: a forked child
gets ``GpuUnavailable``.
"""

from __future__ import annotations

import ctypes
import os
import threading

import numpy as np

from . import tensor as T
from .errors import GpuError, GpuUnavailable

__all__ = [
    "CudaTensor",
    "available",
    "unavailable_reason",
    "device_count",
    "mem_alloc",
    "mem_free",
    "copy_d2d",
    "copy_h2d",
    "copy_d2h",
    "open_pools",
    "device_of",
    "sync_stream",
    "DeviceBuffer",
]

# Tried in this order: the versioned name is what the NVIDIA driver package always installs;
# the unversioned one only comes with development packages (and the fake driver has both).
LIBRARY_NAMES = ("libcuda.so.1", "libcuda.so")

CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CU_STREAM_DEFAULT = 0  # blocking: ordered after work on the legacy default stream
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_DEINITIALIZED = 4

CUdeviceptr = ctypes.c_ulonglong


class CUipcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


# Entry points: (python name, candidate symbols newest first, argtypes). The ``_v2`` symbols are
# the 64-bit-size ABI every driver since CUDA 3.2 exports; the plain names are a fallback.
_VP = ctypes.c_void_p
_SIGNATURES = [
    ("cuInit", ("cuInit",), [ctypes.c_uint]),
    ("cuDeviceGetCount", ("cuDeviceGetCount",), [ctypes.POINTER(ctypes.c_int)]),
    ("cuDeviceGet", ("cuDeviceGet",), [ctypes.POINTER(ctypes.c_int), ctypes.c_int]),
    ("cuDevicePrimaryCtxRetain", ("cuDevicePrimaryCtxRetain",),
     [ctypes.POINTER(_VP), ctypes.c_int]),
    ("cuCtxSetCurrent", ("cuCtxSetCurrent",), [_VP]),
    ("cuCtxGetCurrent", ("cuCtxGetCurrent",), [ctypes.POINTER(_VP)]),
    ("cuIpcOpenMemHandle", ("cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"),
     [ctypes.POINTER(CUdeviceptr), CUipcMemHandle, ctypes.c_uint]),
    ("cuIpcCloseMemHandle", ("cuIpcCloseMemHandle",), [CUdeviceptr]),
    ("cuMemGetAddressRange", ("cuMemGetAddressRange_v2", "cuMemGetAddressRange"),
     [ctypes.POINTER(CUdeviceptr), ctypes.POINTER(ctypes.c_size_t), CUdeviceptr]),
    ("cuMemAlloc", ("cuMemAlloc_v2", "cuMemAlloc"),
     [ctypes.POINTER(CUdeviceptr), ctypes.c_size_t]),
    ("cuMemFree", ("cuMemFree_v2", "cuMemFree"), [CUdeviceptr]),
    ("cuPointerGetAttribute", ("cuPointerGetAttribute",), [_VP, ctypes.c_int, CUdeviceptr]),
    ("cuStreamCreate", ("cuStreamCreate",), [ctypes.POINTER(_VP), ctypes.c_uint]),
    ("cuStreamSynchronize", ("cuStreamSynchronize",), [_VP]),
    ("cuStreamDestroy", ("cuStreamDestroy_v2", "cuStreamDestroy"), [_VP]),
    ("cuMemcpyDtoDAsync", ("cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync"),
     [CUdeviceptr, CUdeviceptr, ctypes.c_size_t, _VP]),
    ("cuMemcpyHtoDAsync", ("cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync"),
     [CUdeviceptr, _VP, ctypes.c_size_t, _VP]),
    ("cuMemcpyDtoHAsync", ("cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync"),
     [_VP, CUdeviceptr, ctypes.c_size_t, _VP]),
]


class _Driver:
    """The loaded library, its entry points, and the device count."""

    def __init__(self, lib, fns, count):
        self.lib = lib
        self.count = count
        for name, fn in fns.items():
            setattr(self, name, fn)
        self.cuGetErrorName = _optional(lib, "cuGetErrorName")
        self.cuGetErrorString = _optional(lib, "cuGetErrorString")

    def describe(self, code: int) -> str:
        """``CUDA_ERROR_NO_DEVICE (no CUDA-capable device is detected)``, or the number."""
        return _describe(self.cuGetErrorName, self.cuGetErrorString, code)

    def check(self, what: str, code: int) -> None:
        if code != 0:
            raise GpuError(f"{what}: {self.describe(code)}", 0)


def _optional(lib, symbol):
    try:
        fn = getattr(lib, symbol)
    except AttributeError:
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return fn


def _describe(get_name, get_string, code: int) -> str:
    def text(fn):
        if fn is None:
            return None
        p = ctypes.c_char_p()
        try:
            if fn(code, ctypes.byref(p)) == 0 and p.value:
                return p.value.decode("utf-8", "replace")
        except Exception:  # noqa: BLE001 (a description must never fail)
            pass
        return None

    name = text(get_name) or f"CUresult {code}"
    s = text(get_string)
    return f"{name} ({s})" if s else name


# --- process-wide state ----------------------------------------------------------------------

_STATE_LOCK = threading.Lock()
_DRIVER = None  # _Driver once loaded
_FAILURE = None  # reason string once loading failed (cached: it does not fix itself)
_PID = None  # process that loaded the driver (CUDA does not survive fork)
_CONTEXTS: dict = {}  # ordinal -> c_void_p primary context (retained forever)
_STREAMS: dict = {}  # ordinal -> [idle stream handles]
_STREAMS_LOCK = threading.Lock()


def _load() -> _Driver:
    """Load and initialise the driver; raise GpuUnavailable(reason) if it cannot be used."""
    lib = None
    errors = []
    for name in LIBRARY_NAMES:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError as e:
            errors.append(str(e))
    if lib is None:
        raise GpuUnavailable(
            "the CUDA driver library (libcuda.so.1 / libcuda.so) was not found: no NVIDIA driver "
            "is installed, or its directory is not on the library path (LD_LIBRARY_PATH) "
            f"[{'; '.join(errors)}]", 10)
    fns = {}
    for pyname, symbols, argtypes in _SIGNATURES:
        fn = None
        for s in symbols:
            try:
                fn = getattr(lib, s)
                break
            except AttributeError:
                continue
        if fn is None:
            raise GpuUnavailable(
                f"the CUDA driver library has no {symbols[0]}: the driver is too old", 10)
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes
        fns[pyname] = fn
    err_name = _optional(lib, "cuGetErrorName")
    err_str = _optional(lib, "cuGetErrorString")
    rc = fns["cuInit"](0)
    if rc != 0:
        raise GpuUnavailable(f"cuInit: {_describe(err_name, err_str, rc)}", 10)
    n = ctypes.c_int(0)
    rc = fns["cuDeviceGetCount"](ctypes.byref(n))
    if rc != 0:
        raise GpuUnavailable(f"cuDeviceGetCount: {_describe(err_name, err_str, rc)}", 10)
    if n.value <= 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        extra = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise GpuUnavailable(f"the CUDA driver sees no device{extra}", 10)
    return _Driver(lib, fns, n.value)


def driver() -> _Driver:
    """The initialised driver, loading it on first use; GpuUnavailable(reason) otherwise."""
    global _DRIVER, _FAILURE, _PID
    d = _DRIVER
    if d is not None and _PID == os.getpid():
        return d
    with _STATE_LOCK:
        if _PID is not None and _PID != os.getpid():
            raise GpuUnavailable(
                "CUDA cannot be used in a process forked from one that initialised it; start "
                "the child with the 'spawn' method", 10)
        if _DRIVER is None:
            if _FAILURE is not None:
                raise GpuUnavailable(_FAILURE, 10)
            try:
                _DRIVER = _load()
            except GpuUnavailable as e:
                _FAILURE = e.message
                raise
            _PID = os.getpid()
        return _DRIVER


def available() -> bool:
    """Whether this process can use CUDA (loads the driver on first call)."""
    try:
        driver()
        return True
    except GpuUnavailable:
        return False


def unavailable_reason():
    """Why CUDA cannot be used here, or None when it can."""
    try:
        driver()
        return None
    except GpuUnavailable as e:
        return e.message


def device_count() -> int:
    """Number of devices the driver sees; GpuUnavailable without a usable driver."""
    return driver().count


def _reset_for_tests(library_names=None) -> None:
    """Forget the loaded driver (tests simulate a missing driver with a bogus library name).

    Mappings, contexts and streams are dropped from the tables without closing anything: only
    for tests that hold no views.
    """
    global _DRIVER, _FAILURE, _PID, LIBRARY_NAMES
    with _STATE_LOCK:
        _DRIVER = _FAILURE = _PID = None
        _CONTEXTS.clear()
        _STREAMS.clear()
        if library_names is not None:
            LIBRARY_NAMES = tuple(library_names)


def _after_fork_in_child():
    # The parent's contexts, streams and mappings do not exist in the child; the locks may have
    # been held by parent threads. _PID stays the parent's, so driver() refuses (see above).
    global _STATE_LOCK, _STREAMS_LOCK
    _STATE_LOCK = threading.Lock()
    _STREAMS_LOCK = threading.Lock()
    _CONTEXTS.clear()
    _STREAMS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


# --- contexts --------------------------------------------------------------------------------


class _InContext:
    """``with _InContext(d, device):`` runs driver calls in ``device``'s primary context and
    restores the thread's previous context afterwards (see the module docstring)."""

    __slots__ = ("d", "ctx", "prev")

    def __init__(self, d: _Driver, device: int):
        self.d = d
        self.ctx = _primary(d, device)
        self.prev = None

    def __enter__(self):
        d = self.d
        cur = _VP()
        d.check("cuCtxGetCurrent", d.cuCtxGetCurrent(ctypes.byref(cur)))
        if cur.value != self.ctx.value:
            d.check("cuCtxSetCurrent", d.cuCtxSetCurrent(self.ctx))
            self.prev = cur
        return self

    def __exit__(self, *exc):
        if self.prev is not None:
            # Best effort: failing to restore must not hide the real error (if any).
            self.d.cuCtxSetCurrent(self.prev)
            self.prev = None


def _primary(d: _Driver, device: int) -> _VP:
    device = int(device)
    if not 0 <= device < d.count:
        raise GpuUnavailable(
            f"cuda:{device} does not exist: the driver sees {d.count} device(s) "
            f"(cuda:0..cuda:{d.count - 1})", 10)
    ctx = _CONTEXTS.get(device)
    if ctx is not None:
        return ctx
    with _STATE_LOCK:
        ctx = _CONTEXTS.get(device)
        if ctx is None:
            dev = ctypes.c_int(0)
            rc = d.cuDeviceGet(ctypes.byref(dev), device)
            if rc != 0:
                raise GpuUnavailable(f"cuDeviceGet({device}): {d.describe(rc)}", 10)
            ctx = _VP()
            rc = d.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
            if rc != 0:
                raise GpuUnavailable(f"cuDevicePrimaryCtxRetain(cuda:{device}): "
                                     f"{d.describe(rc)}", 10)
            _CONTEXTS[device] = ctx
    return ctx


def device_of(ptr: int) -> int:
    """Ordinal of the device whose memory ``ptr`` points into (GpuError if it is not device
    memory)."""
    d = driver()
    ordinal = ctypes.c_int(-1)
    # The query needs some current context; device 0's does (addresses are unified).
    with _InContext(d, 0):
        rc = d.cuPointerGetAttribute(ctypes.byref(ordinal), CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                     CUdeviceptr(int(ptr)))
    if rc != 0 or ordinal.value < 0:
        raise GpuError(f"{int(ptr):#x} is not CUDA device memory: {d.describe(rc)}", 0)
    return ordinal.value


# --- copies ----------------------------------------------------------------------------------


def _on_stream(d: _Driver, device: int, what: str, issue) -> None:
    """Run ``issue(stream) -> CUresult`` on a pooled stream of ``device``, then wait for it.

    Pooled so that concurrent copies from several threads each get their own stream instead of
    serialising on one.
    """
    with _InContext(d, device):
        with _STREAMS_LOCK:
            idle = _STREAMS.get(device)
            stream = idle.pop() if idle else None
        if stream is None:
            stream = _VP()
            d.check("cuStreamCreate", d.cuStreamCreate(ctypes.byref(stream), CU_STREAM_DEFAULT))
        ok = False
        try:
            d.check(what, issue(stream))
            d.check("cuStreamSynchronize", d.cuStreamSynchronize(stream))
            ok = True
        finally:
            if ok:
                with _STREAMS_LOCK:
                    _STREAMS.setdefault(device, []).append(stream)
            else:  # after an error the stream may be unusable: do not reuse it
                d.cuStreamDestroy(stream)


def copy_d2d(dst: int, src: int, nbytes: int, device: int) -> None:
    """Copy ``nbytes`` of device memory ``src`` to ``dst`` and wait; runs on ``dst``'s device
    (``device``). Both may be on any device (unified addressing)."""
    if nbytes <= 0:
        return
    d = driver()
    _on_stream(d, device, "cuMemcpyDtoDAsync",
               lambda s: d.cuMemcpyDtoDAsync(CUdeviceptr(dst), CUdeviceptr(src), nbytes, s))


def _host_address(buf, writable: bool):
    """(address, nbytes, keep-alive) of a C-contiguous host buffer."""
    a = np.asarray(memoryview(buf).cast("B")) if not isinstance(buf, np.ndarray) else buf
    if not a.flags.c_contiguous:
        raise ValueError("host buffers for CUDA copies must be C-contiguous")
    if writable and not a.flags.writeable:
        raise ValueError("the destination host buffer is read-only")
    return a.__array_interface__["data"][0], a.nbytes, a


def copy_h2d(dst: int, src, device: int) -> None:
    """Copy a host buffer (bytes-like or C-contiguous array) to device memory ``dst``, wait."""
    addr, n, keep = _host_address(src, False)
    if n == 0:
        return
    d = driver()
    _on_stream(d, device, "cuMemcpyHtoDAsync",
               lambda s: d.cuMemcpyHtoDAsync(CUdeviceptr(dst), _VP(addr), n, s))
    del keep


def copy_d2h(dst, src: int, device: int) -> None:
    """Copy device memory ``src`` into a writable host buffer ``dst`` (all of it), wait."""
    addr, n, keep = _host_address(dst, True)
    if n == 0:
        return
    d = driver()
    _on_stream(d, device, "cuMemcpyDtoHAsync",
               lambda s: d.cuMemcpyDtoHAsync(_VP(addr), CUdeviceptr(src), n, s))
    del keep


def sync_stream(stream) -> None:
    """Wait for a stream named the way ``__cuda_array_interface__`` v3 does (1 = legacy
    default stream, 2 = per-thread default stream, other = a CUstream handle). These are also
    the driver's own handle values (CU_STREAM_LEGACY, CU_STREAM_PER_THREAD), so one call does."""
    if stream is None:
        return
    d = driver()
    d.check("cuStreamSynchronize", d.cuStreamSynchronize(_VP(int(stream))))


def mem_alloc(nbytes: int, device: int = 0) -> int:
    """``cuMemAlloc`` in ``device``'s primary context (tests and tools: a source buffer that is
    not store memory). Free it with ``mem_free``."""
    d = driver()
    p = CUdeviceptr(0)
    with _InContext(d, device):
        d.check("cuMemAlloc", d.cuMemAlloc(ctypes.byref(p), int(nbytes)))
    return p.value


def mem_free(ptr: int, device: int = 0) -> None:
    d = driver()
    with _InContext(d, device):
        d.check("cuMemFree", d.cuMemFree(CUdeviceptr(int(ptr))))


# --- IPC mappings ----------------------------------------------------------------------------

# Store pools are mapped by the native core (vovp._native, through the gpu crate's
# vovp_gpu::ipc: opened once per (device, pool, handle), shared by every view into it, closed
# with the last one). This module only checks the driver and copies.


def open_pools() -> int:
    """Number of store pools this process has mapped (diagnostics and tests)."""
    from . import _native  # noqa: PLC0415 (the native core imports nothing of this module)

    return _native.open_pools()


class DeviceBuffer:
    """One mapped store block: the *owner* object of a CUDA store reference.

    Holds the native object that holds the reference and the IPC mapping; the client indexes
    it (a weakref) for ``release``. Everything that exposes the memory (CudaTensor, the object
    handed to torch) holds a strong reference to it.
    """

    __slots__ = ("ptr", "nbytes", "device", "key", "_obj", "__weakref__")

    def __init__(self, ptr, nbytes, device, key=None, obj=None):
        self.ptr = ptr
        self.nbytes = nbytes
        self.device = device
        self.key = key
        self._obj = obj  # the native object: the reference and the mapping

    def __repr__(self):
        return f"<vovp DeviceBuffer cuda:{self.device} {self.nbytes} bytes at {self.ptr:#x}>"


# --- tensors ---------------------------------------------------------------------------------


def typestr(code: int, byte_order: int = T.LITTLE) -> str:
    """``__cuda_array_interface__`` typestr of a dtype code. bfloat16 has none that consumers
    understand: it is exposed as uint16 raw bits (like numpy results without ml_dtypes)."""
    if code == T.BFLOAT16:
        return "<u2" if byte_order == T.LITTLE else ">u2"
    return T.storage_dtype(code, byte_order).str


class CudaTensor:
    """A CUDA store object as a plain object (what ``get_tensor`` returns without torch).

    Zero-copy: ``ptr`` is the store's device memory, mapped into this process. It holds one
    store reference (and a view of the pool mapping) until it, and every object made from its
    ``__cuda_array_interface__`` that keeps it alive, is garbage collected, or ``release()`` is
    called. Consumers such as CuPy, Numba or ``torch.as_tensor`` accept it directly; torch
    refuses read-only arrays, so ask for ``writable=True`` (or ``framework="torch"``) there.

    Attributes: ``device`` (int ordinal), ``shape``, ``dtype`` (numpy dtype; bfloat16 is
    ``ml_dtypes.bfloat16`` or uint16 raw bits), ``dtype_name`` ("bfloat16"...), ``ptr``,
    ``nbytes``, ``readonly``, ``name``.
    """

    __slots__ = ("_owner", "shape", "dtype_code", "byte_order", "readonly", "name", "__weakref__")

    def __init__(self, owner: DeviceBuffer, code: int, shape, byte_order: int = T.LITTLE,
                 readonly: bool = True, name=None):
        self._owner = owner
        self.shape = tuple(int(s) for s in shape)
        self.dtype_code = code
        self.byte_order = byte_order
        self.readonly = bool(readonly)
        self.name = name

    @property
    def ptr(self) -> int:
        return self._owner.ptr

    @property
    def nbytes(self) -> int:
        return self._owner.nbytes

    @property
    def device(self) -> int:
        return self._owner.device

    @property
    def dtype(self) -> np.dtype:
        return T.storage_dtype(self.dtype_code, self.byte_order)

    @property
    def dtype_name(self) -> str:
        return T.DTYPE_NAMES[self.dtype_code]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def __cuda_array_interface__(self) -> dict:
        # version 3; strides None = C-contiguous; stream None = nothing to wait for (every copy
        # into the store is synchronised before the object is sealed).
        return {
            "shape": self.shape,
            "typestr": typestr(self.dtype_code, self.byte_order),
            "data": (self.ptr, self.readonly),
            "version": 3,
            "strides": None,
            "stream": None,
        }

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """DLPack capsule over the store's device memory (``torch.from_dlpack(ct)``, CuPy...),
        no copy; holds this object (and its store reference) until the consumer is done.
        ``stream`` needs no synchronisation: puts are complete before the object is sealed.
        A read-only object is flagged read-only for DLPack >= 1.0 consumers; legacy consumers
        have no such flag (sealed objects are immutable: do not write)."""
        from . import dlpack as D  # noqa: PLC0415

        if self.byte_order != T.LITTLE:
            raise BufferError("DLPack has no byte order: a big-endian object cannot be exported")
        return D.export(self.ptr, (D.KDL_CUDA, self.device), self.dtype_code, self.shape,
                        self.readonly, self, max_version, copy, dl_device)

    def __dlpack_device__(self):
        from . import dlpack as D  # noqa: PLC0415

        return (D.KDL_CUDA, self.device)

    def to_numpy(self) -> np.ndarray:
        """A host copy (device-to-host), as a new writable numpy array."""
        out = np.empty(self.shape, dtype=self.dtype)
        copy_d2h(out.reshape(-1).view(np.uint8), self.ptr, self.device)
        return out

    def release(self) -> bool:
        """Release the store reference now (see ``Client.release``); False if already done.
        Do not use the tensor, nor anything made from it, afterwards."""
        from .client import _release_owner  # noqa: PLC0415 (circular at import time)

        return _release_owner(self._owner)

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __repr__(self):
        name = f" {self.name!r}" if self.name is not None else ""
        return (f"<vovp.CudaTensor{name} cuda:{self.device} {self.dtype_name}{list(self.shape)} "
                f"at {self.ptr:#x}{' read-only' if self.readonly else ''}>")


class _TorchSource:
    """What ``torch.as_tensor`` wraps: torch Py_INCREFs it and drops it in the storage's
    deleter, so the DeviceBuffer (store reference + mapping) lives exactly as long as the
    torch storage. Never read-only: torch rejects the flag ("the read only flag is not
    supported"), as it has no read-only tensors."""

    __slots__ = ("_owner", "__cuda_array_interface__")

    def __init__(self, owner: DeviceBuffer, shape, ts: str):
        self._owner = owner
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": ts, "data": (owner.ptr, False), "version": 3,
            "strides": None, "stream": None,
        }


def to_torch(owner: DeviceBuffer, code: int, shape, byte_order: int = T.LITTLE):
    """A torch CUDA tensor aliasing ``owner``'s memory (zero-copy)."""
    import torch  # noqa: PLC0415 (optional)

    if byte_order != T.LITTLE:
        raise TypeError("torch has no big-endian tensors; use framework='cuda'")
    _, code_to = T.torch_tables()
    if code not in code_to:
        raise TypeError(f"this torch has no {T.DTYPE_NAMES[code]} dtype")
    # bfloat16 travels as int16 bits (no typestr for it) and is reinterpreted, still no copy.
    ts = "<i2" if code == T.BFLOAT16 else typestr(code)
    # device= is required: before torch 2.5 or so, as_tensor of a __cuda_array_interface__
    # object without it ends in .to(default device), i.e. a copy to the *CPU*. It must be the
    # device the pointer really lives on in this process (asked from the driver, which is what
    # torch's from_blob does too): any other device would make torch copy instead of alias, e.g.
    # when this process numbers GPUs differently from the daemon (CUDA_VISIBLE_DEVICES).
    dev = torch.device("cuda", device_of(owner.ptr))
    t = torch.as_tensor(_TorchSource(owner, shape, ts), device=dev)
    if t.data_ptr() != owner.ptr and t.numel():
        raise GpuError(f"torch copied the store's cuda:{owner.device} memory instead of "
                       f"aliasing it (got {t.device})", 0)
    if code == T.BFLOAT16:
        t = t.view(torch.bfloat16)
    return t


_TORCH_CUDA = None


def torch_cuda_usable() -> bool:
    """Whether torch is importable and sees CUDA (checked once; imports torch if installed)."""
    global _TORCH_CUDA
    if _TORCH_CUDA is None:
        try:
            import torch  # noqa: PLC0415 (optional)

            _TORCH_CUDA = bool(torch.cuda.is_available())
        except Exception:  # noqa: BLE001 (not installed, or broken)
            _TORCH_CUDA = False
    return _TORCH_CUDA


def cuda_interface(obj):
    """``obj.__cuda_array_interface__`` or None (without raising for objects that lack it;
    torch CPU tensors raise AttributeError from the property)."""
    try:
        return obj.__cuda_array_interface__
    except AttributeError:
        return None
