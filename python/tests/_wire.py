"""The wire format of PROTOCOL.md (version 2) in Python, for tests only: the tests that send
frames no client would send (malformed, truncated, out of order) build them here. The vovp
package itself has no wire code: its client is the Rust one (vovp._native over vovp-client),
and this module is checked byte by byte against PROTOCOL.md by test_protocol.py.

Layout reminders (all little-endian):

    frame   = u32 length (= 12 + payload) | u8 version | u8 opcode | u16 flags | u64 request_id
    str     = u16 n | n bytes UTF-8
    bytes   = u32 n | n bytes
    loc     = u8 kind; kind 1: u32 segment, u64 offset; kind 2: u32 device, u32 pool, u64 offset,
              64 bytes CUipcMemHandle
    objref  = u64 object_id | u64 data_size | loc | bytes metadata | u64 version
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from vovp.errors import (
    InvalidName,
    MetadataTooLarge,
    ProtocolError,
    error_from_status,
)

VERSION = 2

# Opcodes (requests). A reply carries ``opcode | REPLY_BIT``.
HELLO = 0x01
CREATE = 0x02
SEAL = 0x03
ABORT = 0x04
PUT = 0x05
GET = 0x06
RELEASE = 0x07
CONTAINS = 0x08
DELETE = 0x09
LIST = 0x0A
EVICT = 0x0B
STATS = 0x0C
SUBSCRIBE = 0x0D
NOTIFY = 0x0E
SEGMENT = 0x0F
GET_NEWER = 0x13
REPLY_BIT = 0x80

# Frame flags.
FLAG_NO_REPLY = 0x0001

# CREATE / PUT flags.
OBJ_EPHEMERAL = 0x1
OBJ_KEEP_REFERENCE = 0x2  # PUT only
OBJ_REPLACE = 0x8

# Location kinds and DLPack device types.
LOC_HOST = 1
LOC_CUDA = 2
DEVICE_CPU = 1
DEVICE_CUDA = 2

# Notification kinds.
NOTIFY_SEALED = 1
NOTIFY_DELETED = 2
NOTIFY_EVICTED = 3

MAX_NAME = 256
MAX_METADATA = 65536
MAX_PAYLOAD = 64 << 20
HEADER_SIZE = 16  # length field + the 12 bytes it counts

STATS_FIELDS = (
    "capacity",
    "used_bytes",
    "objects",
    "sealed",
    "unsealed",
    "pending_delete",
    "references",
    "holders",
    "creates",
    "evicted_objects",
    "evicted_bytes",
    "connections",
    "shared_holds",
    "waiting_gets",
    "put_barriers",
    "half_closed",
    # Since spilling (a STATS with `u32 fields` asks for them; an empty one gets the 16 above).
    "spilled_objects",
    "spilled_bytes",
    "spills",
    "spill_bytes",
    "restores",
    "restore_bytes",
    "spill_failures",
    "restore_failures",
)
STATS_FIELDS_FIRST = 16  # what a STATS with an empty payload answers

# --- precompiled structs -------------------------------------------------------------------

HEADER = struct.Struct("<IBBHQ")
U8 = struct.Struct("<B")
U16 = struct.Struct("<H")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
I64 = struct.Struct("<q")
# Reply prefix: header then the status byte.
REPLY_HEAD = struct.Struct("<IBBHQB")
# objref up to and including the location kind; then the host or cuda location.
OBJREF_HEAD = struct.Struct("<QQB")
LOC_HOST_S = struct.Struct("<IQ")
LOC_CUDA_S = struct.Struct("<IIQ64s")
# Fast path for the commonest objref: host location followed by the metadata length.
OBJREF_HOST = struct.Struct("<QQBIQI")
HELLO_REPLY = struct.Struct("<HQII")
HELLO_SEGMENT = struct.Struct("<IQ")
# Request prefixes that end right where a variable-length name starts.
GET1_PREFIX = struct.Struct("<IBBHQqIH")  # header, timeout_ms, n = 1, name length
NAME_PREFIX = struct.Struct("<IBBHQH")  # header, name length (SEAL/ABORT/CONTAINS/DELETE)
PUT_PREFIX = struct.Struct("<IBBHQH")  # header, name length; then name, flags/metadata...
PUT_MID = struct.Struct("<II")  # flags, metadata length
CREATE_MID = struct.Struct("<QIBII")  # data_size, flags, device_type, device_id, metadata length
RELEASE1 = struct.Struct("<IBBHQIQ")  # header, n = 1, id
LIST_ENTRY_MID = struct.Struct("<QQBIBBIQI")  # id, size, dev type, dev id, sealed, eph, refs,
#                                               last access, metadata length


class ObjRef(NamedTuple):
    """An object as the daemon describes it (``objref``)."""

    object_id: int
    data_size: int
    kind: int  # LOC_HOST or LOC_CUDA
    segment: int  # host: segment id; cuda: device ordinal
    offset: int
    metadata: bytes
    pool: int = 0  # cuda only
    ipc_handle: bytes = b""  # cuda only
    version: int = 0  # the name's version (0 before the seal)


_tuple_new = tuple.__new__


class Hello(NamedTuple):
    protocol_version: int
    capacity: int
    max_inline: int
    segments: list  # [(segment_id, size)]


# --- encoding ------------------------------------------------------------------------------


def encode_name(name) -> bytes:
    """UTF-8 bytes of an object name, checked against the protocol's 1..=256 byte rule.

    Checked here rather than left to the daemon so that an oversized name cannot overflow the
    u16 length field and desynchronise the stream.
    """
    if type(name) is str:
        try:
            b = name.encode()
        except UnicodeEncodeError as e:  # lone surrogates
            raise InvalidName(f"name is not valid UTF-8: {e}", 7) from None
        if 0 < len(b) <= MAX_NAME:
            return b
    elif isinstance(name, str):
        return encode_name(str(name))
    elif isinstance(name, (bytes, bytearray, memoryview)):
        b = bytes(name)
        try:
            b.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidName(f"name is not valid UTF-8: {e}", 7) from None
    else:
        raise TypeError(f"object names are str, not {type(name).__name__}")
    if not 0 < len(b) <= MAX_NAME:
        raise InvalidName(f"names are 1..={MAX_NAME} bytes of UTF-8, got {len(b)} bytes", 7)
    return b


def check_metadata(metadata) -> bytes:
    b = bytes(metadata)
    if len(b) > MAX_METADATA:
        raise MetadataTooLarge(
            f"metadata is {len(b)} bytes, the limit is {MAX_METADATA}", 8)
    return b


def frame(opcode: int, request_id: int, payload: bytes = b"", flags: int = 0) -> bytes:
    """A complete request frame."""
    return HEADER.pack(12 + len(payload), VERSION, opcode, flags, request_id) + payload


def enc_str(b: bytes) -> bytes:
    return U16.pack(len(b)) + b


def enc_bytes(b: bytes) -> bytes:
    return U32.pack(len(b)) + b


def hello_payload(pid: int) -> bytes:
    return U32.pack(pid)


def create_payload(name: bytes, size: int, flags: int, metadata: bytes,
                   device_type: int = DEVICE_CPU, device_id: int = 0) -> bytes:
    return (U16.pack(len(name)) + name
            + CREATE_MID.pack(size, flags, device_type, device_id, len(metadata)) + metadata)


def put_payload_head(name: bytes, flags: int, metadata: bytes, size: int) -> bytes:
    """PUT payload up to (not including) the data bytes, which follow to the end of the frame."""
    return (U16.pack(len(name)) + name + PUT_MID.pack(flags, len(metadata)) + metadata
            + U64.pack(size))


def get_payload(names: list, timeout_ms: int) -> bytes:
    parts = [I64.pack(timeout_ms), U32.pack(len(names))]
    for n in names:
        parts.append(U16.pack(len(n)))
        parts.append(n)
    return b"".join(parts)


def release_payload(ids) -> bytes:
    ids = list(ids)
    return U32.pack(len(ids)) + struct.pack(f"<{len(ids)}Q", *ids)


def timeout_ms(timeout) -> int:
    """Protocol timeout from a Python one: None = don't wait, negative/inf = forever, else seconds."""
    if timeout is None:
        return 0
    if timeout < 0 or timeout == float("inf"):
        return -1
    return int(round(timeout * 1000))


