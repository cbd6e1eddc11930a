"""The CUDA objects of a ``vovp.Client`` (``put_cuda``, ``to_device``, CUDA ``put_tensor`` and
``get_tensor``): ``CudaObjects``, a collaborator the client hands those calls to, over the same
connection (``vovp._core.ClientCore``). Device memory is mapped and copied by the native core
(``vovp.cuda``, through the gpu crate); what holds a reference is a device owner
(``vovp.cuda.DeviceBuffer``), leased like host owners.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple

import numpy as np

from . import cuda as C
from . import tensor as T
from ._args import c_strides, dtype_code, object_name
from .errors import ProtocolError

if TYPE_CHECKING:
    import torch

    from ._args import Name
    from ._core import ClientCore


class CudaObjects:
    """Puts and gets of CUDA objects over one connection (see ``Client``)."""

    def __init__(self, core: ClientCore) -> None:
        self._core = core

    def put_tensor(self, name: Name, t: Any, ephemeral: bool, writable: bool,
                   replace: bool) -> Any:
        """``put_tensor`` of a CUDA tensor: a CUDA torch tensor, or any other object with
        ``__cuda_array_interface__`` (through ``put_cuda``)."""
        if T.is_torch_tensor(t):
            return self._put_torch(name, t, ephemeral, replace)
        return self.put_cuda(name, t, ephemeral=ephemeral, writable=writable, replace=replace)

    def put_cuda(self, name: Name, ptr: Any, nbytes: Optional[int] = None,
                 dtype: Any = None, shape: Any = None,
                 device: Optional[int] = None, ephemeral: bool = False,
                 writable: bool = False, framework: str = "cuda",
                 stream: Optional[int] = None, replace: bool = False) -> Any:
        """``Client.put_cuda``."""
        C.driver()  # the reason, before anything reaches the daemon
        fw = self._framework(framework, name)
        byte_order = T.LITTLE
        iface = None if isinstance(ptr, int) else T.cuda_interface(ptr)
        if iface is not None:
            if iface.get("mask") is not None:
                raise ValueError("masked CUDA arrays are not supported")
            src = int(iface["data"][0])
            np_dt = np.dtype(iface["typestr"])
            ishape = tuple(int(d) for d in iface["shape"])
            strides = iface.get("strides")
            if strides is not None and tuple(strides) != c_strides(ishape, np_dt.itemsize):
                raise ValueError("put_cuda needs a C-contiguous CUDA array; make it contiguous "
                                 "first")
            if dtype is not None and np.dtype(dtype) != np_dt:
                raise ValueError(f"dtype {dtype!r} does not match the array's {np_dt}")
            if shape is not None and tuple(shape) != ishape:
                raise ValueError(f"shape {shape!r} does not match the array's {ishape}")
            code = T.numpy_code(np_dt)
            byte_order = T.BIG if np_dt.byteorder == ">" else T.LITTLE
            shape = ishape
            size = np_dt.itemsize * int(np.prod(shape, dtype=np.int64))
            if nbytes is not None and int(nbytes) != size:
                raise ValueError(f"nbytes={nbytes} but the array has {size} bytes")
            nbytes = size
            if stream is None:
                stream = iface.get("stream")
        else:
            try:
                src = int(ptr)
            except TypeError:
                raise TypeError("put_cuda takes a device address (int) or an object with "
                                f"__cuda_array_interface__, not {type(ptr).__name__}") from None
            code = dtype_code(dtype if dtype is not None else np.uint8)
            itemsize = T.ITEMSIZE[code]
            if shape is None:
                if nbytes is None:
                    raise ValueError("put_cuda of a raw pointer needs nbytes or shape")
                if int(nbytes) % itemsize:
                    raise ValueError(f"nbytes={nbytes} is not a multiple of the {itemsize}-byte "
                                     "item size")
                shape = (int(nbytes) // itemsize,)
            shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(d) for d in shape)
            size = itemsize * int(np.prod(shape, dtype=np.int64))
            if nbytes is not None and int(nbytes) != size:
                raise ValueError(f"nbytes={nbytes} does not match shape {shape} of "
                                 f"{T.DTYPE_NAMES[code]} ({size} bytes)")
            nbytes = size
        if device is None:
            device = C.device_of(src) if nbytes else 0
        device = int(device)
        pre_copy = None if stream is None else (lambda: C.sync_stream(stream))
        owner = self._put_device(name, src, nbytes, code, shape, byte_order, device, ephemeral,
                                 pre_copy, replace=replace)
        return self._result(owner, code, shape, byte_order, fw, writable, name)

    def _put_torch(self, name: Name, t: torch.Tensor,
                   ephemeral: bool, replace: bool = False) -> Any:  # a CUDA torch.Tensor
        """put_tensor of a CUDA torch tensor (see ``Client.put_tensor``)."""
        C.driver()
        import torch  # noqa: PLC0415 (t is a torch tensor: torch is imported)

        to_code, _ = T.torch_tables()
        code = to_code.get(t.dtype)
        if code is None:
            raise TypeError(f"vovp cannot store torch dtype {t.dtype}")
        # detach: no autograd history in the store; resolve_*: materialise lazy conj/neg bits;
        # contiguous: the store keeps C-contiguous data. All may queue kernels on torch's
        # current stream, which is synchronised before the copy.
        t = t.detach().resolve_conj().resolve_neg().contiguous()
        device = t.device.index if t.device.index is not None else torch.cuda.current_device()
        shape = tuple(t.shape)
        nbytes = t.numel() * t.element_size()

        def pre_copy() -> None:
            # The data may still be being computed on torch's stream; ours does not wait for it.
            torch.cuda.current_stream(t.device).synchronize()

        owner = self._put_device(name, t.data_ptr(), nbytes, code, shape, T.LITTLE, device,
                                 ephemeral, pre_copy, T.FRAMEWORK_TORCH, replace)
        return self._result(owner, code, shape, T.LITTLE, "torch", True, name)

    def _put_device(self, name: Name, src: int, nbytes: int, code: int,
                    shape: Tuple[int, ...], byte_order: int, device: int, ephemeral: bool,
                    pre_copy: Optional[Callable[[], None]] = None,
                    framework: int = T.FRAMEWORK_UNSPECIFIED, replace: bool = False) -> Any:
        """CREATE on cuda:device, D2D copy from ``src`` (device address), wait, SEAL; the
        device owner holding the (now sealed) creator's reference."""
        name = object_name(name)
        meta = T.encode_header(code, shape, byte_order, T.DEVICE_CUDA, device, framework)
        core = self._core
        owner = core.create(name, nbytes, meta, ephemeral, device, replace)
        try:
            if pre_copy is not None:
                pre_copy()
            C.copy_d2d(owner.ptr, src, nbytes, device)
            core.seal(name)
        except BaseException:
            core.drop_owner(owner)  # releasing the creator's reference aborts the object
            raise
        return owner

    def to_device(self, name: Name, new_name: Name, device: int = 0,
                  ephemeral: bool = False, framework: Optional[str] = None,
                  writable: bool = False, timeout: Optional[float] = None) -> Any:
        """``Client.to_device``."""
        C.driver()
        fw = self._framework(framework, new_name)
        device = int(device)
        new_name = object_name(new_name)
        core = self._core
        obj = core.get1(name, timeout)
        host = obj.location[0] == "host"
        src_owner: Any = core.owner(obj) if host else core.cuda_owner(obj)
        try:
            meta = obj.metadata
            shape: Tuple[int, ...]
            code, shape, order = T.UINT8, (obj.size,), T.LITTLE
            if T.is_tensor_header(meta):
                m = T.decode_header(meta)
                if m.nbytes != obj.size:
                    raise ProtocolError(f"{name!r}: tensor header describes {m.nbytes} bytes, "
                                        f"object has {obj.size}")
                code, shape, order = m.dtype_code, m.shape, m.byte_order
                meta = T.encode_header(code, shape, order, T.DEVICE_CUDA, device, m.framework)
            dst = core.create(new_name, obj.size, meta, ephemeral, device)
            try:
                if host:
                    C.copy_h2d(dst.ptr, src_owner, device)
                else:
                    C.copy_d2d(dst.ptr, src_owner.ptr, obj.size, device)
                core.seal(new_name)
            except BaseException:
                core.drop_owner(dst)
                raise
        finally:
            del obj
            core.drop_owner(src_owner)  # the source's reference is not needed any more
        return self._result(dst, code, shape, order, fw, writable, new_name)

    def tensor_of(self, obj: Any, name: Name, framework: Optional[str],
                  writable: bool) -> Any:
        """get_tensor of a CUDA object: validate, wrap (reference released on failure)."""
        try:
            fw = self._framework(framework, name)
            meta = obj.metadata
            shape: Tuple[int, ...]
            code, shape, order = T.UINT8, (obj.size,), T.LITTLE
            if meta[:4] == T.MAGIC:
                m = T.decode_header(meta)
                if m.device_type != T.DEVICE_CUDA:
                    raise ProtocolError(f"{name!r} is a CUDA object with a host tensor header")
                if m.nbytes != obj.size:
                    raise ProtocolError(f"{name!r}: tensor header describes {m.nbytes} bytes, "
                                        f"object has {obj.size}")
                code, shape, order = m.dtype_code, m.shape, m.byte_order
        except BaseException:
            obj.release()
            raise
        owner = self._core.cuda_owner(obj)
        return self._result(owner, code, shape, order, fw, writable, name)

    @staticmethod
    def _framework(framework: Optional[str], name: Name) -> str:
        """'torch' or 'cuda' for a CUDA result; None picks torch when it is usable."""
        if framework is None:
            return "torch" if C.torch_cuda_usable() else "cuda"
        if framework in ("torch", "cuda"):
            return framework
        if framework in ("numpy", "np"):
            raise TypeError(f"{name!r} is a CUDA object: numpy cannot view device memory; use "
                            "framework='cuda' and .to_numpy() for a host copy")
        raise ValueError(f"framework must be None, 'torch' or 'cuda', not {framework!r}")

    @staticmethod
    def _result(owner: Any, code: int, shape: Tuple[int, ...], byte_order: int,
                     framework: str, writable: bool, name: Name) -> Any:
        if framework == "torch":
            return C.to_torch(owner, code, shape, byte_order)
        return C.CudaTensor(owner, code, shape, byte_order, readonly=not writable, name=name)
