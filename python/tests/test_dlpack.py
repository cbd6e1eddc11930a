"""DLPack export of vovp.dlpack (what CudaTensor.__dlpack__ uses), checked with real consumers
(numpy and torch) on host memory: no copy, dtype and shape kept, the read-only flag honoured,
and the exported object held exactly until the consumer's tensor is gone.

CudaTensor's own __dlpack__ is tested against the fake CUDA driver in test_cuda.py; the store's
host results are numpy arrays and torch tensors, which have DLPack of their own (test_torch.py).
"""

import gc
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from vovp import dlpack as D  # noqa: E402
from vovp import tensor as T  # noqa: E402


class Exported:
    """Host memory exported through vovp.dlpack, like CudaTensor exports device memory."""

    def __init__(self, arr, code, readonly=False):
        self.arr = arr
        self.code = code
        self.readonly = readonly

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        return D.export(self.arr.__array_interface__["data"][0], (D.KDL_CPU, 0), self.code,
                        self.arr.shape, self.readonly, self, max_version, copy, dl_device)

    def __dlpack_device__(self):
        return (D.KDL_CPU, 0)


def test_torch_and_numpy_take_it_without_a_copy():
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    for consume in (torch.from_dlpack, np.from_dlpack):
        obj = Exported(base, T.FLOAT32)
        out = consume(obj)
        addr = out.data_ptr() if isinstance(out, torch.Tensor) else \
            out.__array_interface__["data"][0]
        assert addr == base.__array_interface__["data"][0]
        assert tuple(out.shape) == (3, 4) and out.tolist() == base.tolist()


def test_exported_object_lives_until_the_consumer_is_done():
    obj = Exported(np.ones(8, dtype=np.int64), T.INT64)
    alive = weakref.ref(obj)
    t = torch.from_dlpack(obj)
    del obj
    gc.collect()
    assert alive() is not None and D.pending_exports() == 1  # t still uses the memory
    assert t.sum().item() == 8
    del t
    gc.collect()
    assert alive() is None and D.pending_exports() == 0
    # A capsule nobody consumed frees itself.
    obj = Exported(np.ones(2, dtype=np.int8), T.INT8)
    cap = obj.__dlpack__()
    assert D.pending_exports() == 1
    del cap
    assert D.pending_exports() == 0


@pytest.mark.parametrize("code,np_dtype", [
    (T.BOOL, np.bool_), (T.UINT16, np.uint16), (T.INT8, np.int8), (T.FLOAT16, np.float16),
    (T.FLOAT64, np.float64), (T.COMPLEX64, np.complex64), (T.COMPLEX128, np.complex128)])
def test_dtypes(code, np_dtype):
    base = (np.arange(6) % 2).astype(np_dtype).reshape(2, 3)
    t = torch.from_dlpack(Exported(base, code))
    assert t.numpy().dtype == base.dtype and np.array_equal(t.numpy(), base)
    assert np.array_equal(np.from_dlpack(Exported(base, code)), base)


def test_bfloat16_and_zero_d():
    bits = torch.tensor([1.0, -2.5], dtype=torch.bfloat16).view(torch.int16).numpy()
    t = torch.from_dlpack(Exported(bits, T.BFLOAT16))
    assert t.dtype == torch.bfloat16 and t.tolist() == [1.0, -2.5]
    scalar = np.array(7, dtype=np.int32)
    t = torch.from_dlpack(Exported(scalar, T.INT32))
    assert t.shape == () and t.item() == 7


def test_read_only_flag_and_refusals():
    base = np.arange(4, dtype=np.float32)
    ro = np.from_dlpack(Exported(base, T.FLOAT32, readonly=True))  # numpy asks for DLPack 1
    assert not ro.flags.writeable
    # numpy 2 keeps a writable export writable; numpy 1 makes every DLPack import read-only.
    numpy2 = np.lib.NumpyVersion(np.__version__) >= "2.0.0"
    assert np.from_dlpack(Exported(base, T.FLOAT32)).flags.writeable == numpy2
    with pytest.raises(BufferError, match="copy"):
        Exported(base, T.FLOAT32).__dlpack__(copy=True)
    with pytest.raises(BufferError, match="device"):
        Exported(base, T.FLOAT32).__dlpack__(dl_device=(2, 0))
    assert D.pending_exports() == 1  # ro's
    del ro
    gc.collect()
    assert D.pending_exports() == 0
