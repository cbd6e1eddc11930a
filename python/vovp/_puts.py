"""The host routes of a planned put (``vovp.tensor.plan_host_put``), shared by
``Client.put_tensor``, ``Client.put_tensors`` and vovp.reduction's hand-offs.

``Client.put_tensor`` first tries the one native call that reads an array as it is
(``ClientCore.put_array``); what it declines (to convert: non-contiguous, big-endian, bfloat16
from torch...) is planned and put here:

- ``put_host``: one native call (``ClientCore.put_tensor_host``: inline, through a lend, or
  CREATE + the parallel copy + SEAL, as the native client picks; three calls from Python cost
  0.5-1.5 GB/s at 16-64 MiB) for a small tensor (up to the inline limit; made contiguous
  first) or one stored as it is. Otherwise CREATE, numpy's copy into the store's memory
  (converting on the way: ``copy_into``), SEAL. A hand-off (``seal_later``) takes that second
  route for everything above the inline limit, with a SEAL whose reply is read later: it waits
  no round trip, where a PUBLISH would wait one.
- ``put_batch``: ``put_tensors``' small ones in one native call, sent together without waiting.

Every one of them is a kept put that may return before the store's answer
(``put_options(ephemeral, replace, keep_reference=True, pipelined=True)``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Tuple

import numpy as np

from . import _lease as L
from . import tensor as T
from ._copy import copy_into
from ._core import put_options, shown_kind

if TYPE_CHECKING:
    import numpy.typing as npt

    from ._core import ClientCore
    from .tensor import HostPut

    # put_batch's items: (name, contiguous source, view dtype, shape, code, torch input,
    # header).
    BatchItem = Tuple[str, npt.NDArray[Any], np.dtype[Any], Tuple[int, ...], int, bool, bytes]


def put_host(core: ClientCore, name: str, plan: HostPut, ephemeral: bool, writable: bool,
             replace: bool, seal_later: bool = False, version: Optional[int] = None) -> Any:
    """Put host tensor ``plan`` as ``name`` (see the module docstring); the store's copy,
    leased: a numpy array, or a torch tensor for torch input (always writable). ``version``:
    sealed as exactly that version (``PutOptions.version``; vovp.cluster's numbering), and
    waited for: its refusal (StaleVersion) is raised here, never later."""
    src, code, store_dt, view_dt, meta, torch_in = plan
    writable = writable or torch_in
    as_is = src.dtype is store_dt and src.flags.c_contiguous
    if src.nbytes <= core.inline_limit or (as_is and not seal_later):
        if not as_is:
            src = np.ascontiguousarray(src, dtype=store_dt)
        # (A versioned put waits: its refusal is raised here.)
        options = put_options(ephemeral, replace, True, version is None, writable, version)
        arr = core.put_tensor_host(name, src, meta, options, view_dt)
        return T.numpy_to_torch(arr, code) if torch_in else arr
    owner = core.create(name, src.nbytes, meta, ephemeral, None, replace, version)
    try:
        copy_into(owner.view(store_dt).reshape(src.shape), src)
        if seal_later:
            core.seal_later(name)
        else:
            core.seal(name)
    except BaseException:
        core.drop_owner(owner)  # releasing the creator's reference aborts the object
        raise
    arr = owner.view(view_dt).reshape(src.shape)
    if torch_in:
        return T.numpy_to_torch(arr, code)
    if not writable:
        arr.flags.writeable = False
    return arr


def put_batch(core: ClientCore, batch: list[BatchItem], results: dict[str, Any],
              ephemeral: bool, writable: bool, replace: bool) -> Optional[BaseException]:
    """``put_tensors``' small ones (up to the inline limit) in one native call, sent together
    without waiting (as single small puts are), numpy seeing each result's dtype and shape;
    torch results (and ``writable``) view the store's copy through a private mapping. Fills
    ``results[name]``; returns the first error, or None."""
    objs = core.put_batch(
        [(name, src, meta, (shown_kind(view_dt), view_dt.itemsize, shape), writable or torch_in)
         for name, src, view_dt, shape, _, torch_in, meta in batch],
        put_options(ephemeral, replace, True, True))
    error = None
    arrays: list[Any] = []
    made: list[Any] = []
    for (name, _, view_dt, _, code, torch_in, _), obj in zip(batch, objs):
        if isinstance(obj, BaseException):
            error = error or obj
            results.pop(name, None)
            continue
        arr = obj.array()
        arrays.append(arr)
        made.append(obj)
        if arr.dtype != view_dt:
            arr = arr.view(view_dt)  # (ml_dtypes' bfloat16, shown as its bits)
        results[name] = T.numpy_to_torch(arr, code) if torch_in else arr
    L.lease_all(arrays, core, made)
    return error
