"""The tests' frame encoder (_wire.py) and vovp.errors' status mapping, checked byte by byte
against PROTOCOL.md (no daemon)."""

import struct

import pytest

import vovp
from vovp import errors as E
import _wire as P


def test_header_layout():
    f = P.frame(P.STATS, 0x0102030405060708)
    assert f == struct.pack("<I", 12) + bytes([P.VERSION, 0x0C, 0, 0]) + bytes(
        [8, 7, 6, 5, 4, 3, 2, 1])
    assert len(f) == P.HEADER_SIZE


def test_no_reply_flag_and_release_payload():
    f = P.frame(P.RELEASE, 5, P.release_payload([1, 2, 2]), P.FLAG_NO_REPLY)
    length, version, op, flags, rid = P.HEADER.unpack_from(f)
    assert (length, version, op, flags, rid) == (12 + 4 + 24, P.VERSION, 0x07, 1, 5)
    assert f[16:] == struct.pack("<IQQQ", 3, 1, 2, 2)
    single = P.RELEASE1.pack(24, P.VERSION, P.RELEASE, P.FLAG_NO_REPLY, 5, 1, 9)
    assert single == P.frame(P.RELEASE, 5, P.release_payload([9]), P.FLAG_NO_REPLY)


def test_hello_payload():
    assert P.frame(P.HELLO, 1, P.hello_payload(1234))[16:] == struct.pack("<I", 1234)


def test_put_payload():
    head = P.put_payload_head(b"ab", P.OBJ_EPHEMERAL | P.OBJ_KEEP_REFERENCE, b"MD", 3)
    assert head == (struct.pack("<H", 2) + b"ab" + struct.pack("<I", 3) + struct.pack("<I", 2)
                    + b"MD" + struct.pack("<Q", 3))


def test_create_payload():
    p = P.create_payload(b"n", 100, P.OBJ_EPHEMERAL, b"xyz", P.DEVICE_CUDA, 3)
    assert p == (struct.pack("<H", 1) + b"n" + struct.pack("<QIBI", 100, 1, 2, 3)
                 + struct.pack("<I", 3) + b"xyz")


def test_get_payload_and_fast_prefix():
    p = P.get_payload([b"a", b"bc"], -1)
    assert p == struct.pack("<qI", -1, 2) + struct.pack("<H", 1) + b"a" + struct.pack(
        "<H", 2) + b"bc"
    nb = b"name"
    fast = P.GET1_PREFIX.pack(26 + len(nb), P.VERSION, P.GET, 0, 9, 250, 1, len(nb)) + nb
    assert fast == P.frame(P.GET, 9, P.get_payload([nb], 250))


def test_name_prefix_matches_generic_encoding():
    nb = "é".encode()
    fast = P.NAME_PREFIX.pack(14 + len(nb), P.VERSION, P.DELETE, 0, 3, len(nb)) + nb
    assert fast == P.frame(P.DELETE, 3, P.enc_str(nb))


@pytest.mark.parametrize("name", ["", "x" * 257, "x" * 300, b"\xff\xfe", "\udc80"])
def test_invalid_names(name):
    with pytest.raises(vovp.InvalidName):
        P.encode_name(name)


def test_valid_names():
    assert P.encode_name("x" * 256) == b"x" * 256
    assert P.encode_name("día") == "día".encode()
    assert P.encode_name(b"raw") == b"raw"
    with pytest.raises(TypeError):
        P.encode_name(12)


def test_metadata_limit():
    assert P.check_metadata(b"x" * 65536) == b"x" * 65536
    with pytest.raises(vovp.MetadataTooLarge):
        P.check_metadata(b"x" * 65537)


def test_timeout_conversion():
    assert P.timeout_ms(None) == 0
    assert P.timeout_ms(0) == 0
    assert P.timeout_ms(1.5) == 1500
    assert P.timeout_ms(-1) == -1
    assert P.timeout_ms(float("inf")) == -1


def _reply(opcode, rid, body):
    return P.HEADER.pack(12 + len(body), P.VERSION, opcode | P.REPLY_BIT, 0, rid) + body


