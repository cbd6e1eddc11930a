"""Tensor metadata header (PROTOCOL.md "Tensor metadata"), no daemon needed."""

import struct

import numpy as np
import pytest

import vovp
from vovp import tensor as T

NUMPY_CODES = {
    "bool": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "uint8": 6, "uint16": 7,
    "uint32": 8, "uint64": 9, "float16": 10, "float32": 12, "float64": 13, "complex64": 14,
    "complex128": 15,
}


@pytest.mark.parametrize("name,code", sorted(NUMPY_CODES.items()))
def test_numpy_dtype_codes(name, code):
    dt = np.dtype(name)
    assert T.numpy_code(dt) == code
    assert T.numpy_code(dt.newbyteorder(">")) == code
    assert T.storage_dtype(code) == dt.newbyteorder("<")
    assert T.storage_dtype(code, T.BIG) == dt.newbyteorder(">")
    assert T.ITEMSIZE[code] == dt.itemsize
    assert T.DTYPE_NAMES[code] == name


@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3), (0, 4), (1, 2, 3, 4, 5, 6, 7, 8, 9)])
def test_header_layout(shape):
    h = T.encode_header(12, shape)
    expected = (b"VTNS" + bytes([1, 12, 1, 0]) + struct.pack("<II", 0, len(shape))
                + struct.pack(f"<{len(shape)}q", *shape))
    assert h == expected
    m = T.decode_header(h)
    assert m == T.TensorMeta(12, tuple(shape), T.LITTLE, T.DEVICE_CPU, 0)
    assert m.nbytes == 4 * int(np.prod(shape, dtype=np.int64))


def test_header_fields():
    h = T.encode_header(T.BFLOAT16, (3,), T.BIG, T.DEVICE_CUDA, 2)
    m = T.decode_header(h)
    assert (m.dtype_name, m.byte_order, m.device_type, m.device_id) == ("bfloat16", 1, 2, 2)
    assert m.itemsize == 2


def test_bfloat16_numpy_fallback():
    dt = T.storage_dtype(T.BFLOAT16)
    if T._bfloat16_numpy() is None:
        assert dt == np.dtype("<u2")
    else:
        assert dt.name == "bfloat16"


@pytest.mark.parametrize("bad", [
    b"",
    b"XTNS" + bytes(12),
    b"VTNS" + bytes([2, 12, 1, 0]) + bytes(8),  # version 2
    b"VTNS" + bytes([1, 99, 1, 0]) + bytes(8),  # unknown dtype
    b"VTNS" + bytes([1, 12, 1, 7]) + bytes(8),  # unknown byte order
    b"VTNS" + bytes([1, 12, 1, 0]) + struct.pack("<II", 0, 2) + bytes(8),  # short shape
    b"VTNS" + bytes([1, 12, 1, 0]) + struct.pack("<II", 0, 1) + struct.pack("<q", -1),
])
def test_bad_headers(bad):
    with pytest.raises(vovp.ProtocolError):
        T.decode_header(bad)


def test_unsupported_dtype():
    with pytest.raises(TypeError):
        T.numpy_code(np.dtype("U3"))
    with pytest.raises(TypeError):
        T.numpy_code(np.dtype(object))


def test_little_endian_dtype():
    assert T.little_endian_dtype(np.dtype(">f8")) == np.dtype("<f8")
    assert T.little_endian_dtype(np.dtype("<i4")) == np.dtype("<i4")
    assert T.little_endian_dtype(np.dtype("?")) == np.dtype("?")
