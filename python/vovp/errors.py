"""Exceptions raised by the vovp client.

Every reply status of PROTOCOL.md maps to exactly one class here (see ``STATUS_ERRORS``), so
callers can catch either a precise condition (``ObjectNotFound``) or everything from the store
(``VovpError``). ``__all__`` is the exception classes, which ``vovp`` exports as they are;
``STATUS_ERRORS`` and ``error_from_status`` are the package's (the native core raises through
the latter).
"""

from __future__ import annotations

import builtins

__all__ = [
    "VovpError",
    "ObjectNotFound",
    "ObjectExists",
    "OutOfMemory",
    "NotSealed",
    "AlreadySealed",
    "NotCreator",
    "InvalidName",
    "MetadataTooLarge",
    "NotHeld",
    "GpuUnavailable",
    "GpuError",
    "ProtocolError",
    "TooLarge",
    "ShuttingDown",
    "InternalError",
    "ConnectionError",
    "TooManyObjects",
    "InvalidArgument",
    "ObjectLost",
    "SpillDamaged",
    "StaleVersion",
    "TransferFailed",
]


class VovpError(Exception):
    """Base class of every error raised by vovp.

    ``status`` is the protocol status code of the reply that caused it (0 when the error was
    detected on the client side), ``message`` the daemon's human-readable text.
    """

    status = 0

    def __init__(self, message: str = "", status: int | None = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status


class ObjectNotFound(VovpError, KeyError):
    """No sealed object of that name (status 1), or a GET timed out."""

    status = 1

    # KeyError.__str__ would wrap the message in quotes; keep the plain text.
    __str__ = VovpError.__str__


class ObjectExists(VovpError):
    """The name is already taken (status 2)."""

    status = 2


class OutOfMemory(VovpError, MemoryError):
    """No room even after evicting every unreferenced object (status 3).

    ``requested`` and ``available`` are in bytes, as reported by the daemon.
    """

    status = 3

    def __init__(self, message: str = "", status: int | None = None,
                 requested: int = 0, available: int = 0):
        super().__init__(message, status)
        self.requested = requested
        self.available = available


class NotSealed(VovpError):
    """The object is not sealed (status 4)."""

    status = 4


class AlreadySealed(VovpError):
    """Seal or abort of an object that is already sealed (status 5)."""

    status = 5


class NotCreator(VovpError):
    """Seal or abort by a client that did not create the object (status 6)."""

    status = 6


class InvalidName(VovpError, ValueError):
    """Name empty, longer than 256 bytes, or not UTF-8 (status 7)."""

    status = 7


class MetadataTooLarge(VovpError, ValueError):
    """Metadata over 65536 bytes (status 8)."""

    status = 8


class NotHeld(VovpError):
    """Release of an object id this connection does not hold (status 9)."""

    status = 9


class GpuUnavailable(VovpError):
    """No CUDA driver/device, or a CUDA object reached a client that cannot map it (status 10)."""

    status = 10


class GpuError(VovpError):
    """A CUDA driver call failed, in the daemon (status 11) or in this client."""

    status = 11


class ProtocolError(VovpError):
    """The two sides disagree about the wire format or the connection state.

    Raised for MALFORMED (12), UNSUPPORTED_VERSION (13), UNKNOWN_OPCODE (14), PROTOCOL_STATE (18),
    unknown status codes, and replies the client cannot parse. ``status`` is 0 when the client
    itself detected the problem (e.g. a reply that does not match its request).
    """

    status = 0


class TooLarge(VovpError, ValueError):
    """Frame over the limit, or an inline put over ``max_inline`` (status 15)."""

    status = 15


class TooManyObjects(VovpError, MemoryError):
    """The store holds its maximum number of objects (2^20) and none can be evicted (status 19)."""

    status = 19


class InvalidArgument(VovpError, ValueError):
    """An argument no request could carry (e.g. a negative size); raised by this client."""

    status = 0


class ConnectionError(VovpError, builtins.ConnectionError):  # noqa: A001 (deliberate shadowing)
    """The connection to the daemon failed or was closed.

    Also a :class:`builtins.ConnectionError`, so generic network error handling catches it.
    """

    def __init__(self, message: str = "", status: int | None = None):
        VovpError.__init__(self, message, status)


class ShuttingDown(ConnectionError):
    """The daemon is stopping (status 16)."""

    status = 16


class InternalError(VovpError):
    """A daemon bug (status 17)."""

    status = 17


class StaleVersion(VovpError):
    """An explicit version is not above the name's present one (status 22): a newer version
    is there already. ``current`` and ``requested`` are the two versions."""

    status = 22

    def __init__(self, message: str = "", status: int | None = None,
                 current: int = 0, requested: int = 0):
        super().__init__(message, status)
        self.current = current
        self.requested = requested


class TransferFailed(VovpError):
    """A fetch or gather between engines failed (status 23): the holder refused the ticket,
    died or stopped sending, or its port could not be reached. Nothing of it is visible."""

    status = 23


class ObjectLost(VovpError):
    """vovp.cluster: every node that held the object is gone (Ray reports it dead, or its
    agent and store died); the message names the nodes. Never a store reply status."""


class SpillDamaged(ObjectLost):
    """A spilled object's file was damaged, truncated or removed (status 21): the message
    names the object; it is gone, and its bytes were never handed out."""

    status = 21


STATUS_ERRORS: dict[int, type[VovpError]] = {
    1: ObjectNotFound,
    2: ObjectExists,
    3: OutOfMemory,
    4: NotSealed,
    5: AlreadySealed,
    6: NotCreator,
    7: InvalidName,
    8: MetadataTooLarge,
    9: NotHeld,
    10: GpuUnavailable,
    11: GpuError,
    12: ProtocolError,
    13: ProtocolError,
    14: ProtocolError,
    15: TooLarge,
    16: ShuttingDown,
    17: InternalError,
    18: ProtocolError,
    19: TooManyObjects,
    20: ConnectionError,
    21: SpillDamaged,
    22: StaleVersion,
    23: TransferFailed,
}

STATUS_NAMES = {
    1: "NOT_FOUND",
    2: "ALREADY_EXISTS",
    3: "OUT_OF_MEMORY",
    4: "NOT_SEALED",
    5: "ALREADY_SEALED",
    6: "NOT_CREATOR",
    7: "INVALID_NAME",
    8: "METADATA_TOO_LARGE",
    9: "NOT_HELD",
    10: "GPU_UNAVAILABLE",
    11: "GPU_ERROR",
    12: "MALFORMED",
    13: "UNSUPPORTED_VERSION",
    14: "UNKNOWN_OPCODE",
    15: "TOO_LARGE",
    16: "SHUTTING_DOWN",
    17: "INTERNAL",
    18: "PROTOCOL_STATE",
    19: "TOO_MANY_OBJECTS",
    20: "TOO_MANY_CONNECTIONS",
    21: "SPILL_DAMAGED",
    22: "STALE_VERSION",
    23: "TRANSFER_FAILED",
}


def error_from_status(status: int, message: str, requested: int = 0,
                      available: int = 0) -> VovpError:
    """The exception for a non-zero reply status."""
    cls = STATUS_ERRORS.get(status, ProtocolError)
    name = STATUS_NAMES.get(status, f"status {status}")
    text = f"{name}: {message}" if message else name
    if cls is OutOfMemory:
        return OutOfMemory(text, status, requested=requested, available=available)
    if cls is StaleVersion:
        # (The figures of STALE_VERSION are its current and requested versions.)
        return StaleVersion(text, status, current=requested, requested=available)
    return cls(text, status)
