"""State dicts as one versioned object: ``publish_state`` / ``fetch_state``.

A model is hundreds of tensors; sending them one by one costs a round trip each, and packing
them into a buffer first costs a copy of everything on the writer's CPU. Here the whole dict
is ONE store object, published with the cluster's versions like any name (the directory
reserves ``v``, the writer seals ``v`` in its node's store, the directory commits it):

- **Writer, one copy.** ``create`` the object at its final size, copy every tensor straight
  into its slice while hashing it in the same pass, all tensors in ONE native job over the
  copy pool (``vovp._native.copy_hashed_many``: xxh3 over 1 MiB blocks, vovp_shm's
  ``content_hash``; one GIL release, no per-tensor dispatch), write the layout table after
  the tensors, seal. No packing buffer. A CUDA torch tensor is copied device-to-host straight
  into its slice and a strided or byte-swapped array through numpy, each hashed after.
- **Receiver, one transfer per node.** The directory's entry of a version carries its layout
  (the commit's metadata: the footer and the table below), so a receiver that holds an older
  version compares the two tables before it asks for the bytes: tensors with the same key,
  dtype, shape, offset, size and content hash are passed to the engine's FETCH as
  ``base_ranges`` and copied from the local old version; only the rest crosses the network,
  in one FETCH (vovp.cluster's fetch walk, ``_fetch``).
- **Readers, zero-copy.** ``fetch_state`` returns a ``State`` (a dict with ``.version``) of
  views into the local object: the views keep it alive, and every view of one result is of
  one version (one object: no reader ever mixes two).

Object layout (state layout version 1; integers little-endian)::

    0 ..            the tensors' bytes in the dict's key order, each C-contiguous and
                    little-endian at a 64-byte-aligned offset; padding bytes are zero
    table_offset    the table (64-byte aligned): one entry per tensor, in key order
    size - 64       the footer (64 bytes); the object's store metadata is the same footer

    footer: 0 4s magic b"VSTA" | 4 u16 layout version (1) | 6 u16 footer size (64)
            8 u32 tensor count | 12 u32 zero | 16 u64 table offset | 24 u64 table length
            32 u64 the state's version (the store's and the cluster's) | 40 24 zero bytes
    entry:  0 u16 key length k | 2 u8 dtype code (PROTOCOL.md "Tensor metadata")
            3 u8 ndim | 4 u8 framework (1 numpy, 2 torch: what fetch_state returns)
            5 3 zero bytes | 8 u64 offset | 16 u64 nbytes | 24 u64 content hash
            32 u64 x ndim dims | then the key, k bytes of UTF-8

The table lives in the object, not in the store's metadata (64 KiB at most: a few hundred
tensors with long keys, while an unfused mixture-of-experts model has tens of thousands), and
after the tensors so that tensors keep their offsets when only the table changes. The
directory's copy of it (footer then table) goes through Ray's control path, of any size.

The content hash is a change detector, not a MAC: the writer is trusted (vovp.cluster's trust
model). Its cost to the writer is measured in BENCHMARKS.md ("Across machines", weight sync).
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple, Optional

import numpy as np

from .. import _native as N
from .. import tensor as T
from .._copy import copy_into
from ..client import Client
from ..errors import InvalidArgument, ObjectNotFound, ProtocolError, VovpError
from . import _api, _fetch

MAGIC = b"VSTA"
LAYOUT_VERSION = 1
ALIGN = 64
FOOTER = struct.Struct("<4sHHIIQQQ24x")
ENTRY = struct.Struct("<HBBB3xQQQ")
assert FOOTER.size == 64 and ENTRY.size == 32

_FRAMEWORK_NUMPY, _FRAMEWORK_TORCH = T.FRAMEWORK_NUMPY, T.FRAMEWORK_TORCH


class TensorEntry(NamedTuple):
    key: str
    code: int  # the tensor header's dtype code
    shape: tuple[int, ...]
    framework: int
    offset: int
    nbytes: int
    hash: int


class Layout(NamedTuple):
    version: int
    entries: list[TensorEntry]
    table_offset: int
    table_len: int

    @property
    def size(self) -> int:
        """The object's size."""
        return _aligned(self.table_offset + self.table_len) + FOOTER.size


class State(dict):  # type: ignore[type-arg]
    """A state dict fetched or published through vovp.cluster: key -> zero-copy view (numpy,
    or torch for tensors published from torch), in the writer's key order. ``version``: the
    cluster version every tensor in it belongs to."""

    version: int

    def __init__(self, items: Any, version: int) -> None:
        super().__init__(items)
        self.version = version


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# -- the layout ---------------------------------------------------------------------------------


