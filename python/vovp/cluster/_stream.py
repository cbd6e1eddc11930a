"""The data path between two nodes' agents: one TCP stream per transfer, straight from the
holder's store memory into the receiver's.

Ray carries the control messages (which node holds what, an offer of one object); the bytes
go over a plain TCP connection because that is the only way to land them in the receiving
node's vovp store with one copy: ``recv_into`` writes into the object the agent created there.
Bytes through Ray's object store would be copied into the sender's plasma store, across, and
once more from the receiver's plasma store into vovp (vovp.cluster's module doc).

An offer is a one-time 128-bit ticket handed out over Ray to the agent that asked for it; the
server sends nothing to a connection that does not present a live ticket. Tickets expire
after ``OFFER_TTL`` seconds, releasing the object they held.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from typing import Any

from .._sockets import recv_exactly

TICKET_BYTES = 16
# An offer not claimed by then is dropped (the receiver died or gave up): it holds a reference.
OFFER_TTL = 60.0
# recv_into reads at most this much per call: large enough to keep syscalls rare.
CHUNK = 16 << 20


class TransferBroken(Exception):
    """The stream ended or stalled before every byte arrived (the holder died or stopped)."""


class StreamServer:
    """Serves offered buffers, each to the one connection that presents its ticket."""

    def __init__(self, host: str, stall_timeout: float):
        self._listener = socket.create_server((host, 0), backlog=128)
        self.address = self._listener.getsockname()[:2]
        self._stall_timeout = stall_timeout
        self._offers: dict[Any, Any] = {}  # ticket -> (buffer, expiry, on_done)
        self._lock = threading.Lock()
        self._closed = False
        self.bytes_sent = 0
        threading.Thread(target=self._accept_loop, name="vovp-stream-accept",
                         daemon=True).start()
        threading.Thread(target=self._expire_loop, name="vovp-stream-expire",
                         daemon=True).start()

    def offer(self, buf, on_done) -> bytes:
        """Offer ``buf`` (a bytes-like view) for one transfer; ``on_done()`` runs once it was
        sent, failed, was withdrawn or expired. Returns the ticket."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        with self._lock:
            self._offers[ticket] = (buf, time.monotonic() + OFFER_TTL, on_done)
        return ticket

    def withdraw(self, ticket: bytes) -> None:
        """Drop an offer the receiver will not claim (it failed before connecting)."""
        with self._lock:
            entry = self._offers.pop(ticket, None)
        if entry is not None:
            entry[2]()

    def _expire_loop(self) -> None:
        # Unclaimed offers hold a reference to their object: drop them on time even when no
        # other offer comes along.
        while not self._closed:
            time.sleep(min(OFFER_TTL / 4, 5.0))
            now = time.monotonic()
            with self._lock:
                expired = [t for t, (_, expiry, _) in self._offers.items() if expiry < now]
                dropped = [self._offers.pop(t) for t in expired]
            for _, _, done in dropped:
                done()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            dropped, self._offers = list(self._offers.values()), {}
        for _, _, done in dropped:
            done()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
                threading.Thread(target=self._serve, args=(conn,), name="vovp-stream-send",
                                 daemon=True).start()
            except (OSError, RuntimeError):
                # Out of descriptors or threads (e.g. a flood of idle connections, which
                # each end after stall_timeout): keep serving once they are back.
                if not self._closed:
                    time.sleep(0.05)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(self._stall_timeout)
            try:
                ticket = recv_exactly(conn, TICKET_BYTES, _closed)
            except (OSError, TransferBroken):
                return
            with self._lock:
                entry = self._offers.pop(ticket, None)
            if entry is None:
                return  # unknown or expired ticket: the receiver sees the stream end early
            buf, _, on_done = entry
            try:
                # Slice by slice: a socket timeout bounds each send() call, but sendall's
                # whole run, which for a large object would fail any slow transfer.
                view = memoryview(buf).cast("B")
                for off in range(0, len(view), CHUNK):
                    conn.sendall(view[off:off + CHUNK])
                with self._lock:
                    self.bytes_sent += len(view)
            except OSError:
                pass  # the receiver went away; it reports the failure on its side
            finally:
                on_done()


def receive(address, ticket: bytes, dst: memoryview, stall_timeout: float) -> None:
    """Fill ``dst`` from the offer ``ticket`` at ``address``; raises TransferBroken when the
    stream ends early or no byte arrives for ``stall_timeout`` seconds."""
    total = len(dst)
    got = 0
    try:
        with socket.create_connection(tuple(address), timeout=stall_timeout) as conn:
            conn.sendall(ticket)
            while got < total:
                n = conn.recv_into(dst[got:], min(total - got, CHUNK))
                if n == 0:
                    break
                got += n
    except OSError as e:
        raise TransferBroken(f"{got} of {total} bytes arrived from {address[0]}:{address[1]}: "
                             f"{e}") from None
    if got < total:
        raise TransferBroken(f"{got} of {total} bytes arrived from {address[0]}:{address[1]}: "
                             "the stream ended early")


def _closed() -> TransferBroken:
    return TransferBroken("connection closed")
