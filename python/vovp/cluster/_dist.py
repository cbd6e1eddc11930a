"""DistTensor: a tensor whose rows are partitioned across nodes, each node keeping its rows
in its own vovp store (DistDGL's DistTensor/KVStore, on Ray).

Partition ``k`` lives on ``nodes[k]`` as the store object ``<name>/part-<k>`` (rows in
ascending global id), created by that node's agent, which keeps the creator's writable view and
applies pushes to it. Local trainers read their node's partition zero-copy (one copy per
node, however many trainers); rows of other nodes come engine to engine: ``pull`` sends one
GATHER per remote partition to this node's engine (rows ``local ids`` of the partition at its
version, from the holder's transfer port, in the ids' order, repeats included), which pulls
them into an ephemeral scratch object of this store; the rows are scattered into the result
and the scratch released (gone). No Ray call and no Ray object store on the way; several
partitions' GATHERs go out at once from a small thread pool (each thread its own connection).

Unlike every other store object, a partition changes after its seal: pushes write into it in
place, and local readers see them as they land (no snapshot), as in DistDGL.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .. import tensor as T
from ..client import Client
from ..errors import (
    InvalidArgument,
    ObjectExists,
    ObjectLost,
    ObjectNotFound,
    VovpError,
)
from ._agent import alive_nodes
from ._api import (
    agent_actor,
    call,
    client,
    directory_actor,
    fetch,
    node_id,
    publish,
    transfer_address,
    unpublish,
)

# Names of scratch objects that GATHERs land in (ephemeral: gone at their last release).
_SCRATCH = itertools.count()
_POOL_LOCK = threading.Lock()
_POOL: dict[str, Any] = {"pid": None, "pool": None}
_THREAD = threading.local()


def _gather_pool() -> ThreadPoolExecutor:
    """The threads that send the GATHERs of a pull's second and later remote partitions (the
    native call releases the GIL; the caller sends the first itself). Per process: a forked
    child makes its own."""
    with _POOL_LOCK:
        if _POOL["pid"] != os.getpid():
            _POOL.update(pid=os.getpid(), pool=ThreadPoolExecutor(
                8, thread_name_prefix="vovp-gather"))
        pool: ThreadPoolExecutor = _POOL["pool"]
        return pool


def _thread_client() -> Client:
    """This thread's client of the node's store: the calling thread's is the process's
    ``client()``; each gather thread has its own connection, so GATHERs to several partitions
    wait on the engine side by side, not queued on one connection."""
    if not threading.current_thread().name.startswith("vovp-gather"):
        return client()
    main = client()
    c = getattr(_THREAD, "client", None)
    # A new process-wide client (another cluster after a shutdown, a forked child) means a
    # new connection here too: the old one may lead to a store that is gone.
    if c is None or c.closed or getattr(_THREAD, "main", None) is not main:
        if c is not None and not c.closed:
            try:
                c.close()
            except VovpError:
                pass  # (its store is gone: nothing left to close)
        c = Client(main.path)
        _THREAD.client, _THREAD.main = c, main
    return c


class DistTensor:
    """A ``shape[0]``-row tensor partitioned across Ray nodes.

    ``DistTensor(name, shape, dtype, partition="range", nodes=None)`` creates it (zeros) or
    attaches to the existing one of that name (same shape and dtype); ``DistTensor(name)``
    attaches only (``timeout``: seconds to wait for its creation). ``partition``: "range"
    (contiguous, near-equal row ranges in ``nodes`` order) or an array of ``shape[0]``
    partition indices (row i lives on ``nodes[partition[i]]``). ``nodes``: Ray node ids
    (default: every alive node). ``dtype``: numpy or torch; with a torch dtype, ``pull``
    returns torch tensors.
    """

    def __init__(self, name: str, shape: Sequence[int] | None = None, dtype: Any = None,
                 partition: str | np.ndarray = "range", nodes: Sequence[str] | None = None,
                 timeout: float | None = None) -> None:

        self.name = name
        if shape is None:
            spec = call(directory_actor().dist_spec.remote(name, timeout), timeout)
            if spec is None:
                if timeout is not None:
                    raise TimeoutError(f"no DistTensor named {name!r} within {timeout} s")
                raise ObjectNotFound(f"no DistTensor named {name!r} in the vovp cluster", 1)
        else:
            spec = self._spec(name, shape, dtype, partition, nodes, alive_nodes())
            book = spec.pop("book_data")
            got, created = call(directory_actor().create_dist.remote(name, spec), 60.0)
            if created and book is not None:
                publish(spec["book"], book)  # attachers wait for it in _book_arrays
            if got is None:
                raise ObjectExists(f"{name!r} is a published object, not a DistTensor", 2)
            if tuple(got["shape"]) != tuple(spec["shape"]) or got["dtype"] != spec["dtype"]:
                raise ObjectExists(f"DistTensor {name!r} exists with shape {got['shape']} "
                                   f"and dtype {got['dtype']}", 2)
            spec = got
        self._spec_ = spec
        self.shape = tuple(spec["shape"])
        self.dtype = np.dtype(spec["dtype"])
        self.nodes = list(spec["nodes"])
        self._torch = spec["torch"]
        self._bounds = None if spec["bounds"] is None else np.asarray(spec["bounds"], np.int64)
        self._book: np.ndarray | None = None
        self._local_index: np.ndarray | None = None
        self._view = None
        # Every node's partition exists before anyone pulls (idempotent: the agent creates it
        # once, whoever asks first).
        refs = [agent_actor(node).dist_create.remote(name, spec["parts"][k], spec["counts"][k],
                                                self.shape[1:], spec["dtype"])
                for k, node in enumerate(self.nodes)]
        # Each partition's store version: what a GATHER of its rows names.
        self._part_versions = [int(v) for v in
                               self._call_nodes(refs, list(range(len(self.nodes))))]

    @staticmethod
    def _spec(name, shape, dtype, partition, nodes, alive):
        shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(d) for d in shape)
        if not shape or shape[0] < 0:
            raise InvalidArgument(f"a DistTensor needs at least one dimension, got {shape}")
        torch_in = type(dtype).__module__ == "torch"
        np_dtype = _numpy_dtype_of_torch(dtype) if torch_in else np.dtype(dtype)
        nodes = sorted(alive) if nodes is None else list(nodes)
        missing = [n for n in nodes if n not in alive]
        if not nodes or missing:
            raise InvalidArgument(f"DistTensor {name!r}: nodes must be alive Ray nodes; "
                                  f"not alive: {missing or 'no nodes given'}")
        n, parts = shape[0], len(nodes)
        spec = {"shape": shape, "dtype": np_dtype.str, "torch": torch_in, "nodes": nodes,
                "parts": [f"{name}/part-{k}" for k in range(parts)], "bounds": None,
                "book": None, "book_data": None}
        if isinstance(partition, str):
            if partition != "range":
                raise InvalidArgument(f"partition must be 'range' or an array of partition "
                                      f"indices, got {partition!r}")
            bounds = [n * k // parts for k in range(parts + 1)]
            spec["bounds"] = bounds
            spec["counts"] = [bounds[k + 1] - bounds[k] for k in range(parts)]
        else:
            book = np.asarray(partition)
            if book.shape != (n,) or book.dtype.kind not in "iu":
                raise InvalidArgument(f"partition must be {n} integer partition indices, "
                                      f"got shape {book.shape} dtype {book.dtype}")
            if n and (book.min() < 0 or book.max() >= parts):
                raise InvalidArgument(f"partition indices must be in [0, {parts})")
            spec["book"] = f"{name}/book"
            spec["book_data"] = book.astype(np.int32)
            spec["counts"] = np.bincount(book, minlength=parts).tolist()
        return spec

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return (f"<vovp.cluster.DistTensor {self.name!r} shape={self.shape} "
                f"dtype={self.dtype} parts={len(self.nodes)}>")

    # -- where rows live -----------------------------------------------------------------------

    def locate(self, ids: Any) -> tuple[np.ndarray, np.ndarray]:
        """(partition index, row within that partition) for each id."""
        ids = self._ids(ids)
        if self._bounds is not None:
            part = np.searchsorted(self._bounds, ids, side="right") - 1
            return part, ids - self._bounds[part]
        book, local = self._book_arrays()
        return book[ids].astype(np.int64), local[ids]

    def _book_arrays(self):
        if self._book is None:

            book = np.asarray(fetch(self._spec_["book"], timeout=60.0, framework="numpy"))
            local = np.empty(len(book), np.int64)
            for k in range(len(self.nodes)):
                sel = book == k
                local[sel] = np.arange(int(sel.sum()))
            self._book, self._local_index = book, local
        return self._book, self._local_index

    def _ids(self, ids) -> np.ndarray:
        if T.is_torch_tensor(ids):
            ids = ids.detach().cpu().numpy()
        ids = np.asarray(ids)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise InvalidArgument(f"ids must be a 1-D integer array, got shape {ids.shape} "
                                  f"dtype {ids.dtype}")
        ids = ids.astype(np.int64, copy=False)
        n = self.shape[0]
        if ids.size and (ids.min() < 0 or ids.max() >= n):
            bad = ids[(ids < 0) | (ids >= n)][0]
            raise IndexError(f"id {bad} is out of range for DistTensor {self.name!r} with "
                             f"{n} rows")
        return ids

    def _me(self):

        me = node_id()
        return self.nodes.index(me) if me in self.nodes else None

    def local_partition(self) -> Any:
        """This node's rows (read-only, zero-copy from the local store), or None when this
        node holds no partition. Pushes show up in it as they land."""
        k = self._me()
        if k is None:
            return None
        if self._view is None:

            self._view = client().get_tensor(self._spec_["parts"][k], framework="numpy")
        return self._view

    def local_ids(self) -> np.ndarray:
        """The global ids of this node's rows, in the order of ``local_partition()``."""
        k = self._me()
        if k is None:
            return np.empty(0, np.int64)
        if self._bounds is not None:
            return np.arange(self._bounds[k], self._bounds[k + 1], dtype=np.int64)
        book, _ = self._book_arrays()
        return np.nonzero(book == k)[0]

    # -- pull / push ---------------------------------------------------------------------------

    def pull(self, ids: Any) -> Any:
        """The rows ``ids`` (in that order, repeats allowed), as a new array (torch for a
        torch DistTensor). One GATHER per remote partition, sent to this node's engine, which
        pulls the rows straight from the holder's store (``_gather``), the partitions in
        parallel; local rows are gathered from the local store meanwhile."""

        ids = self._ids(ids)
        part, local = self.locate(ids)
        out = np.empty((len(ids), *self.shape[1:]), self.dtype)
        me = self._me()
        remote = []
        for k in np.unique(part).tolist():
            if k != me:
                sel = np.nonzero(part == k)[0]
                remote.append((k, sel, local[sel]))
        # Partitions' rows are disjoint rows of ``out``: each gather writes its own.
        pending = [_gather_pool().submit(self._gather, *job, out) for job in remote[1:]]
        try:
            if remote:
                self._gather(*remote[0], out)
            if me is not None:
                sel = np.nonzero(part == me)[0]
                if sel.size:
                    out[sel] = self.local_partition()[local[sel]]
        finally:
            futures.wait(pending)  # none still writes into ``out`` once this returns
        for p in pending:
            p.result()  # (its error, if any)
        if self._torch:
            import torch

            return torch.from_numpy(out)
        return out

    def _gather(self, k: int, sel: np.ndarray, local_ids: np.ndarray, out: np.ndarray) -> None:
        """``out[sel]`` = partition ``k``'s rows ``local_ids``, by GATHER from its node's engine
        into an ephemeral scratch object of this node's store (gone once released, here)."""
        node = self.nodes[k]
        row_shape = self.shape[1:]
        row_bytes = self.dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))
        c = _thread_client()
        scratch = f"{self.name}/gather-{os.getpid()}-{threading.get_ident()}-{next(_SCRATCH)}"
        try:
            rows = c.gather_from(transfer_address(node), self._spec_["parts"][k],
                                 self._part_versions[k], row_bytes,
                                 local_ids.astype(np.uint64, copy=False), scratch)
        except VovpError as e:
            if node in alive_nodes():
                raise
            raise ObjectLost(f"DistTensor {self.name!r}: the partition on node {node} is "
                             f"lost (Ray reports it dead): {e}") from None
        try:
            out[sel] = rows.view(self.dtype).reshape(len(local_ids), *row_shape)
        finally:
            c.release(rows)

    def push(self, ids: Any, rows: Any, op: str | Callable[..., Any] = "assign") -> None:
        """Write ``rows`` at ``ids``: op "assign", "add" (repeated ids add up), or a handler
        ``op(target, name, local_ids, rows)`` run on the owning node with ``target[name]``
        the partition (DistDGL's push handler). Pushes to one partition apply one at a time."""

        if not (op in ("assign", "add") or callable(op)):
            raise InvalidArgument(f"push op must be 'assign', 'add' or a callable, got {op!r}")
        ids = self._ids(ids)
        if T.is_torch_tensor(rows):
            rows = rows.detach().cpu().numpy()
        rows = np.asarray(rows, dtype=self.dtype)
        if rows.shape != (len(ids), *self.shape[1:]):
            raise InvalidArgument(f"rows must have shape {(len(ids), *self.shape[1:])}, got "
                                  f"{rows.shape}")
        part, local = self.locate(ids)
        refs, ks = [], []
        for k in np.unique(part).tolist():
            sel = np.nonzero(part == k)[0]
            refs.append(agent_actor(self.nodes[k]).dist_push.remote(self.name, local[sel],
                                                               rows[sel], op))
            ks.append(k)
        self._call_nodes(refs, ks)

    __getitem__ = pull

    def __setitem__(self, ids, rows) -> None:
        self.push(ids, rows)

    def delete(self) -> None:
        """Drop every partition and the name, cluster-wide."""

        call(directory_actor().drop_dist.remote(self.name), 60.0)
        alive = alive_nodes()
        refs = [agent_actor(n).dist_drop.remote(self.name, self._spec_["parts"][k])
                for k, n in enumerate(self.nodes) if n in alive]
        call(refs, 60.0)
        if self._spec_["book"] is not None:
            unpublish(self._spec_["book"])
        self._view = None

    def _call_nodes(self, refs, ks):
        """Wait for one call per partition; a dead node's partition is an ObjectLost that
        names it."""
        try:
            return call(refs, None)
        except VovpError as e:
            alive = alive_nodes()
            dead = [self.nodes[k] for k in ks if self.nodes[k] not in alive]
            if not dead:
                raise
            raise ObjectLost(f"DistTensor {self.name!r}: the partition(s) on node(s) "
                             f"{', '.join(dead)} are lost (Ray reports them dead): {e}") \
                from None


def _numpy_dtype_of_torch(dtype) -> np.dtype:
    import torch

    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        raise InvalidArgument(f"a DistTensor cannot hold torch dtype {dtype} (no numpy "
                              "equivalent)") from None
