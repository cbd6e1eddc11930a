"""What the package's own streams read from a socket in one way: exactly ``n`` bytes, or the
stream's own error when the peer closes first (the Plasma drop-in's notification socket, the
cluster's transfer streams)."""

from __future__ import annotations

import socket
from typing import Callable


def recv_exactly(sock: socket.socket, n: int, ended: Callable[[], BaseException]) -> bytes:
    """The next ``n`` bytes of ``sock``; ``ended()`` is raised when the stream ends before."""
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ended()
        out += chunk
    return bytes(out)