def _footer(layout: Layout) -> bytes:
    return FOOTER.pack(MAGIC, LAYOUT_VERSION, FOOTER.size, len(layout.entries), 0,
                       layout.table_offset, layout.table_len, layout.version)


def _table(entries: list[TensorEntry]) -> bytes:
    parts = []
    for e in entries:
        key = e.key.encode()
        parts.append(ENTRY.pack(len(key), e.code, len(e.shape), e.framework, e.offset,
                                e.nbytes, e.hash))
        parts.append(struct.pack(f"<{len(e.shape)}Q", *e.shape))
        parts.append(key)
    return b"".join(parts)


def _parse_footer(footer: bytes) -> tuple[int, int, int, int]:
    """(count, table offset, table length, version) of a footer."""
    if len(footer) < FOOTER.size:
        raise ProtocolError("not a vovp state object (no footer)")
    magic, layout, size, count, _, table_offset, table_len, version = \
        FOOTER.unpack_from(footer)
    if magic != MAGIC:
        raise ProtocolError("not a vovp state object (bad magic)")
    if layout != LAYOUT_VERSION or size != FOOTER.size:
        raise ProtocolError(f"state layout version {layout} (footer {size} bytes): this vovp "
                            f"reads version {LAYOUT_VERSION}")
    return count, table_offset, table_len, version


def _parse_table(table: Any, count: int) -> list[TensorEntry]:
    table = memoryview(table).cast("B")
    entries, at = [], 0
    try:
        for _ in range(count):
            klen, code, ndim, framework, offset, nbytes, digest = ENTRY.unpack_from(table, at)
            at += ENTRY.size
            shape = struct.unpack_from(f"<{ndim}Q", table, at)
            at += 8 * ndim
            key = bytes(table[at:at + klen]).decode()
            at += klen
            entries.append(TensorEntry(key, code, shape, framework, offset, nbytes, digest))
    except (struct.error, UnicodeDecodeError) as e:
        raise ProtocolError(f"a malformed state table: {e}") from None
    return entries


def layout_of_object(buf: np.ndarray) -> Layout:
    """The layout of a state object, read from its bytes (a uint8 view of the whole object)."""
    if buf.nbytes < FOOTER.size:
        raise ProtocolError("not a vovp state object (too small)")
    count, table_offset, table_len, version = _parse_footer(bytes(buf[-FOOTER.size:]))
    if table_offset + table_len > buf.nbytes - FOOTER.size:
        raise ProtocolError("a state table past the object's end")
    entries = _parse_table(buf[table_offset:table_offset + table_len], count)
    return Layout(version, entries, table_offset, table_len)


def describe(layout: Layout) -> bytes:
    """The directory's metadata of a version: its footer, then its table."""
    return _footer(layout) + _table(layout.entries)


def layout_of_description(meta: bytes) -> Optional[Layout]:
    """The layout in a directory entry's metadata (``describe``); None when the entry is not
    a state's."""
    if len(meta) < FOOTER.size or meta[:4] != MAGIC:
        return None
    count, table_offset, table_len, version = _parse_footer(meta[:FOOTER.size])
    table = meta[FOOTER.size:]
    if len(table) != table_len:
        raise ProtocolError("a state description whose table length disagrees")
    return Layout(version, _parse_table(table, count), table_offset, table_len)


def unchanged_ranges(old: Layout, new: Layout) -> list[tuple[int, int]]:
    """Byte ranges (offset, length) that hold the same bytes in ``old`` and ``new``: tensors
    with equal key, dtype, shape, offset, size and content hash, each with its zero padding,
    adjacent ones merged. The table and footer are never among them."""
    before = {e.key: e for e in old.entries}
    limit = min(old.table_offset, new.table_offset)
    ranges: list[tuple[int, int]] = []
    for e in new.entries:
        o = before.get(e.key)
        if o is None or o != e or e.nbytes == 0:
            continue
        end = min(_aligned(e.offset + e.nbytes), limit)
        if ranges and ranges[-1][0] + ranges[-1][1] == e.offset:
            start = ranges[-1][0]
            ranges[-1] = (start, end - start)
        else:
            ranges.append((e.offset, end - e.offset))
    return ranges


# -- writing and reading ------------------------------------------------------------------------


