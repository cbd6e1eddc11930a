"""Argument conversions of ``vovp.Client``: names, metadata, timeouts, versions, host buffers,
dtypes, frameworks; and the type aliases its signatures use (``Name``, ``Metadata``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence, Tuple, Union

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt

    # An object name: str, or its UTF-8 bytes.
    Name = Union[str, bytes, bytearray, memoryview]
    # Object metadata: any bytes-like object.
    Metadata = Union[bytes, bytearray, memoryview]

from . import tensor as T
from .errors import InvalidArgument, InvalidName


def object_name(name: Union[str, bytes, bytearray, memoryview]) -> str:
    """An object name as the native core takes it (validated there: InvalidName)."""
    if type(name) is str:
        return name
    if isinstance(name, (bytes, bytearray, memoryview)):
        try:
            return bytes(name).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidName("object names must be UTF-8", 7) from None
    if not isinstance(name, str):
        raise TypeError(f"object names are str, not {type(name).__name__}")
    return name


def metadata_bytes(metadata: Union[bytes, bytearray, memoryview]) -> bytes:
    return metadata if type(metadata) is bytes else bytes(metadata)


def version_number(version: Any) -> int:
    """A version number for ``newer_than``: an int from 0 to 2**64 - 1."""
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or \
            not 0 <= int(version) < 2**64:
        raise InvalidArgument(f"a version is an int from 0 to 2**64 - 1, not {version!r}")
    return int(version)


def wait_seconds(timeout: Optional[float]) -> Optional[float]:
    """A get's ``timeout`` as the native core takes it: None = do not wait; negative = forever
    (a century); else seconds."""
    if timeout is None:
        return None
    timeout = float(timeout)
    return 3.15e9 if timeout < 0 else timeout


def byte_array(data: Any) -> npt.NDArray[np.uint8]:
    """A C-contiguous uint8 array over (or, for non-contiguous input, a copy of) ``data``."""
    if isinstance(data, np.ndarray):
        a = data if data.flags.c_contiguous else np.ascontiguousarray(data)
        return a.reshape(-1).view(np.uint8)
    mv = memoryview(data)
    if not mv.c_contiguous:
        mv = memoryview(mv.tobytes())
    return np.frombuffer(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv, np.uint8)


def check_framework(framework: Optional[str]) -> None:
    if framework not in (None, "numpy", "np", "torch", "cuda"):
        raise ValueError(
            f"framework must be None, 'numpy', 'torch' or 'cuda', not {framework!r}")


def c_strides(shape: Sequence[int], itemsize: int) -> Tuple[int, ...]:
    """Byte strides of a C-contiguous array (for checking ``__cuda_array_interface__``)."""
    strides = []
    step = itemsize
    for d in reversed(shape):
        strides.append(step)
        step *= max(int(d), 1)
    return tuple(reversed(strides))


def dtype_code(dtype: Any) -> int:
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
