"""DLPack export (``__dlpack__`` / ``__dlpack_device__``) for objects that are not numpy arrays
or torch tensors, which have their own: ``vovp.cuda.CudaTensor`` (a CUDA store object without
torch). Pure ctypes, no compiled code.

A capsule points to a DLManagedTensor (legacy, capsule name "dltensor") or, when the consumer
asks for DLPack >= 1.0 with ``max_version``, a DLManagedTensorVersioned ("dltensor_versioned",
with the read-only flag set for read-only objects). The struct, its shape array and the object
that keeps the memory alive live in ``_EXPORTS`` until the consumer calls the deleter (when
the tensor it made dies) or, for a capsule never consumed, the capsule's destructor does: so a
store reference lasts exactly as long as whatever was made from it.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from . import tensor as T

# DLDeviceType
KDL_CPU = 1
KDL_CUDA = 2

# DLDataTypeCode
_KDL_INT, _KDL_UINT, _KDL_FLOAT, _KDL_BFLOAT, _KDL_COMPLEX, _KDL_BOOL = 0, 1, 2, 4, 5, 6
_DL_CODES = {
    T.BOOL: _KDL_BOOL, T.INT8: _KDL_INT, T.INT16: _KDL_INT, T.INT32: _KDL_INT,
    T.INT64: _KDL_INT, T.UINT8: _KDL_UINT, T.UINT16: _KDL_UINT, T.UINT32: _KDL_UINT,
    T.UINT64: _KDL_UINT, T.FLOAT16: _KDL_FLOAT, T.BFLOAT16: _KDL_BFLOAT,
    T.FLOAT32: _KDL_FLOAT, T.FLOAT64: _KDL_FLOAT, T.COMPLEX64: _KDL_COMPLEX,
    T.COMPLEX128: _KDL_COMPLEX,
}

FLAG_READ_ONLY = 1 << 0


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),  # NULL: C-contiguous
        ("byte_offset", ctypes.c_uint64),
    ]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", _DELETER)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", _DELETER), ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


# Struct address -> (struct, shape array, keep-alive object). Entries leave through _delete.
_EXPORTS: dict[int, tuple[Any, Any, Any]] = {}
_EXPORTS_LOCK = threading.Lock()


@_DELETER
def _delete(addr):
    # Called by the consumer (any thread; ctypes takes the GIL) or by _capsule_destructor.
    try:
        with _EXPORTS_LOCK:
            entry = _EXPORTS.pop(addr, None)
        del entry  # drops the keep-alive object: the store reference goes with its last user
    except BaseException:  # noqa: BLE001 (interpreter shutdown)
        pass


_NAME_LEGACY = b"dltensor"
_NAME_VERSIONED = b"dltensor_versioned"

# Our own handle on the C API: setting argtypes on ctypes.pythonapi's functions would change
# them for every other user in the process.
_api = ctypes.PyDLL(None)
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]

_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


@_CAPSULE_DESTRUCTOR
def _capsule_destructor(capsule):
    # A consumer renames the capsule ("used_dltensor...") and owns the struct from then on;
    # a capsule still carrying its original name was never consumed: free it here.
    try:
        for name in (_NAME_LEGACY, _NAME_VERSIONED):
            if _api.PyCapsule_IsValid(capsule, name):
                _delete(_api.PyCapsule_GetPointer(capsule, name))
                return
    except BaseException:  # noqa: BLE001
        pass


def export(ptr: int, device: tuple[int, int], code: int, shape, readonly: bool, keepalive,
           max_version=None, copy=None, dl_device=None):
    """A DLPack capsule over ``shape`` elements of dtype ``code`` at ``ptr`` (C-contiguous) on
    ``device`` = (DLDeviceType, id). ``keepalive`` is held until the consumer is done.
    Arguments after ``keepalive`` are those of ``__dlpack__`` (array API 2023.12)."""
    if copy:
        raise BufferError("vovp objects are exported without a copy (copy=True refused)")
    if dl_device is not None and tuple(int(x) for x in dl_device) != tuple(device):
        raise BufferError(f"object is on DLPack device {device}, not {tuple(dl_device)}")
    shape = tuple(int(d) for d in shape)
    versioned = max_version is not None and tuple(max_version)[0] >= 1
    managed = DLManagedTensorVersioned() if versioned else DLManagedTensor()
    shape_arr = (ctypes.c_int64 * max(1, len(shape)))(*shape)
    dl = managed.dl_tensor
    dl.data = ptr
    dl.device = DLDevice(*device)
    dl.ndim = len(shape)
    dl.dtype = DLDataType(_DL_CODES[code], 8 * T.ITEMSIZE[code], 1)
    dl.shape = ctypes.cast(shape_arr, ctypes.POINTER(ctypes.c_int64))
    dl.strides = None
    dl.byte_offset = 0
    managed.deleter = _delete
    if versioned:
        managed.version = DLPackVersion(1, 0)
        managed.flags = FLAG_READ_ONLY if readonly else 0
    addr = ctypes.addressof(managed)
    with _EXPORTS_LOCK:
        _EXPORTS[addr] = (managed, shape_arr, keepalive)
    try:
        name = _NAME_VERSIONED if versioned else _NAME_LEGACY
        return _api.PyCapsule_New(addr, name, ctypes.cast(_capsule_destructor, ctypes.c_void_p))
    except BaseException:
        _delete(addr)
        raise


def pending_exports() -> int:
    """Capsules (or tensors made from them) still holding their object."""
    return len(_EXPORTS)