def _plan(state_dict: Any) -> tuple[list[tuple[TensorEntry, Any, bool]], Layout]:
    """(entry without its hash, source, whether the source is a CUDA torch tensor) per
    tensor, and the layout (hashes 0)."""
    if not hasattr(state_dict, "items"):
        raise InvalidArgument(f"a state dict must be a mapping of str to tensors, got "
                              f"{type(state_dict).__name__}")
    planned, offset = [], 0
    for key, value in state_dict.items():
        if not isinstance(key, str):
            raise InvalidArgument(f"state dict keys must be str, got {key!r}")
        cuda = False
        if T.is_torch_tensor(value):
            framework = _FRAMEWORK_TORCH
            if value.is_cuda:
                to_code, _ = T.torch_tables()
                code = to_code.get(value.dtype)
                if code is None:
                    raise InvalidArgument(f"{key!r}: vovp cannot store torch dtype "
                                          f"{value.dtype}")
                src, cuda = value.detach(), True
                shape = tuple(int(d) for d in value.shape)
            else:
                src, code = T.torch_to_numpy(value.detach())
                shape = src.shape
        else:
            framework = _FRAMEWORK_NUMPY
            src = np.asarray(value)
            try:
                code = T.numpy_code(src.dtype)
            except TypeError as e:
                raise InvalidArgument(f"{key!r}: {e}") from None
            shape = src.shape
        nbytes = T.ITEMSIZE[code] * int(np.prod(shape, dtype=np.int64))
        offset = _aligned(offset)
        planned.append((TensorEntry(key, code, tuple(int(d) for d in shape), framework,
                                    offset, nbytes, 0), src, cuda))
        offset += nbytes
    entries = [p[0] for p in planned]
    table_offset = _aligned(offset)
    return planned, Layout(0, entries, table_offset, len(_table(entries)))


def _plain(src: Any, cuda: bool) -> bool:
    """Whether ``src`` is copied as it is (its bytes are the stored ones)."""
    return not cuda and src.flags.c_contiguous and src.dtype.isnative and \
        src.dtype.byteorder != ">" and np.little_endian


def _copy_converted(dst: np.ndarray, entry: TensorEntry, src: Any, cuda: bool) -> int:
    """Copy one tensor that is not stored as it is into its slice ``dst`` (uint8): a CUDA
    tensor device-to-host, a strided or byte-swapped array through numpy; its content hash."""
    if cuda:
        target = T.numpy_to_torch(dst.view(T.storage_dtype(entry.code)).reshape(entry.shape),
                                  entry.code)
        target.copy_(src)
    else:
        copy_into(dst.view(T.little_endian_dtype(src.dtype)).reshape(entry.shape), src)
    return N.content_hash(dst)


def write_state(c: Client, name: str, state_dict: Any, version: Optional[int] = None,
                replace: bool = True) -> tuple[State, Layout]:
    """Store ``state_dict`` as the one object ``name`` of ``c``'s store (sealed as exactly
    ``version`` when given); returns its ``State`` of views and its layout."""
    planned, layout = _plan(state_dict)
    layout = layout._replace(version=int(version or 0))
    buf = c.create(name, layout.size, _footer(layout), replace=replace, version=version)
    try:
        hashes = [0] * len(planned)
        plain = [i for i, (_, src, cuda) in enumerate(planned) if _plain(src, cuda)]
        as_is = set(plain)
        for i, (entry, src, cuda) in enumerate(planned):
            if i not in as_is:
                hashes[i] = _copy_converted(buf[entry.offset:entry.offset + entry.nbytes],
                                            entry, src, cuda)
        # The rest in one native job over the copy pool: copied and hashed in one pass.
        for i, digest in zip(plain, N.copy_hashed_many(
                buf, [planned[i][0].offset for i in plain],
                [planned[i][1].reshape(-1) for i in plain])):
            hashes[i] = digest
        entries, end = [], 0
        for (entry, _, _), digest in zip(planned, hashes):
            buf[end:entry.offset] = 0  # the padding before it
            entries.append(entry._replace(hash=digest))
            end = entry.offset + entry.nbytes
        layout = layout._replace(entries=entries)
        table = _table(entries)
        buf[end:layout.table_offset] = 0
        buf[layout.table_offset:layout.table_offset + len(table)] = np.frombuffer(table,
                                                                                  np.uint8)
        buf[layout.table_offset + len(table):-FOOTER.size] = 0
        buf[-FOOTER.size:] = np.frombuffer(_footer(layout), np.uint8)
        sealed = c.seal(name)
    except BaseException:
        try:
            c.abort(name)
        except VovpError:
            pass  # (a seal that failed may have taken the object with it)
        raise
    layout = layout._replace(version=sealed)
    return state_of(buf, layout), layout


