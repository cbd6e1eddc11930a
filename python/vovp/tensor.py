"""Tensor metadata header (PROTOCOL.md "Tensor metadata", version 1) and dtype mapping.

    offset size  field
    0      4     magic "VTNS"
    4      1     version = 1
    5      1     dtype code
    6      1     device_type (DLPack: 1 CPU, 2 CUDA)
    7      1     byte_order: 0 little-endian, 1 big-endian
    8      4     u32 device_id
    12     4     u32 ndim
    16     8*ndim i64 shape
    then optional extension fields (readers ignore the ones they do not know):
    16+8*ndim  1  u8 framework the data came from: 0 unspecified, 1 numpy, 2 torch

Framework: ``put_tensor`` of a torch tensor records 2, so that ``get_tensor`` in another
process returns a torch tensor again (when torch can be imported there); numpy input writes
no extension at all, so its headers are byte-for-byte the version-1 headers of before.

Byte order: the client always *stores* little-endian data (big-endian input is byte-swapped
during the copy into the store, and the header says 0), but it honours a header that says
big-endian (written by another client) by returning an array with a big-endian dtype.

bfloat16: numpy has no bfloat16. With torch, bfloat16 tensors round-trip as torch.bfloat16.
For numpy results, a bfloat16 object is returned with ``ml_dtypes.bfloat16`` when that package
is importable, otherwise as a ``uint16`` array of the raw bits (same memory, zero-copy; use
``torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)`` or ml_dtypes to reinterpret it).
A numpy array whose dtype is named "bfloat16" (ml_dtypes) is stored as bfloat16.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Sequence, Tuple

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt
    import torch

    # put_plan's result: (code, dtype to store as, dtype of the result, header).
    PutPlan = Tuple[int, np.dtype[Any], np.dtype[Any], bytes]
    # plan_host_put's result: (numpy view of the data, code, dtype to store as, dtype of the
    # result, header, torch input).
    HostPut = Tuple[npt.NDArray[Any], int, np.dtype[Any], np.dtype[Any], bytes, bool]
    # get_plan's result: (code, view dtype, shape, nbytes, device_type, framework).
    GetPlan = Tuple[int, np.dtype[Any], Tuple[int, ...], int, int, int]

from . import _native
from .errors import GpuUnavailable, ProtocolError

# The header's format is the Rust one (types/src/tensor.rs, vovp_types::TensorMeta): encoded
# and decoded there, through vovp._native; these constants are what it writes.
MAGIC = _native.TENSOR_MAGIC  # b"VTNS"
VERSION = _native.TENSOR_VERSION  # 1
HEADER_SIZE = _native.TENSOR_HEADER_SIZE  # 16
MAX_NDIM = _native.MAX_NDIM
_encode = _native.encode_tensor_header
_decode = _native.decode_tensor_header

# Framework codes of the extension byte (see the module docstring).
FRAMEWORK_UNSPECIFIED = 0
FRAMEWORK_NUMPY = 1
FRAMEWORK_TORCH = 2

DEVICE_CPU = 1
DEVICE_CUDA = 2
LITTLE = 0
BIG = 1

BOOL, INT8, INT16, INT32, INT64 = 1, 2, 3, 4, 5
UINT8, UINT16, UINT32, UINT64 = 6, 7, 8, 9
FLOAT16, BFLOAT16, FLOAT32, FLOAT64, COMPLEX64, COMPLEX128 = 10, 11, 12, 13, 14, 15

# The engine's dtypes (vovp::DType): code -> numpy-style name, code -> item size in bytes.
DTYPE_NAMES = {code: name for code, name, _ in _native.DTYPES}
ITEMSIZE = {code: size for code, _, size in _native.DTYPES}

# numpy dtype (native byte order) -> code. Keyed on dtype objects, which hash by value.
_NP_TO_CODE = {np.dtype(name): code for code, name in DTYPE_NAMES.items() if code != BFLOAT16}
# (code, byte_order) -> numpy dtype of the stored data.
_CODE_TO_NP: dict[Tuple[int, int], np.dtype[Any]] = {}
for _code, _name in DTYPE_NAMES.items():
    if _code == BFLOAT16:
        continue
    _dt = np.dtype(_name)
    _CODE_TO_NP[(_code, LITTLE)] = _dt.newbyteorder("<")
    _CODE_TO_NP[(_code, BIG)] = _dt.newbyteorder(">")

def _bfloat16_numpy() -> Optional[np.dtype[Any]]:
    """ml_dtypes' bfloat16 numpy dtype, or None."""
    global _BF16_NP
    if _BF16_NP is _UNSET:
        try:
            import ml_dtypes  # noqa: PLC0415 (optional)
            _BF16_NP = np.dtype(ml_dtypes.bfloat16)
        except Exception:  # not installed, or broken
            _BF16_NP = None
    return _BF16_NP  # type: ignore[return-value] # (set above: not _UNSET)


