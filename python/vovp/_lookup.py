"""Which store reference an array, tensor or memoryview is: ``find_lease``, ``version_of`` and
``release`` by array, over the lease index (``vovp._lease``).

An array derived from an owner has it as its ``.base`` (or is it): found by a dictionary
lookup. What has no such link (torch tensors, arrays rebuilt from buffers, CUDA tensors of
other frameworks) is found by address, among the live leases' address ranges.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Optional, Tuple

import numpy as np

from . import _lease as L
from . import cuda as C
from . import tensor as T
from .errors import InvalidArgument

if TYPE_CHECKING:
    from ._core import ClientCore
    from ._lease import Lease

# Objects found by address that were released explicitly (id -> weakref), so that releasing
# the same torch tensor twice does not release a second reference of the same store object.
_RELEASED_BY_ADDRESS: dict[int, weakref.ref[Any]] = {}


def data_address(obj: Any) -> Any:
    """Address of the first byte of an ndarray / torch tensor / buffer, or None."""
    try:
        if isinstance(obj, np.ndarray):
            return obj.__array_interface__["data"][0]
        if T.is_torch_tensor(obj):
            return obj.data_ptr()
        return np.frombuffer(obj, np.uint8).__array_interface__["data"][0]
    except Exception:  # noqa: BLE001
        return None


def _cuda_address(obj: Any) -> Any:
    """Device address of a CUDA torch tensor or ``__cuda_array_interface__`` object, or None."""
    if isinstance(obj, (np.ndarray, memoryview, bytes, bytearray)):
        return None
    try:
        if T.is_torch_tensor(obj):
            return obj.data_ptr() if obj.is_cuda else None
        iface = T.cuda_interface(obj)
        if iface is not None:
            return int(iface["data"][0])
    except Exception:  # noqa: BLE001
        pass
    return None


def _find(obj: object) -> Tuple[Optional[Lease], bool]:
    """(lease, found by address) for ``obj``; (None, False) when it is not store memory."""
    if isinstance(obj, C.CudaTensor):
        return C.lease_of_tensor(obj), False
    addr = _cuda_address(obj)
    cuda = addr is not None
    if not cuda:
        # Fast path: arrays derived from an owner have it as their base (or are the owner).
        candidates: list[object] = []
        if isinstance(obj, np.ndarray):
            candidates = [obj, obj.base]
        elif isinstance(obj, memoryview):
            candidates = [obj.obj, getattr(obj.obj, "base", None)]
        for c in candidates:
            if c is not None:
                lease = L.lease_of(c)
                if lease is not None:
                    return lease, False
        # Slow path (torch tensors, arrays rebuilt from buffers): match the address range.
        addr = data_address(obj)
        if addr is None:
            return None, False
    lease = L.lease_at(addr, cuda)
    return (lease, True) if lease is not None else (None, False)


def find_lease(obj: object) -> Optional[Lease]:
    """The lease (``vovp._lease.Lease``) whose object ``obj`` (an array, tensor or memoryview)
    points into, or None."""
    return _find(obj)[0]


def version_of(obj: object) -> int:
    """The version of its name that the store object behind ``obj`` is: an array, tensor or
    memoryview a ``vovp.Client`` returned (or any view of one). 1 for a name's first object,
    one more for each ``put_tensor(..., replace=True)``; pass it as ``get_tensor``'s
    ``newer_than`` to wait for the next one. InvalidArgument when ``obj`` is not store memory
    (or was released)."""
    lease = _find(obj)[0]
    if lease is None or not lease.token:
        raise InvalidArgument("not an object of the store (or released already): no version")
    return lease.version


def release(core: ClientCore, obj: object) -> bool:
    """``Client.release``: give back the reference behind ``obj`` (an array, tensor or
    memoryview, or an object id) that ``core`` holds; False when there was nothing (left) to
    release."""
    by_address = None
    if isinstance(obj, int):
        lease = next((lease for lease in L.leases_of(core)
                      if lease.known_oid == obj and lease.token), None)
    else:
        done = _RELEASED_BY_ADDRESS.get(id(obj))
        if done is not None and done() is obj:
            return False
        lease, found_by_address = _find(obj)
        if lease is not None and lease.client is not core:
            lease = None
        if found_by_address:
            by_address = obj  # e.g. a torch tensor: remember it, as it has no owner link
    if lease is None or not L.claim(lease):
        return False
    if by_address is not None:
        key = id(by_address)
        try:
            _RELEASED_BY_ADDRESS[key] = weakref.ref(
                by_address,
                lambda _, key=key: _RELEASED_BY_ADDRESS.pop(key, None))  # type: ignore[misc]
        except TypeError:  # not weak-referenceable
            pass
    if core.usable_here():
        L.give_back(lease)
    return True