# --- decoding ------------------------------------------------------------------------------


def check_reply(buf, opcode: int, request_id: int) -> int:
    """Validate a reply frame's header; raise the mapped error when status != 0.

    Returns the offset of the reply body (just after the status byte).
    """
    if len(buf) < HEADER_SIZE + 1:
        raise ProtocolError(f"reply of {len(buf)} bytes is too short")
    _length, version, op, _flags, rid, status = REPLY_HEAD.unpack_from(buf, 0)
    if version != VERSION:
        raise ProtocolError(f"reply has protocol version {version}, expected {VERSION}")
    if status:
        raise decode_error(buf, HEADER_SIZE)
    if op != (opcode | REPLY_BIT) or rid != request_id:
        raise ProtocolError(
            f"reply opcode {op:#x}/id {rid} does not match request {opcode:#x}/id {request_id}")
    return HEADER_SIZE + 1


def decode_error(buf, pos: int):
    """The exception for an error reply whose status byte is at ``pos``."""
    status = buf[pos]
    pos += 1
    message = ""
    requested = available = 0
    try:
        (n,) = U16.unpack_from(buf, pos)
        pos += 2
        message = bytes(buf[pos:pos + n]).decode("utf-8", "replace")
        pos += n
        if status == 3:
            requested, available = struct.unpack_from("<QQ", buf, pos)
    except struct.error:
        pass  # a short error reply still tells us the status
    return error_from_status(status, message, requested, available)


