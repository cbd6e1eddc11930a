"""CUDA support of the Python client: driver checks, device copies and IPC mappings, all done by
the native core (``vovp._native``) through the gpu crate (``gpu/src/driver.rs``,
``gpu/src/ipc.rs``), the same code the Rust client uses. No driver is loaded from Python.

The driver (``libcuda.so``, ``libcuda.so.1``... the names cudarc tries) is loaded at first use,
never at import, so ``import vovp`` works on machines without a GPU. Every way the driver can be
unusable (library missing, an entry point missing, ``cuInit`` failing, no device) becomes
``vovp.GpuUnavailable(reason)``; the reason is computed once and cached (by the gpu crate),
since none of them fixes itself while the process runs. Every native call releases the GIL
around the driver.

* Everything runs in each device's **primary context** (the one the CUDA runtime, hence
  PyTorch and CuPy, uses), so the pointers handed out are valid in those frameworks without any
  context juggling. Primary contexts are retained once and never released: releasing the last
  reference would destroy every allocation in them, and re-creating one costs ~100 ms.
  Each batch of driver calls *restores* the context that was current on the calling thread
  before (get / set / set back, in the gpu crate): a Python thread may be running torch code on
  another device, and changing its current context would change ``torch.cuda.current_device()``
  under its feet.
* Store pools are mapped by the native core (``vovp_gpu::ipc``), once per (device, pool,
  handle) and closed with their last view.
* Copies run on a pooled, blocking stream of the device's primary context and synchronise it
  before returning, so the bytes are in place (and a source buffer may be freed) when the call
  returns. A synchronous ``cuMemcpyDtoD`` is *not* synchronous with respect to the host, which
  is why the stream is needed.

Limits (same as Rust): a process cannot open an IPC handle it exported itself (only the daemon
exports), and device ordinals are the daemon's: client and daemon must see the same devices in
the same order (same ``CUDA_VISIBLE_DEVICES``). CUDA does not survive ``fork``: a child forked
from a process that initialised the driver gets ``GpuUnavailable``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _lease, _native
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


def driver() -> int:
    """Check that this process can use CUDA, loading the driver on first use: the device count,
    or GpuUnavailable(reason)."""
    return _native.cuda_device_count()


def available() -> bool:
    """Whether this process can use CUDA (loads the driver on first call)."""
    return unavailable_reason() is None


def unavailable_reason():
    """Why CUDA cannot be used here, or None when it can."""
    try:
        driver()
        return None
    except GpuUnavailable as e:
        return e.message


def device_count() -> int:
    """Number of devices the driver sees; GpuUnavailable without a usable driver."""
    return driver()


def _reset_for_tests(library_names=None) -> None:
    """Tests: act as if the driver library were looked up under ``library_names`` (the native
    core's hook, ``vovp_gpu::simulate_library_names``). If none of them loads, every CUDA call
    raises GpuUnavailable with the missing-library reason, as on a machine without a driver;
    ``None`` (or a name that loads) goes back to this process's real driver. The library already
    loaded stays loaded, and mappings, contexts and streams are kept: this only simulates a
    *missing* driver."""
    _native._cuda_simulate_library_names(
        None if library_names is None else [str(n) for n in library_names])


def device_of(ptr: int) -> int:
    """Ordinal of the device whose memory ``ptr`` points into (GpuError if it is not device
    memory)."""
    return _native.cuda_device_of(int(ptr))


# --- copies ----------------------------------------------------------------------------------


def copy_d2d(dst: int, src: int, nbytes: int, device: int) -> None:
    """Copy ``nbytes`` of device memory ``src`` to ``dst`` and wait; runs on ``dst``'s device
    (``device``). Both may be on any device (unified addressing)."""
    if nbytes <= 0:
        return
    _native.cuda_copy_d2d(int(device), int(dst), int(src), int(nbytes))


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
    # ``keep`` holds the buffer for the call: the native side copies from its address.
    _native.cuda_copy_h2d(int(device), int(dst), addr, n)
    del keep


def copy_d2h(dst, src: int, device: int) -> None:
    """Copy device memory ``src`` into a writable host buffer ``dst`` (all of it), wait."""
    addr, n, keep = _host_address(dst, True)
    if n == 0:
        return
    _native.cuda_copy_d2h(int(device), addr, int(src), n)
    del keep


def sync_stream(stream) -> None:
    """Wait for a stream named the way ``__cuda_array_interface__`` v3 does (1 = legacy
    default stream, 2 = per-thread default stream, other = a CUstream handle). These are also
    the driver's own handle values (CU_STREAM_LEGACY, CU_STREAM_PER_THREAD), so one call does."""
    if stream is None:
        return
    _native.cuda_sync_stream(int(stream))


def mem_alloc(nbytes: int, device: int = 0) -> int:
    """``cuMemAlloc`` in ``device``'s primary context (tests and tools: a source buffer that is
    not store memory). Free it with ``mem_free``."""
    return _native.cuda_mem_alloc(int(device), int(nbytes))


def mem_free(ptr: int, device: int = 0) -> None:
    _native.cuda_mem_free(int(device), int(ptr))


# --- IPC mappings ----------------------------------------------------------------------------

# Store pools are mapped by the native core (vovp._native, through the gpu crate's
# vovp_gpu::ipc: opened once per (device, pool, handle), shared by every view into it, closed
# with the last one).


def open_pools() -> int:
    """Number of store pools this process has mapped (diagnostics and tests)."""
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
    def __cuda_array_interface__(self) -> dict[str, Any]:
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
        return _lease.release_owner(self._owner)

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __repr__(self):
        name = f" {self.name!r}" if self.name is not None else ""
        return (f"<vovp.CudaTensor{name} cuda:{self.device} {self.dtype_name}{list(self.shape)} "
                f"at {self.ptr:#x}{' read-only' if self.readonly else ''}>")


def lease_of_tensor(t: CudaTensor) -> Any:
    """The lease (``vovp._lease.Lease``) of the store reference ``t`` holds, or None once it
    was released (``find_lease`` of a CudaTensor)."""
    return _lease.lease_of(t._owner)


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
