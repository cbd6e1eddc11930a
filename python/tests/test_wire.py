"""The daemon against PROTOCOL.md, at the frame level (raw sockets, no Client logic)."""

import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

import vovp
import _wire as P


class Raw:
    """A bare connection: send frames, read frames."""

    def __init__(self, path, hello=True):
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.connect(path)
        self.s.settimeout(10)
        self.buf = b""
        self.fds = []
        if hello:
            self.send(P.frame(P.HELLO, 1, P.hello_payload(os.getpid())))
            self.hello = self.read(fds=True)

    def send(self, data):
        self.s.sendall(data)

    def read(self, fds=False):
        while len(self.buf) < 4 or len(self.buf) < 4 + struct.unpack_from("<I", self.buf)[0]:
            if fds:
                chunk, got, _, _ = socket.recv_fds(self.s, 65536, 64)
                self.fds += got
            else:
                chunk = self.s.recv(65536)
            if not chunk:
                raise EOFError
            self.buf += chunk
        n = 4 + struct.unpack_from("<I", self.buf)[0]
        frame, self.buf = self.buf[:n], self.buf[n:]
        return frame

    def call(self, opcode, rid, payload=b"", flags=0):
        self.send(P.frame(opcode, rid, payload, flags))
        return self.read()

    def closed_by_peer(self):
        try:
            while True:
                if not self.s.recv(65536):
                    return True
        except (ConnectionResetError, socket.timeout):
            return False

    def close(self):
        for fd in self.fds:
            os.close(fd)
        self.s.close()


def header(frame):
    _, version, op, flags, rid = P.HEADER.unpack_from(frame)
    return version, op, flags, rid, frame[16] if len(frame) > 16 else None


def test_hello_reply_and_fds(daemon):
    r = Raw(daemon.socket)
    version, op, _, rid, status = header(r.hello)
    assert (version, op, rid, status) == (P.VERSION, 0x81, 1, 0)
    h = P.decode_hello(r.hello, 17)
    assert h.protocol_version == P.VERSION and h.capacity == daemon.memory
    assert len(h.segments) == len(r.fds) >= 1
    assert sum(size for _, size in h.segments) >= h.capacity
    assert h.max_inline > 0
    r.close()


def test_request_before_hello_is_protocol_state(daemon):
    r = Raw(daemon.socket, hello=False)
    f = r.call(P.STATS, 5)
    assert header(f)[4] == 18
    r.close()


def test_second_hello_is_protocol_state(daemon):
    r = Raw(daemon.socket)
    f = r.call(P.HELLO, 2, P.hello_payload(1))
    assert header(f)[3:] == (2, 18)
    r.close()


def test_bad_version_closes_connection(daemon):
    r = Raw(daemon.socket)
    r.send(struct.pack("<IBBHQ", 12, 9, P.STATS, 0, 3))
    f = r.read()
    assert header(f)[4] == 13
    assert r.closed_by_peer()
    r.close()


def test_oversized_frame_closes_connection(daemon):
    r = Raw(daemon.socket)
    r.send(struct.pack("<IBBHQ", 12 + (64 << 20) + 1, P.VERSION, P.PUT, 0, 3))
    f = r.read()
    assert header(f)[4] == 15
    assert r.closed_by_peer()
    r.close()


def test_short_length_closes_connection(daemon):
    r = Raw(daemon.socket)
    # A whole 16-byte header whose length field (4) is below the 12 it must count. (The daemon
    # reads the full header before judging it, so a shorter write just waits for more bytes.)
    r.send(struct.pack("<IBBHQ", 4, P.VERSION, P.STATS, 0, 3))
    f = r.read()
    assert header(f)[4] == 12  # MALFORMED
    assert r.closed_by_peer()
    r.close()


def test_no_reply_release_gets_no_reply_even_when_not_held(daemon):
    """RELEASE with NO_REPLY of an id this connection does not hold: still no reply."""
    r = Raw(daemon.socket)
    r.send(P.frame(P.RELEASE, 7, P.release_payload([12345]), P.FLAG_NO_REPLY))
    f = r.call(P.STATS, 8)
    assert header(f)[3:] == (8, 0)
    r.close()