_UNSET = object()
_BF16_NP: object = _UNSET


class TensorMeta(NamedTuple):
    """Decoded tensor header."""

    dtype_code: int
    shape: Tuple[int, ...]
    byte_order: int = LITTLE
    device_type: int = DEVICE_CPU
    device_id: int = 0
    framework: int = FRAMEWORK_UNSPECIFIED

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.dtype_code]

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype_code]

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for d in self.shape:
            n *= d
        return n


def encode_header(code: int, shape: Sequence[int], byte_order: int = LITTLE,
                  device_type: int = DEVICE_CPU,
                  device_id: int = 0, framework: int = FRAMEWORK_UNSPECIFIED) -> bytes:
    """The header (the engine's ``TensorMeta::encode``, through ``vovp._native``)."""
    shape = tuple(shape)
    ndim = len(shape)
    if ndim > MAX_NDIM:
        raise ValueError(f"tensors have at most {MAX_NDIM} dimensions, got {ndim}")
    # Unspecified writes nothing: such headers stay readable by readers older than the field.
    return _encode(code, shape, byte_order, device_type, device_id, framework)


def is_tensor_header(meta: bytes) -> bool:
    return len(meta) >= HEADER_SIZE and meta[:4] == MAGIC


def decode_header(meta: bytes | bytearray | memoryview) -> TensorMeta:
    """Parse a tensor header (the engine's ``TensorMeta::decode``, through ``vovp._native``);
    ProtocolError when it is not one this client understands. An unknown framework code (a
    newer writer) is a hint this client cannot follow: it reads as unspecified."""
    return TensorMeta(*_decode(meta if type(meta) is bytes else bytes(meta)))


# --- numpy ---------------------------------------------------------------------------------


def numpy_code(dtype: np.dtype[Any]) -> int:
    """Protocol dtype code of a numpy dtype (any byte order)."""
    code = _NP_TO_CODE.get(dtype if dtype.isnative else dtype.newbyteorder("="))
    if code is None:
        if dtype.name == "bfloat16":  # ml_dtypes
            return BFLOAT16
        raise TypeError(f"vovp cannot store numpy dtype {dtype!r}; supported: "
                        + ", ".join(DTYPE_NAMES.values()))
    return code


def storage_dtype(code: int, byte_order: int = LITTLE) -> np.dtype[Any]:
    """numpy dtype to view stored data with (bfloat16: ml_dtypes' or uint16 raw bits)."""
    dt = _CODE_TO_NP.get((code, byte_order))
    if dt is not None:
        return dt
    if code == BFLOAT16:
        bf = _bfloat16_numpy()
        if bf is not None and byte_order == LITTLE:
            return bf
        return np.dtype("<u2" if byte_order == LITTLE else ">u2")
    raise ProtocolError(f"unknown tensor dtype code {code}")