def decode_str(buf, pos: int):
    (n,) = U16.unpack_from(buf, pos)
    pos += 2
    end = pos + n
    if end > len(buf):
        raise ProtocolError("truncated string in reply")
    return bytes(buf[pos:end]).decode("utf-8", "replace"), end


def decode_bytes(buf, pos: int):
    (n,) = U32.unpack_from(buf, pos)
    pos += 4
    end = pos + n
    if end > len(buf):
        raise ProtocolError("truncated byte string in reply")
    return bytes(buf[pos:end]), end


def decode_objref(buf, pos: int):
    """Parse an ``objref`` at ``pos``; returns (ObjRef, new position)."""
    try:
        oid, size, kind, seg, off, mlen = OBJREF_HOST.unpack_from(buf, pos)
        if kind == LOC_HOST:
            pos += 33  # OBJREF_HOST.size
            end = pos + mlen
            if end + 8 > len(buf):
                raise ProtocolError("truncated metadata in reply")
            (version,) = U64.unpack_from(buf, end)
            # tuple.__new__ skips the namedtuple's Python-level __new__ (hot path).
            return _tuple_new(ObjRef, (oid, size, kind, seg, off, bytes(buf[pos:end]), 0,
                                       b"", version)), end + 8
        oid, size, kind = OBJREF_HEAD.unpack_from(buf, pos)
        pos += OBJREF_HEAD.size
        if kind == LOC_CUDA:
            dev, pool, off, handle = LOC_CUDA_S.unpack_from(buf, pos)
            pos += LOC_CUDA_S.size
            meta, pos = decode_bytes(buf, pos)
            (version,) = U64.unpack_from(buf, pos)
            return ObjRef(oid, size, kind, dev, off, meta, pool, handle, version), pos + 8
    except struct.error:
        raise ProtocolError("truncated objref in reply") from None
    raise ProtocolError(f"unknown location kind {kind}")