def state_of(buf: np.ndarray, layout: Optional[Layout] = None) -> State:
    """The ``State`` of views into a state object's bytes (a uint8 view of it; writable when
    any tensor is to be torch, which has no read-only tensors)."""
    if layout is None:
        layout = layout_of_object(buf)
    out: dict[str, Any] = {}
    for e in layout.entries:
        arr = buf[e.offset:e.offset + e.nbytes].view(T.storage_dtype(e.code)).reshape(e.shape)
        if e.framework == _FRAMEWORK_TORCH and T.torch_importable():
            out[e.key] = T.numpy_to_torch(arr, e.code)
        else:
            arr.flags.writeable = False
            out[e.key] = arr
    return State(out, layout.version)


def local_layout(c: Client, name: str) -> Optional[Layout]:
    """The layout of the version of ``name`` in ``c``'s store, None when there is none or it
    is not a state (its reference is let go before returning)."""
    try:
        view = c.get_buffer(name)
    except ObjectNotFound:
        return None
    try:
        return layout_of_object(np.frombuffer(view, np.uint8))
    except ProtocolError:
        return None
    finally:
        c.release(view)


def fetch_base(c: Client, name: str, meta: bytes) -> dict[str, Any]:
    """``fetch_from``'s base arguments for the version whose directory metadata is ``meta``:
    this store's version of ``name`` and the ranges the two share; {} when there is none."""
    new = layout_of_description(meta)
    old = local_layout(c, name) if new is not None else None
    if new is None or old is None or old.version == 0 or old.version >= new.version:
        return {}
    ranges = unchanged_ranges(old, new)
    return {"base_version": old.version, "base_ranges": ranges} if ranges else {}


# -- the cluster calls (re-exported by vovp.cluster) ---------------------------------------------


def publish_state(name: str, state_dict: Any, replace: bool = True) -> State:
    """Publish ``state_dict`` (str -> numpy arrays or torch tensors, CPU or CUDA; any number;
    dtypes, shapes and key order kept) as the next cluster-wide version of ``name``: ONE
    object in this node's store, its tensors copied straight into it and hashed in the same
    pass (no packing buffer). Returns its ``State`` (views of the store's copy; ``.version``).

    Versions as ``vc.publish``'s: the directory numbers the version, this process seals it
    here, the directory makes it current; until then readers get the previous version, and a
    writer dying in between leaves no half-made version anywhere. ``replace=False``:
    ObjectExists when ``name`` is published already."""
    version = _api.reserve(name, replace)
    state, layout = write_state(_api.client(), name, state_dict, version, replace)
    _api.commit(name, version, layout.size, describe(layout), replace, _api.node_id())
    return state


def fetch_state(name: str, newer_than: Optional[int] = None,
                timeout: Optional[float] = None) -> State:
    """The state dict published as ``name`` (``publish_state``), as a ``State`` of zero-copy
    views into this node's store: torch tensors for the tensors published from torch, numpy
    (read-only) for the others; ``.version`` is the cluster version, every tensor of it from
    that one version.

    ``newer_than=v``: a version above ``v``, waiting up to ``timeout`` seconds for one
    (``vc.fetch``'s walk: local store first, else one directory call, else one FETCH by this
    node's engine). When this node holds an older version, the tensors whose bytes did not
    change since (same key, dtype, shape, offset and content hash) are copied from it here
    and only the others cross the network. Errors as ``vc.fetch``'s; ProtocolError when
    ``name`` is not a state."""
    c = _api.client()
    based: list[int] = []

    def base_of(entry: Any) -> dict[str, Any]:
        base = fetch_base(c, name, entry.metadata)
        if base:
            based.append(base["base_version"])
        return base

    while True:
        try:
            got, _ = _fetch.fetch_object(c, _api.directory_actor(), _api.node_id(), name,
                                         newer_than=newer_than, timeout=timeout,
                                         writable=True, fetch_args=base_of)
            break
        except ObjectNotFound:
            # The base a FETCH named was replaced here meanwhile (another process of this
            # node fetched a newer version): once more, from what is here now.
            if not based or len(based) > 2:
                raise
    return state_of(np.asarray(got))