def little_endian_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype the store keeps for numpy input of ``dtype`` (data converted on copy)."""
    if dtype.byteorder == ">" or (dtype.byteorder == "=" and not np.little_endian):
        return dtype.newbyteorder("<")
    return dtype


# --- per-(dtype, shape) plans, cached: small puts and gets of the same kind of tensor are the
# hot path, and building/parsing headers would otherwise dominate the client's own cost.

_PUT_PLANS: dict[Any, PutPlan] = {}
_GET_PLANS: dict[bytes, GetPlan] = {}
_PLAN_CACHE_MAX = 4096


def put_plan(dtype: np.dtype[Any], shape: Tuple[int, ...], code: Optional[int] = None,
             framework: int = FRAMEWORK_UNSPECIFIED) -> PutPlan:
    """(code, dtype to store the data as, dtype of the returned view, header) for input data
    of numpy ``dtype``; ``code`` overrides the dtype code (torch bfloat16 viewed as int16),
    ``framework`` is recorded in the header."""
    key = (dtype, shape, code, framework)
    plan = _PUT_PLANS.get(key)
    if plan is None:
        if code is None:
            code = numpy_code(dtype)
        plan = (code, little_endian_dtype(dtype), storage_dtype(code),
                encode_header(code, shape, framework=framework))
        if len(_PUT_PLANS) >= _PLAN_CACHE_MAX:
            _PUT_PLANS.clear()
        _PUT_PLANS[key] = plan
    return plan


def get_plan(meta: bytes) -> GetPlan:
    """(code, view dtype, shape, nbytes, device_type, framework) for a tensor header;
    ProtocolError if bad."""
    plan = _GET_PLANS.get(meta)
    if plan is None:
        m = decode_header(meta)
        plan = (m.dtype_code, storage_dtype(m.dtype_code, m.byte_order), m.shape, m.nbytes,
                m.device_type, m.framework)
        if len(_GET_PLANS) >= _PLAN_CACHE_MAX:
            _GET_PLANS.clear()
        _GET_PLANS[meta] = plan
    return plan


def plan_host_put(t: Any) -> Optional[HostPut]:
    """``put_tensor``'s planning, the one step ``Client.put_tensor``, ``Client.put_tensors``
    and vovp.reduction's hand-offs share: (numpy view of the data, code, dtype to store as,
    dtype of the result, header, torch input) for a numpy array, a CPU torch tensor or
    anything numpy takes; None for a CUDA tensor (a CUDA torch tensor, or an object with
    ``__cuda_array_interface__``), which ``vovp._client_cuda`` puts. GpuUnavailable for a
    torch tensor on any other device. Common cases first: a numpy array, a plain CPU torch
    tensor (numpy's view of it)."""
    code: Optional[int] = None
    framework = FRAMEWORK_UNSPECIFIED
    torch_in = False
    if type(t) is np.ndarray:
        src = t
    elif (plain := plain_cpu_numpy(t)) is not None:
        src, framework, torch_in = plain, FRAMEWORK_TORCH, True
    elif is_torch_tensor(t):
        if t.is_cuda:
            return None
        if not t.is_cpu:
            raise GpuUnavailable(
                f"cannot put a {t.device} tensor: vovp stores host and CUDA tensors only", 10)
        src, code = torch_to_numpy(t)
        framework, torch_in = FRAMEWORK_TORCH, True
    elif cuda_interface(t) is not None:
        return None
    else:
        src = np.asarray(t)
    # put_plan's cache, looked up here: one call per put, not two (put_tensors' batches).
    plan = _PUT_PLANS.get((src.dtype, src.shape, code, framework))
    if plan is None:
        plan = put_plan(src.dtype, src.shape, code, framework)
    return (src, *plan, torch_in)


def cuda_interface(obj: object) -> Optional[dict[str, Any]]:
    """``obj.__cuda_array_interface__`` or None (without raising for objects that lack it;
    torch CPU tensors raise AttributeError from the property)."""
    try:
        iface: dict[str, Any] = obj.__cuda_array_interface__  # type: ignore[attr-defined]
        return iface
    except AttributeError:
        return None


# --- torch (imported lazily: torch is optional) ---------------------------------------------

_TORCH_TABLES: Optional[Tuple[dict[Any, int], dict[int, Any]]] = None


def torch_tables() -> Tuple[dict[Any, int], dict[int, Any]]:
    """(torch dtype -> code, code -> torch dtype); built on first use."""
    global _TORCH_TABLES
    if _TORCH_TABLES is None:
        import torch  # noqa: PLC0415

        code_to = {}
        for code, name in DTYPE_NAMES.items():
            dt = getattr(torch, name, None)  # uint16/32/64 only exist in torch >= 2.3
            if dt is not None:
                code_to[code] = dt
        _TORCH_TABLES = ({dt: code for code, dt in code_to.items()}, code_to)
        _FROM_NUMPY[0] = torch.from_numpy
        _TORCH_TENSOR[0] = torch.Tensor
        _FROM_NUMPY_CODES.update(c for c in code_to if c != BFLOAT16)
    return _TORCH_TABLES


# torch.from_numpy and torch.Tensor, once torch_tables() imported torch.
_FROM_NUMPY: list[Any] = [None]
_TORCH_TENSOR: list[Any] = [None]
# The dtype codes torch.from_numpy shows as they are (filled with _FROM_NUMPY).
_FROM_NUMPY_CODES: set[int] = set()


def plain_cpu_numpy(t: object) -> Optional[npt.NDArray[Any]]:
    """numpy's view of ``t`` if it is a plain CPU ``torch.Tensor`` numpy can show as it is
    (its dtype has a numpy twin: the same dtype code), else None: ``put_tensor``'s fast path.
    Everything else (subclasses, CUDA, bfloat16, tensors requiring grad or carrying a
    conjugate or negation bit) goes ``torch_to_numpy``'s way."""
    if type(t) is not _TORCH_TENSOR[0]:
        return None
    try:
        return t.numpy()  # type: ignore[attr-defined,no-any-return]
    except (RuntimeError, TypeError):
        return None


_TORCH_IMPORTABLE: Optional[bool] = None


def torch_importable() -> bool:
    """Whether torch is (or can be) imported in this process; tried once."""
    global _TORCH_IMPORTABLE
    if _TORCH_IMPORTABLE:
        return True  # (every get of a tensor put from torch asks)
    imported = sys.modules.get("torch") is not None
    if _TORCH_IMPORTABLE is None or (not _TORCH_IMPORTABLE and imported):
        if imported:
            _TORCH_IMPORTABLE = True
        else:
            try:
                import torch  # noqa: F401, PLC0415 (optional)
                _TORCH_IMPORTABLE = True
            except Exception:  # noqa: BLE001 (not installed, or broken)
                _TORCH_IMPORTABLE = False
    return _TORCH_IMPORTABLE


def is_torch_tensor(obj: object) -> bool:
    # Checked by module name so that torch is never imported just to answer "no".
    t = type(obj)
    return t.__module__.startswith("torch") and hasattr(obj, "data_ptr") and \
        hasattr(obj, "dtype")


def torch_to_numpy(t: torch.Tensor) -> Tuple[npt.NDArray[Any], int]:
    """(numpy view sharing ``t``'s memory, dtype code) for a CPU tensor.

    bfloat16 has no numpy dtype: it is viewed as int16 (same bits); the returned code keeps
    saying bfloat16.
    """
    import torch  # noqa: PLC0415

    to_code, _ = torch_tables()
    code = to_code.get(t.dtype)
    if code is None:
        raise TypeError(f"vovp cannot store torch dtype {t.dtype}")
    if code == BFLOAT16:
        t = t.detach().resolve_conj().resolve_neg().view(torch.int16)
        return t.numpy(), code
    try:
        return t.numpy(), code
    except (RuntimeError, TypeError):
        # numpy() refuses tensors that require grad or carry a pending conjugate/negation
        # bit: resolved first (~1 µs, so only for them).
        return t.detach().resolve_conj().resolve_neg().numpy(), code


def torch_of_numpy(arr: npt.NDArray[Any]) -> torch.Tensor:
    """``torch.from_numpy(arr)`` for an array of a dtype torch shows as it is (the numpy view
    of a torch tensor's), without looking its code up."""
    if _FROM_NUMPY[0] is None:
        torch_tables()
    t: torch.Tensor = _FROM_NUMPY[0](arr)
    return t


def numpy_to_torch(arr: npt.NDArray[Any], code: int) -> torch.Tensor:
    """A torch tensor sharing ``arr``'s memory, with the dtype that ``code`` names."""
    # Every torch put and get passes here: no call and no import statement for the codes
    # torch.from_numpy shows as they are (once torch_tables() filled them in).
    if code in _FROM_NUMPY_CODES:
        t: torch.Tensor = _FROM_NUMPY[0](arr)
        return t
    torch_tables()
    if code in _FROM_NUMPY_CODES:
        t = _FROM_NUMPY[0](arr)
        return t
    import torch  # noqa: PLC0415

    if code == BFLOAT16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    raise TypeError(f"this torch has no {DTYPE_NAMES[code]} dtype")