def test_decode_host_objref():
    body = (b"\x00" + struct.pack("<QQBIQ", 77, 24, 1, 0, 128) + struct.pack("<I", 2) + b"md"
            + struct.pack("<Q", 3))
    buf = _reply(P.PUT, 4, body)
    pos = P.check_reply(buf, P.PUT, 4)
    ref, end = P.decode_objref(buf, pos)
    assert ref == P.ObjRef(77, 24, P.LOC_HOST, 0, 128, b"md", version=3)
    assert end == len(buf)


def test_decode_cuda_objref():
    handle = bytes(range(64))
    body = (b"\x00" + struct.pack("<QQB", 5, 4096, 2) + struct.pack("<IIQ", 1, 7, 512) + handle
            + struct.pack("<I", 0) + struct.pack("<Q", 0))
    buf = _reply(P.CREATE, 1, body)
    ref, end = P.decode_objref(buf, P.check_reply(buf, P.CREATE, 1))
    assert (ref.kind, ref.segment, ref.pool, ref.offset, ref.ipc_handle) == (2, 1, 7, 512,
                                                                              handle)
    assert end == len(buf)


def test_decode_get_reply():
    body = (b"\x00" + struct.pack("<I", 2) + b"\x00" + b"\x01"
            + struct.pack("<QQBIQ", 1, 8, 1, 0, 64) + struct.pack("<I", 0) + struct.pack("<Q", 1))
    buf = _reply(P.GET, 2, body)
    out = P.decode_get(buf, P.check_reply(buf, P.GET, 2))
    assert out[0] is None and out[1].object_id == 1 and out[1].offset == 64


def test_decode_stats_and_list():
    vals = list(range(1, len(P.STATS_FIELDS) + 1))
    buf = _reply(P.STATS, 3, b"\x00" + struct.pack("<%dQ" % len(vals), *vals))
    st = P.decode_stats(buf, P.check_reply(buf, P.STATS, 3))
    assert list(st) == list(P.STATS_FIELDS) and list(st.values()) == vals
    entry = (struct.pack("<H", 1) + b"a" + struct.pack("<QQBIBBIQ", 9, 10, 1, 0, 1, 0, 2, 5000)
             + struct.pack("<I", 1) + b"m" + struct.pack("<Q", 6))
    buf = _reply(P.LIST, 4, b"\x00" + struct.pack("<I", 1) + entry + struct.pack("<Q", 77))
    (e,), next_start = P.decode_list(buf, P.check_reply(buf, P.LIST, 4))
    assert next_start == 77
    assert e["name"] == "a" and e["id"] == 9 and e["size"] == 10 and e["sealed"]
    assert not e["ephemeral"] and e["refcount"] == 2 and e["last_access"] == 5.0
    assert e["metadata"] == b"m" and e["device"] == "cpu" and e["version"] == 6


def test_error_replies_map_every_status():
    for status in range(1, 21):
        body = bytes([status]) + struct.pack("<H", 3) + b"msg"
        if status == 3:
            body += struct.pack("<QQ", 1000, 10)
        buf = _reply(P.GET, 1, body)
        with pytest.raises(vovp.VovpError) as ei:
            P.check_reply(buf, P.GET, 1)
        assert ei.value.status == status
        assert type(ei.value) is E.STATUS_ERRORS[status]
        assert "msg" in str(ei.value)
        if status == 3:
            assert isinstance(ei.value, vovp.OutOfMemory)
            assert (ei.value.requested, ei.value.available) == (1000, 10)
    assert issubclass(vovp.ConnectionError, ConnectionError)
    assert issubclass(vovp.ShuttingDown, vovp.ConnectionError)
    assert issubclass(vovp.ObjectNotFound, KeyError)


def test_unknown_status_is_protocol_error():
    buf = _reply(P.GET, 1, bytes([99]) + struct.pack("<H", 0))
    with pytest.raises(vovp.ProtocolError):
        P.check_reply(buf, P.GET, 1)


def test_mismatched_reply_is_protocol_error():
    buf = _reply(P.GET, 1, b"\x00")
    with pytest.raises(vovp.ProtocolError) as ei:
        P.check_reply(buf, P.GET, 2)
    assert ei.value.status == 0
    with pytest.raises(vovp.ProtocolError):
        P.check_reply(buf, P.PUT, 1)


def test_truncated_objref():
    buf = _reply(P.PUT, 1, b"\x00" + struct.pack("<QQB", 1, 1, 1))
    with pytest.raises(vovp.ProtocolError):
        P.decode_objref(buf, P.check_reply(buf, P.PUT, 1))