def decode_hello(buf, pos: int) -> Hello:
    try:
        version, capacity, max_inline, n = HELLO_REPLY.unpack_from(buf, pos)
        pos += HELLO_REPLY.size
        segs = []
        for _ in range(n):
            segs.append(HELLO_SEGMENT.unpack_from(buf, pos))
            pos += HELLO_SEGMENT.size
    except struct.error:
        raise ProtocolError("truncated HELLO reply") from None
    return Hello(version, capacity, max_inline, segs)


def decode_get(buf, pos: int) -> list:
    """GET reply body: a list with an ObjRef or None per requested name."""
    (n,) = U32.unpack_from(buf, pos)
    pos += 4
    out = []
    for _ in range(n):
        found = buf[pos]
        pos += 1
        if found:
            ref, pos = decode_objref(buf, pos)
            out.append(ref)
        else:
            out.append(None)
    return out


LIST_END = 2**64 - 1  # ``next`` cursor of the last LIST page


def list_payload(start: int) -> bytes:
    """LIST request: one page from cursor ``start`` (limit 0: the daemon's page size)."""
    return U64.pack(start) + U32.pack(0)


def decode_list(buf, pos: int) -> tuple:
    """LIST reply body: (a list of dicts, metadata left raw under ``"metadata"``; the cursor of
    the next page, ``LIST_END`` after the last)."""
    (n,) = U32.unpack_from(buf, pos)
    pos += 4
    out = []
    try:
        for _ in range(n):
            name, pos = decode_str(buf, pos)
            (oid, size, dtype_, dev_id, sealed, eph, refs, last, mlen) = \
                LIST_ENTRY_MID.unpack_from(buf, pos)
            pos += LIST_ENTRY_MID.size
            meta = bytes(buf[pos:pos + mlen])
            pos += mlen
            (version,) = U64.unpack_from(buf, pos)
            pos += 8
            out.append({
                "name": name,
                "id": oid,
                "size": size,
                "device": "cuda" if dtype_ == DEVICE_CUDA else "cpu",
                "device_type": dtype_,
                "device_id": dev_id,
                "sealed": bool(sealed),
                "ephemeral": bool(eph),
                "refcount": refs,
                "last_access": last / 1000.0,  # unix seconds, like time.time()
                "metadata": meta,
                "version": version,
            })
        (next_start,) = U64.unpack_from(buf, pos)
    except (struct.error, IndexError):
        raise ProtocolError("truncated LIST reply") from None
    return out, next_start


def decode_stats(buf, pos: int) -> dict:
    """The fields the reply carries: every field, or the first 16 (an empty STATS' answer)."""
    n = min((len(buf) - pos) // 8, len(STATS_FIELDS))
    if n < STATS_FIELDS_FIRST:
        raise ProtocolError("truncated STATS reply")
    return dict(zip(STATS_FIELDS, struct.unpack_from("<%dQ" % n, buf, pos)))


def decode_notify(buf, pos: int):
    """NOTIFY payload: (kind, name, data_size, metadata, version)."""
    kind = buf[pos]
    name, pos = decode_str(buf, pos + 1)
    (size,) = U64.unpack_from(buf, pos)
    meta, pos = decode_bytes(buf, pos + 8)
    (version,) = U64.unpack_from(buf, pos)
    return kind, name, size, meta, version


def segment_payload(segment_id: int) -> bytes:
    """SEGMENT request: the fd of a segment this client has not mapped yet."""
    return U32.pack(segment_id)


def decode_segment(buf, pos: int) -> tuple:
    """SEGMENT reply body: (size, writable); the fd rides on the reply as SCM_RIGHTS."""
    try:
        size, writable = struct.unpack_from("<QB", buf, pos)
    except struct.error:
        raise ProtocolError("truncated SEGMENT reply") from None
    return size, bool(writable)