def test_release_with_reply(daemon):
    r = Raw(daemon.socket)
    f = r.call(P.PUT, 2, P.put_payload_head(b"k", P.OBJ_KEEP_REFERENCE, b"", 1) + b"x")
    ref, _ = P.decode_objref(f, 17)
    f = r.call(P.RELEASE, 3, P.release_payload([ref.object_id]))
    assert header(f)[3:] == (3, 0) and len(f) == 17
    f = r.call(P.RELEASE, 4, P.release_payload([ref.object_id]))
    assert header(f)[3:] == (4, 9)  # NOT_HELD
    r.close()


def test_put_over_max_inline(daemon):
    r = Raw(daemon.socket)
    h = P.decode_hello(r.hello, 17)
    size = h.max_inline + 1
    if size > 64 << 20:
        pytest.skip("max_inline is the frame limit")
    f = r.call(P.PUT, 2, P.put_payload_head(b"big", 0, b"", size) + bytes(size))
    assert header(f)[3:] == (2, 15)
    f = r.call(P.STATS, 3)  # still usable
    assert header(f)[3:] == (3, 0)
    r.close()


def test_get_multiple_names_and_order(daemon):
    r = Raw(daemon.socket)
    for i, name in enumerate([b"a", b"c"]):
        r.call(P.PUT, 10 + i, P.put_payload_head(name, 0, b"m" + name, 1) + name)
    f = r.call(P.GET, 20, P.get_payload([b"a", b"b", b"c"], 0))
    out = P.decode_get(f, 17)
    assert out[1] is None
    assert out[0].metadata == b"ma" and out[2].metadata == b"mc"
    assert out[0].offset % 64 == 0 and out[2].offset % 64 == 0
    r.close()


def test_get_forever_waits_for_seal(daemon):
    r = Raw(daemon.socket)
    creator = vovp.Client(daemon.socket)
    buf = creator.create("w", 4)

    def seal():
        time.sleep(0.3)
        buf[:] = 7
        creator.seal("w")

    th = threading.Thread(target=seal)
    th.start()
    f = r.call(P.GET, 5, P.get_payload([b"w"], -1))
    (ref,) = P.decode_get(f, 17)
    assert ref is not None and ref.data_size == 4
    th.join()
    r.close()
    creator.close()


def test_pipelined_requests_answered_in_order(daemon):
    r = Raw(daemon.socket)
    r.send(b"".join(P.frame(P.CONTAINS, 100 + i, P.enc_str(b"x")) for i in range(50)))
    assert [header(r.read())[3] for _ in range(50)] == list(range(100, 150))
    r.close()


def test_notify_frames(daemon):
    sub = Raw(daemon.socket)
    f = sub.call(P.SUBSCRIBE, 2)
    assert header(f)[3:] == (2, 0)
    c = vovp.Client(daemon.socket)
    c.put("n", b"abc", metadata=b"M")
    f = sub.read()
    version, op, _, rid, _ = header(f)
    assert (op, rid) == (P.NOTIFY, 0)
    assert P.decode_notify(f, 16) == (P.NOTIFY_SEALED, "n", 3, b"M", 1)
    c.close()
    sub.close()


def test_object_offsets_are_in_segment_and_aligned(daemon):
    c = vovp.Client(daemon.socket)
    for i in range(20):
        c.put(f"o{i}", bytes(i * 37 + 1))
    r = Raw(daemon.socket)
    segs = dict(P.decode_hello(r.hello, 17).segments)
    f = r.call(P.GET, 3, P.get_payload([f"o{i}".encode() for i in range(20)], 0))
    for ref in P.decode_get(f, 17):
        assert ref.offset % 64 == 0
        assert ref.offset + ref.data_size <= segs[ref.segment]
    r.close()
    c.close()


def test_stats_after_disconnect(daemon):
    c = vovp.Client(daemon.socket)
    keep = c.put_tensor("held", np.zeros(4))
    c.create("unsealed", 16)
    c.close()  # the socket closes: the protocol has no goodbye
    w = vovp.Client(daemon.socket)
    from _helpers import wait_for
    assert wait_for(lambda: w.stats()["references"] == 0 and w.stats()["unsealed"] == 0)
    assert w.contains("held") and not w.contains("unsealed")
    del keep
    w.close()
