"""Argument conversions of ``vovp.Client``: names, metadata, timeouts, host buffers, dtypes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence, Tuple, Union

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt

    # _host_source's result: (numpy view of the data, dtype code, dtype to store, dtype of the
    # result, header, torch input).
    HostSource = Tuple[npt.NDArray[Any], int, np.dtype[Any], np.dtype[Any], bytes, bool]

from . import tensor as T
from .errors import GpuUnavailable, InvalidArgument


def _name(name: Union[str, bytes, bytearray, memoryview]) -> str:
    """An object name as the native core takes it (validated there: InvalidName)."""
    if type(name) is str:
        return name
    if isinstance(name, (bytes, bytearray, memoryview)):
        try:
            return bytes(name).decode("utf-8")
        except UnicodeDecodeError:
            from .errors import InvalidName  # noqa: PLC0415

            raise InvalidName("object names must be UTF-8", 7) from None
    if not isinstance(name, str):
        raise TypeError(f"object names are str, not {type(name).__name__}")
    return name


def _metadata(metadata: Union[bytes, bytearray, memoryview]) -> bytes:
    return metadata if type(metadata) is bytes else bytes(metadata)


def _version(version: Any) -> int:
    """A version number for ``newer_than``: an int from 0 to 2**64 - 1."""
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or \
            not 0 <= int(version) < 2**64:
        raise InvalidArgument(f"a version is an int from 0 to 2**64 - 1, not {version!r}")
    return int(version)


def _timeout(timeout: Optional[float]) -> Optional[float]:
    """None = do not wait; negative = forever (a century); else seconds."""
    if timeout is None:
        return None
    timeout = float(timeout)
    return 3.15e9 if timeout < 0 else timeout


def _byte_array(data: Any) -> npt.NDArray[np.uint8]:
    """A C-contiguous uint8 array over (or, for non-contiguous input, a copy of) ``data``."""
    if isinstance(data, np.ndarray):
        a = data if data.flags.c_contiguous else np.ascontiguousarray(data)
        return a.reshape(-1).view(np.uint8)
    mv = memoryview(data)
    if not mv.c_contiguous:
        mv = memoryview(mv.tobytes())
    return np.frombuffer(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv, np.uint8)


def _host_source(t: Any) -> HostSource:
    """(numpy view of the data, dtype code, dtype to store, dtype of the result, header,
    torch input) for a numpy array, CPU torch tensor or array-like."""
    if type(t) is np.ndarray:
        return (t, *T.put_plan(t.dtype, t.shape), False)
    if T.is_torch_tensor(t):
        if not t.is_cpu:
            raise GpuUnavailable(
                f"cannot put a {t.device} tensor: vovp stores host and CUDA tensors only", 10)
        src, code = T.torch_to_numpy(t)
        return (src, *T.put_plan(src.dtype, src.shape, code, T.FRAMEWORK_TORCH), True)
    src = np.asarray(t)
    return (src, *T.put_plan(src.dtype, src.shape), False)


def _host_result(owner: npt.NDArray[Any], view_dt: np.dtype[Any], shape: Tuple[int, ...],
                 code: int, torch_in: bool, writable: bool) -> Any:
    arr = owner.view(view_dt).reshape(shape)
    if torch_in:
        return T.numpy_to_torch(arr, code)
    if not writable:
        arr.flags.writeable = False
    return arr


def _check_framework(framework: Optional[str]) -> None:
    if framework not in (None, "numpy", "np", "torch", "cuda"):
        raise ValueError(
            f"framework must be None, 'numpy', 'torch' or 'cuda', not {framework!r}")


def _c_strides(shape: Sequence[int], itemsize: int) -> Tuple[int, ...]:
    """Byte strides of a C-contiguous array (for checking ``__cuda_array_interface__``)."""
    strides = []
    step = itemsize
    for d in reversed(shape):
        strides.append(step)
        step *= max(int(d), 1)
    return tuple(reversed(strides))


def _dtype_code(dtype: Any) -> int:
    """Protocol dtype code of a numpy dtype, a dtype name ("bfloat16" too) or a torch dtype."""
    if type(dtype).__module__ == "torch":  # torch.float32 and friends
        to_code, _ = T.torch_tables()
        code = to_code.get(dtype)
        if code is None:
            raise TypeError(f"vovp cannot store torch dtype {dtype}")
        return code
    if isinstance(dtype, str):
        for code, n in T.DTYPE_NAMES.items():
            if n == dtype:
                return code
    return T.numpy_code(np.dtype(dtype))
