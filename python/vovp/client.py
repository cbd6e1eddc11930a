"""The vovp client: one connection to ``vovp-engine`` plus the mappings of its segments.

Zero-copy and reference lifetime
--------------------------------
Every object this client hands out (put, get, create) is backed by one *owner*: a 1-D uint8
numpy array made with ``np.frombuffer`` over the segment mapping. Returned arrays are views of
the owner. numpy collapses ``.base`` chains, but it stops at the first array whose base is not
an ndarray; the owner's base is a memoryview, so every array derived from a returned one (slices,
reshapes, transposes, ``torch.from_numpy``, ``memoryview(arr)``) keeps the owner alive. A
``weakref`` on the owner therefore fires only when the last user-visible view is gone, and its
callback releases the store reference (RELEASE with NO_REPLY, so garbage collection never waits
for the daemon). ``np.frombuffer`` itself cannot be the anchor of a plain memoryview: numpy takes
its own memoryview of the buffer, so a weakref on ours would fire too early.

The weakrefs live in the module-level ``_LEASES`` table, which also keeps their client alive:
dropping the last reference to a ``Client`` while arrays from it are alive must not close the
connection (which would release the references and let the daemon reuse the memory).

Release callbacks can run on any thread, including one that is inside a request of this
client, so they never wait for the lock: they queue the object id. The queue is sent in front of
the next request (same sendall), or by a small flusher thread after ``release_delay`` (2 ms) if
the client stays idle. ``release_delay=0`` sends at once when the lock is free instead.

Fork: a child must not talk on its parent's socket. A client used in another process than the
one that created it raises ConnectionError, and its release callbacks do nothing (the parent's
connection owns those references); ``vovp.default_client()`` opens a new connection per process.

CUDA objects use the same machinery with a different owner: a ``cuda.DeviceBuffer`` (one view
of the CUDA IPC mapping of the object's pool, see cuda.py) instead of a numpy array. Its lease
has ``cuda=True`` and ``segment=None`` (so host address lookups never match it) and ``offset`` is
the device address. What the user gets (a ``CudaTensor``, or a torch tensor that torch made
from an object holding the buffer) keeps the buffer alive; when it dies the reference is
released like a host one and the pool mapping loses a view (closed with its last view).
"""

from __future__ import annotations

import collections
import itertools
import mmap
import os
import queue
import socket
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import cuda as C
from . import protocol as P
from . import tensor as T
from .errors import (
    ConnectionError,
    InvalidArgument,
    GpuUnavailable,
    ObjectNotFound,
    ProtocolError,
    VovpError,
)

DEFAULT_SOCKET = "/tmp/vovp.sock"

# Objects up to this size go in one PUT frame; larger ones through CREATE + copy + SEAL. Above
# ~256 KiB the extra round trips cost less than pushing the bytes through the socket twice
# (vovp-bench: 1 MiB inline ~305 us, through the mapping 150-195 us).
INLINE_LIMIT = 256 << 10
# Garbage-collected references are released within this many seconds (see _release_soon).
RELEASE_DELAY = 0.002
# ... or at once when this many are queued.
MAX_PENDING_RELEASES = 1024
# Inline puts up to this size are sent as one concatenated bytes object.
SMALL_CONCAT = 16 << 10
# Copies larger than this are split across the copy pool.
PARALLEL_COPY_MIN = 1 << 20

__all__ = ["Client", "init_client", "DEFAULT_SOCKET"]


# --- leases ----------------------------------------------------------------------------------



# How long a request polls for its reply before sleeping in recv. The daemon answers a small
# request within microseconds, but waking a sleeping reader on another CPU costs tens of
# microseconds on virtual machines (45-65 us measured here; vovp-bench "machine limits").
# sched_yield between polls lets the daemon run when both share a CPU. Same policy as the Rust
# client (transport/src/client.rs, REPLY_SPIN).
_REPLY_SPIN_S = 50e-6


def _recv_soon(sock, buf) -> int:
    deadline = time.perf_counter() + _REPLY_SPIN_S
    while True:
        try:
            return sock.recv_into(buf, 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            if time.perf_counter() > deadline:
                return sock.recv_into(buf)
            os.sched_yield()

class _Lease(weakref.ref):
    """Weak reference to an owner array that releases one store reference when it dies."""

    __slots__ = ("key", "client", "oid", "name", "segment", "offset", "size", "token", "cuda",
                 "generation")

    def __new__(cls, owner, client, oid, name, segment, offset, size, cuda=False):
        self = weakref.ref.__new__(cls, owner, _lease_died)
        self.key = id(owner)
        self.client = client
        self.oid = oid
        self.name = name
        # Host: segment id and offset in it. CUDA: segment None, offset = device address.
        self.segment = segment
        self.offset = offset
        self.size = size
        self.cuda = cuda
        # The connection the reference belongs to: after a reconnect, references of the old
        # daemon died with it and must not be released on the new one (ids may name others).
        self.generation = client._generation
        # Whoever pops this token releases the reference (or gives it up): list.pop is atomic,
        # so an explicit release() racing the GC callback on another thread releases once.
        self.token = [True]
        return self

    def __init__(self, owner, *args, **kwargs):
        super().__init__(owner, _lease_died)


# id(owner) -> _Lease. Module-level so that it is a GC root (see the module docstring).
_LEASES: dict = {}


# (id(client), segment id) -> (start, end) address range of every live mapping.
_MAPPED: dict = {}



def _forget_mappings(client_id, seg_addr):
    for seg_id in list(seg_addr):
        _MAPPED.pop((client_id, seg_id), None)


# Objects found by address that were released explicitly (id -> weakref), so that releasing
# the same torch tensor twice does not release a second reference of the same store object.
_RELEASED_BY_ADDRESS: dict = {}


def _lease_died(lease):
    # Runs inside garbage collection, on whatever thread dropped the last view: never raise.
    try:
        if _LEASES.get(lease.key) is lease:
            del _LEASES[lease.key]
        if _claim(lease) and lease.generation == lease.client._generation:
            lease.client._release_soon(lease.oid)
    except BaseException:  # noqa: BLE001 (interpreter shutdown, broken connection...)
        pass


def _claim(lease) -> bool:
    """Take the right to release ``lease``'s reference; False if someone already did.

    A claimed lease stays registered until its owner dies, so that ``release()`` of an array
    whose reference is gone recognises it instead of matching another lease by address.
    """
    try:
        lease.token.pop()
        return True
    except IndexError:
        return False


def _data_address(obj):
    """Address of the first byte of an ndarray / torch tensor / buffer, or None."""
    try:
        if isinstance(obj, np.ndarray):
            return obj.__array_interface__["data"][0]
        if T.is_torch_tensor(obj):
            return obj.data_ptr()
        return np.frombuffer(obj, np.uint8).__array_interface__["data"][0]
    except Exception:  # noqa: BLE001
        return None


def find_lease(obj):
    """The lease whose object ``obj`` (an array, tensor or memoryview) points into, or None."""
    return _find_lease(obj)[0]


def _cuda_address(obj):
    """Device address of a CUDA torch tensor or ``__cuda_array_interface__`` object, or None."""
    if isinstance(obj, (np.ndarray, memoryview, bytes, bytearray)):
        return None
    try:
        if T.is_torch_tensor(obj):
            return obj.data_ptr() if obj.is_cuda else None
        iface = C.cuda_interface(obj)
        if iface is not None:
            return int(iface["data"][0])
    except Exception:  # noqa: BLE001
        pass
    return None


def _release_owner(owner) -> bool:
    """Release the reference behind a CUDA owner now (``CudaTensor.release``)."""
    lease = _LEASES.get(id(owner))
    if lease is None or lease() is not owner or not _claim(lease):
        return False
    if lease.generation == lease.client._generation:
        lease.client._release_now(lease.oid)
    return True


def _find_lease(obj):
    """(lease, found by address) for ``obj``; (None, False) when it is not store memory."""
    if isinstance(obj, C.CudaTensor):
        owner = obj._owner
        lease = _LEASES.get(id(owner))
        return (lease, False) if lease is not None and lease() is owner else (None, False)
    addr = _cuda_address(obj)
    if addr is not None:
        # Device memory: only CUDA leases can match (their offset is the device address).
        for lease in list(_LEASES.values()):
            if not lease.cuda or not lease.token or lease() is None:
                continue
            start = lease.offset
            if start <= addr < start + lease.size or (addr == start and lease.size == 0):
                return lease, True
        return None, False
    # Fast path: arrays derived from an owner have it as their base (or are the owner).
    candidates = []
    if isinstance(obj, np.ndarray):
        candidates = [obj, obj.base]
    elif isinstance(obj, memoryview):
        candidates = [obj.obj, getattr(obj.obj, "base", None)]
    for c in candidates:
        if c is not None:
            lease = _LEASES.get(id(c))
            if lease is not None and lease() is c:
                return lease, False
    # Slow path (torch tensors, arrays rebuilt from buffers): match the address range.
    addr = _data_address(obj)
    if addr is None:
        return None, False
    # Most arrays are not store memory at all: rule that out before scanning every lease.
    if not any(start <= addr < end for start, end in list(_MAPPED.values())):
        return None, False
    for lease in list(_LEASES.values()):
        base = lease.client._seg_addr.get(lease.segment)
        if base is None or not lease.token or lease() is None:
            continue
        start = base + lease.offset
        if start <= addr < start + lease.size or (addr == start and lease.size == 0):
            return lease, True
    return None, False


# --- parallel copy -----------------------------------------------------------------------------

_POOL = None
_POOL_LOCK = threading.Lock()


def _copy_pool():
    global _POOL
    if _POOL is None:
        with _POOL_LOCK:
            if _POOL is None:
                n = max(1, min(8, os.cpu_count() or 1))
                _POOL = ThreadPoolExecutor(n, thread_name_prefix="vovp-copy")
    return _POOL


def _reset_pool_after_fork():
    # The pool's threads do not exist in a forked child, and the lock may have been held by
    # one of the parent's other threads.
    global _POOL, _POOL_LOCK
    _POOL = None
    _POOL_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_reset_pool_after_fork)


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` (same shape, dtypes equal up to byte order), in parallel when large.

    numpy releases the GIL for plain copies, so a few threads each copying a slab get close to
    memory bandwidth instead of the ~one-core speed of a single memcpy.
    """
    nbytes = dst.nbytes
    workers = min(8, os.cpu_count() or 1)
    if nbytes < PARALLEL_COPY_MIN * 2 or workers < 2:
        np.copyto(dst, src, casting="equiv")
        return
    if src.flags.c_contiguous:
        d, s = dst.reshape(-1), src.reshape(-1)
    elif dst.ndim >= 1 and dst.shape[0] >= 2:
        d, s = dst, src  # split along the first axis; each slab is a strided copy
    else:
        np.copyto(dst, src, casting="equiv")
        return
    n = d.shape[0]
    parts = min(workers, max(1, nbytes // PARALLEL_COPY_MIN), n)
    bounds = [n * i // parts for i in range(parts + 1)]
    pool = _copy_pool()
    futs = [pool.submit(np.copyto, d[bounds[i]:bounds[i + 1]], s[bounds[i]:bounds[i + 1]],
                        casting="equiv") for i in range(1, parts)]
    # The calling thread copies the first slab itself instead of idling.
    np.copyto(d[bounds[0]:bounds[1]], s[bounds[0]:bounds[1]], casting="equiv")
    for f in futs:
        f.result()


# --- client ------------------------------------------------------------------------------------


class Client:
    """A connection to a vovp store. Thread-safe; use one per process (see ``init_client``).

    Arrays returned by ``get_tensor``/``put_tensor`` are read-only views of the store's memory
    (sealed objects are immutable) unless ``writable=True`` is passed; torch tensors are always
    writable because torch has no read-only tensors - do not write to sealed objects.
    Do not use arrays from a client after ``close()``: the daemon is then free to reuse the
    memory.
    """

    def __init__(self, path: str = None, connect_timeout: float = 0.0,
                 release_delay: float = RELEASE_DELAY, reconnect: bool = False):
        path = os.fspath(path) if path is not None else os.environ.get(
            "VOVP_SOCKET", DEFAULT_SOCKET)
        self._path = path
        self._pid = os.getpid()
        # reconnect=True: when the daemon has gone away (stopped, killed, restarted), the next
        # call connects again and is retried once; objects of the old daemon are not found.
        self._reconnect = reconnect
        self._user_closed = False
        self._generation = 0
        self._lock = threading.Lock()
        self._pending = collections.deque()  # object ids whose RELEASE has not been sent yet
        self._release_delay = release_delay
        self._flush_scheduled = False
        self._flush_q = None
        self._closed = True  # until HELLO succeeded
        self._next_id = itertools.count(1).__next__
        self._rbuf = bytearray(1 << 16)
        self._rmv = memoryview(self._rbuf)
        self._rpos = self._rend = 0
        # Segments are mapped read-only, except this client's own arenas (where the daemon puts
        # the objects it creates, and which only it can write). ``writable=True`` views of other
        # segments come from a private copy-on-write mapping: writes stay in this process.
        self._segments = {}  # mapping key -> mmap
        self._seg_rw = {}  # segment id -> writable memoryview (shared: own arena; else private)
        self._seg_ro = {}  # segment id -> read-only memoryview of the shared mapping
        self._seg_addr = {}  # mapping key -> address of the mapping (release() by address)
        self._own_segments = set()  # arenas this client writes
        self._unsealed = {}  # name -> object id of objects this client created, not sealed yet
        # (opcode, request id, name) of requests sent whose replies are read later, in front of
        # the next request's (see _seal_later).
        self._unread = collections.deque()
        self._sock = self._connect(path, connect_timeout)
        try:
            self._hello()
        except BaseException:
            self._sock.close()
            self._unmap()
            raise
        self._closed = False
        weakref.finalize(self, _forget_mappings, id(self), self._seg_addr)
        if release_delay > 0:
            # Started here, not on first use: starting a thread from a GC callback could block.
            self._flush_q = queue.SimpleQueue()
            threading.Thread(target=_flusher, args=(weakref.ref(self), self._flush_q),
                             name="vovp-release", daemon=True).start()
            weakref.finalize(self, self._flush_q.put, None)  # lets the thread exit

    # -- connection ---------------------------------------------------------------------------

    @staticmethod
    def _connect(path, connect_timeout):
        deadline = time.monotonic() + (connect_timeout or 0)
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(path)
                return sock
            except (FileNotFoundError, ConnectionRefusedError) as e:
                sock.close()
                if time.monotonic() >= deadline:
                    raise ConnectionError(
                        f"cannot connect to the vovp daemon at {path!r}: {e.strerror}") from e
                time.sleep(0.02)
            except OSError as e:
                sock.close()
                raise ConnectionError(f"cannot connect to {path!r}: {e}") from e

    def _hello(self):
        rid = self._next_id()
        try:
            self._sock.sendall(P.frame(P.HELLO, rid, P.hello_payload(os.getpid())))
        except OSError:
            # A daemon that refuses us (too many connections) may have answered and closed
            # already: its reply, read below, says why.
            pass
        # The fds ride on the reply's bytes; collect them from every chunk until the frame is
        # complete (in practice the first one).
        data = bytearray()
        fds = []
        try:
            while len(data) < 4 or len(data) < 4 + P.U32.unpack_from(data, 0)[0]:
                try:
                    chunk, cfds, flags, _ = socket.recv_fds(self._sock, 1 << 16, 1024)
                except OSError as e:
                    raise ConnectionError(f"the daemon closed the connection during HELLO: {e}")
                fds.extend(cfds)
                if flags & socket.MSG_CTRUNC:
                    raise ProtocolError("segment fds were truncated (too many segments?)")
                if not chunk:
                    raise ConnectionError(
                        "the daemon closed the connection during HELLO (is this uid allowed "
                        "to use the store?)")
                data += chunk
            (length,) = P.U32.unpack_from(data, 0)
            total = 4 + length
            if len(data) > total:  # nothing else should be in flight, but keep it if it is
                extra = bytes(data[total:])
                self._rbuf[:len(extra)] = extra
                self._rend = len(extra)
                del data[total:]
            pos = P.check_reply(data, P.HELLO, rid)
            hello = P.decode_hello(data, pos)
            if hello.protocol_version != P.VERSION:
                raise ProtocolError(f"daemon speaks protocol {hello.protocol_version}")
            if len(fds) != len(hello.segments):
                raise ProtocolError(
                    f"HELLO announced {len(hello.segments)} segments but carried {len(fds)} fds")
            for (seg_id, size), fd in zip(hello.segments, fds):
                if size:
                    self._map_segment(seg_id, size, fd, writable=False)
        finally:
            for fd in fds:
                os.close(fd)  # the mmaps hold their own duplicate
        self.capacity = hello.capacity
        self.max_inline = hello.max_inline
        self._inline_limit = min(hello.max_inline, INLINE_LIMIT)

    def _map_segment(self, seg_id, size, fd, writable):
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        shared = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
        view = memoryview(shared)
        self._register(seg_id, shared, view, size)
        self._seg_ro[seg_id] = view.toreadonly() if writable else view
        if writable:
            self._own_segments.add(seg_id)
            self._seg_rw[seg_id] = view
        else:
            # A read-only fd may still be mapped privately: writes then copy the page into this
            # process and never reach the store.
            private = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
            pview = memoryview(private)
            self._register((seg_id, "private"), private, pview, size)
            self._seg_rw[seg_id] = pview

    def _register(self, key, mm, view, size):
        self._segments[key] = mm
        start = np.frombuffer(view, np.uint8).__array_interface__["data"][0]
        self._seg_addr[key] = start
        _MAPPED[(id(self), key)] = (start, start + size)

    def _fetch_segment(self, seg_id):
        """Maps segment ``seg_id`` (an arena: this client's own, read-write, or another
        client's, read-only), asking the daemon for its fd."""
        rid = self._next_id()
        request = P.frame(P.SEGMENT, rid, P.segment_payload(seg_id))
        with self._lock:
            if self._closed:
                self._check_usable()
            if seg_id in self._seg_ro:  # another thread mapped it meanwhile
                return
            if self._unread:
                self._read_unread()  # replies of seals sent without waiting come first
            if self._rpos != self._rend:
                raise ProtocolError("unexpected bytes before a SEGMENT reply")
            fds = []
            try:
                if self._pending:
                    request = self._drain_pending() + request
                self._sock.sendall(request)
                data = bytearray()
                while len(data) < 4 or len(data) < 4 + P.U32.unpack_from(data, 0)[0]:
                    chunk, cfds, _, _ = socket.recv_fds(self._sock, 1 << 16, 4)
                    fds.extend(cfds)
                    if not chunk:
                        raise ConnectionError("the vovp daemon closed the connection")
                    data += chunk
                pos = P.check_reply(data, P.SEGMENT, rid)
                size, writable = P.decode_segment(data, pos)
                if len(fds) != 1:
                    raise ProtocolError(f"SEGMENT reply carried {len(fds)} fds, not 1")
                self._map_segment(seg_id, size, fds[0], writable)
            except OSError as e:
                self._mark_broken()
                raise ConnectionError(f"connection to the vovp daemon failed: {e}") from e
            finally:
                for fd in fds:
                    os.close(fd)  # the mmaps hold their own duplicate

    def _unmap(self):
        # Best effort: a mapping with live arrays cannot be closed; it then stays mapped until
        # the last array is garbage collected.
        for seg_id in self._segments:
            _MAPPED.pop((id(self), seg_id), None)
        for d in (self._seg_ro, self._seg_rw):
            for mv in d.values():
                try:
                    mv.release()
                except BufferError:
                    pass
            d.clear()
        for mm in self._segments.values():
            try:
                mm.close()
            except BufferError:
                pass
        self._segments.clear()

    @property
    def path(self) -> str:
        """Socket path of the daemon."""
        return self._path

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close the connection: the daemon releases every reference it held."""
        self._user_closed = True
        if self._closed:
            self._unmap()
            return
        self._closed = True
        if os.getpid() == self._pid:
            try:
                # Wakes a thread blocked in a waiting GET so that the lock below is free soon.
                # Never done in a forked child: the socket is shared with the parent.
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            with self._lock:
                self._sock.close()
        else:
            self._sock.close()
        self._pending.clear()
        if self._flush_q is not None:
            self._flush_q.put(None)
        for lease in list(_LEASES.values()):
            if lease.client is self:
                _claim(lease)  # the connection's end released them all
        self._unmap()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self._closed else f"capacity={self.capacity}"
        return f"<vovp.Client {self._path!r} {state}>"

    # -- framing ------------------------------------------------------------------------------

    def _read_frame(self) -> memoryview:
        """The next frame (length field included), as a view valid until the next read."""
        start, end = self._rpos, self._rend
        sock = self._sock
        if start == end:
            # Fast path: nothing buffered and the whole reply arrives in one recv.
            end = _recv_soon(sock, self._rmv)
            if end >= 4:
                total = 4 + P.U32.unpack_from(self._rbuf, 0)[0]
                if end == total and total >= P.HEADER_SIZE:
                    self._rpos = self._rend = 0
                    return self._rmv[:total]
            elif not end:
                raise ConnectionError("the vovp daemon closed the connection")
            start = 0
        while True:
            have = end - start
            if have >= 4:
                total = 4 + P.U32.unpack_from(self._rbuf, start)[0]
                if total < P.HEADER_SIZE or total > P.HEADER_SIZE + P.MAX_PAYLOAD:
                    raise ProtocolError(f"reply frame length {total - 4} is invalid")
                if have >= total:
                    self._rpos, self._rend = start + total, end
                    return self._rmv[start:start + total]
                need = total
            else:
                need = 4
            if start + need > len(self._rbuf):
                # Move the partial frame to the front, growing the buffer if it cannot fit.
                partial = bytes(self._rmv[start:end])
                if need > len(self._rbuf):
                    self._rbuf = bytearray(max(need, 2 * len(self._rbuf)))
                    self._rmv = memoryview(self._rbuf)
                self._rmv[:len(partial)] = partial
                start, end = 0, len(partial)
            n = sock.recv_into(self._rmv[end:])
            if not n:
                raise ConnectionError("the vovp daemon closed the connection")
            end += n

    def _release_frame(self, ids) -> bytes:
        if len(ids) == 1:
            return P.RELEASE1.pack(24, P.VERSION, P.RELEASE, P.FLAG_NO_REPLY, self._next_id(),
                                   1, ids[0])
        return P.frame(P.RELEASE, self._next_id(), P.release_payload(ids), P.FLAG_NO_REPLY)

    def _drain_pending(self) -> bytes:
        ids = []
        pending = self._pending
        while pending:
            try:
                ids.append(pending.popleft())
            except IndexError:
                break
        return self._release_frame(ids) if ids else b""

    def _check_usable(self):
        if self._closed:
            raise ConnectionError("the vovp client is closed")
        if os.getpid() != self._pid:
            raise ConnectionError(
                "this vovp client was created in another process (fork); create a new one")

    def _roundtrip(self, data, opcode, rid, parse=None):
        """Send one request (bytes, or a list of buffers) and parse its reply under the lock."""
        if os.getpid() != self._pid:
            # Checked before taking the lock: after fork it may be held by a thread that does
            # not exist in this process.
            self._check_usable()
        with self._lock:
            if self._closed:
                if self._may_reconnect():
                    self._reconnect_locked()
                else:
                    self._check_usable()
            request = list(data) if type(data) is list else data
            try:
                buf = self._send_and_read(data)
            except ConnectionError:
                if not self._may_reconnect():
                    raise
                self._reconnect_locked()
                buf = self._send_and_read(request)
            try:
                pos = P.check_reply(buf, opcode, rid)
            except VovpError as e:
                # status 0: a reply to some other request (desynchronised); 13: the daemon
                # closes the connection after an unsupported version.
                if e.status in (0, 13):
                    self._mark_broken()
                raise
            result = parse(buf, pos) if parse is not None else None
            if self._pending and self._release_delay <= 0:
                # Immediate mode: send what GC queued while we held the lock.
                try:
                    self._sock.sendall(self._drain_pending())
                except OSError:
                    self._mark_broken()
            return result

    def _send_and_read(self, data):
        """Sends a request (after any queued releases) and reads its reply frame; the lock is
        held. A broken connection is closed and raised as ConnectionError."""
        try:
            if type(data) is list:
                if self._pending:
                    data.insert(0, self._drain_pending())
                self._sendv(data)
            else:
                if self._pending:
                    data = self._drain_pending() + data
                self._sock.sendall(data)
            if self._unread:
                self._read_unread()
            return self._read_frame()
        except VovpError:
            self._mark_broken()  # EOF or an unreadable frame: the stream cannot resync
            raise
        except OSError as e:
            self._mark_broken()
            raise ConnectionError(f"connection to the vovp daemon failed: {e}") from e

    def _may_reconnect(self) -> bool:
        return self._reconnect and not self._user_closed and os.getpid() == self._pid

    def _reconnect_locked(self):
        """A new connection (and fresh mappings) to the daemon at the same path; the lock is
        held. Arrays of the old connection keep their own mappings; their references died with
        the old daemon and are never released on the new one."""
        try:
            self._sock.close()
        except OSError:
            pass
        self._generation += 1
        self._pending.clear()
        self._unread.clear()  # replies the old daemon will never send
        self._unsealed.clear()
        for key in list(self._seg_addr):
            _MAPPED.pop((id(self), key), None)
        self._seg_addr.clear()  # the same dict: the finalizer forgets what is in it
        self._segments, self._seg_rw, self._seg_ro = {}, {}, {}
        self._own_segments = set()
        self._rpos = self._rend = 0
        self._sock = self._connect(self._path, 0)
        try:
            self._hello()
        except BaseException:
            self._sock.close()
            raise
        self._closed = False

    def _sendv(self, bufs):
        # One sendmsg for header + data avoids concatenating (copying) the payload.
        sock = self._sock
        total = sum(memoryview(b).nbytes for b in bufs)
        sent = sock.sendmsg(bufs)
        if sent == total:
            return
        # Partial send (large frame, full socket buffer): finish with sendall per buffer.
        for b in bufs:
            mv = memoryview(b).cast("B")
            if sent >= mv.nbytes:
                sent -= mv.nbytes
                continue
            sock.sendall(mv[sent:])
            sent = 0

    def _seal_later(self, name) -> None:
        """Send SEAL without waiting for its reply (read in front of the next request's).

        For hand-offs (vovp.reduction): the receiver's GET waits for the seal anyway, so the
        sender need not pay a round trip before sending the name. A failure of such a seal can
        only be reported later, as a RuntimeWarning; the receiver's GET then times out.
        """
        nb = P.encode_name(name)
        rid = self._next_id()
        frame = P.NAME_PREFIX.pack(14 + len(nb), P.VERSION, P.SEAL, 0, rid, len(nb)) + nb
        if os.getpid() != self._pid:
            self._check_usable()
        with self._lock:
            self._check_usable()
            if self._pending:
                frame = self._drain_pending() + frame
            try:
                self._sock.sendall(frame)
            except OSError as e:
                self._mark_broken()
                raise ConnectionError(f"connection to the vovp daemon failed: {e}") from e
            self._unread.append((P.SEAL, rid, name))
        self._unsealed.pop(name, None)

    def _read_unread(self):
        """Consume the replies of requests sent earlier without waiting (under the lock)."""
        while self._unread:
            opcode, rid, name = self._unread.popleft()
            buf = self._read_frame()
            try:
                P.check_reply(buf, opcode, rid)
            except VovpError as e:
                if e.status in (0, 13):
                    raise
                import warnings  # noqa: PLC0415 (rare path)

                warnings.warn(f"vovp: deferred seal of {name!r} failed: {e}", RuntimeWarning,
                              stacklevel=3)

    def _mark_broken(self):
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass

    def _simple(self, opcode, payload=b"", parse=None):
        rid = self._next_id()
        return self._roundtrip(P.HEADER.pack(12 + len(payload), P.VERSION, opcode, 0, rid)
                               + payload, opcode, rid, parse)

    def _name_op(self, opcode, name, parse=None):
        nb = P.encode_name(name)
        rid = self._next_id()
        return self._roundtrip(
            P.NAME_PREFIX.pack(14 + len(nb), P.VERSION, opcode, 0, rid, len(nb)) + nb,
            opcode, rid, parse)

    # -- releases -------------------------------------------------------------------------------

    def _release_soon(self, oid):
        """Release from a weakref callback: never blocks, never raises.

        By default the RELEASE is deferred: it rides in front of the next request (same
        sendall), or the flusher thread sends it ``release_delay`` seconds later if the client
        stays idle. On a small machine this halves the cost of a get whose result is dropped
        at once, as waking the daemon for each release costs as much as the request itself.
        With ``release_delay=0`` it is sent at once when the lock is free.
        """
        try:
            if self._closed or os.getpid() != self._pid:
                return  # the connection (or the parent's, after fork) owns nothing for us
            self._pending.append(oid)
            if self._release_delay > 0 and len(self._pending) < MAX_PENDING_RELEASES:
                self._schedule_flush()
                return
            if self._lock.acquire(blocking=False):
                try:
                    if self._pending:
                        self._sock.sendall(self._drain_pending())
                finally:
                    self._lock.release()
            else:
                self._schedule_flush()  # the request in flight may already be past its flush
        except BaseException:  # noqa: BLE001
            pass

    def _schedule_flush(self):
        if not self._flush_scheduled and self._flush_q is not None:
            self._flush_scheduled = True
            self._flush_q.put(True)  # SimpleQueue.put is safe in weakref callbacks

    def _release_now(self, oid):
        with self._lock:
            if self._closed or os.getpid() != self._pid:
                return
            self._pending.append(oid)
            try:
                self._sock.sendall(self._drain_pending())
            except OSError as e:
                self._mark_broken()
                raise ConnectionError(f"connection to the vovp daemon failed: {e}") from e

    def release(self, obj) -> bool:
        """Release the store reference behind ``obj`` now instead of at garbage collection.

        ``obj`` is an array / tensor / memoryview returned by this client (or any view of one),
        or an object id. Returns False when there was nothing (left) to release, so a double
        release is harmless. The array must not be used afterwards: the memory may be reused.
        """
        by_address = None
        if isinstance(obj, int):
            lease = next((lease for lease in list(_LEASES.values())
                          if lease.client is self and lease.oid == obj and lease.token), None)
        else:
            done = _RELEASED_BY_ADDRESS.get(id(obj))
            if done is not None and done() is obj:
                return False
            lease, found_by_address = _find_lease(obj)
            if lease is not None and lease.client is not self:
                lease = None
            if found_by_address:
                by_address = obj  # e.g. a torch tensor: remember it, as it has no owner link
        if lease is None or not _claim(lease):
            return False
        if by_address is not None:
            key = id(by_address)
            try:
                _RELEASED_BY_ADDRESS[key] = weakref.ref(
                    by_address, lambda _, key=key: _RELEASED_BY_ADDRESS.pop(key, None))
            except TypeError:  # not weak-referenceable
                pass
        if lease.generation == self._generation:
            self._release_now(lease.oid)
        return True

    def flush(self) -> None:
        """Send the releases that garbage collection queued (normally sent within
        ``release_delay`` seconds, or with the next request)."""
        self._flush_scheduled = False
        if self._pending:
            if os.getpid() != self._pid:
                return
            with self._lock:
                self._check_usable()
                if self._pending:
                    self._sock.sendall(self._drain_pending())

    # -- owners ---------------------------------------------------------------------------------

    def _owner(self, ref, name, writable):
        """uint8 array over ``ref``'s bytes, registered to release the reference when it dies.

        Must be called for every reference the daemon granted, right after the reply; on
        failure the reference is released at once.
        """
        if ref.kind != P.LOC_HOST:
            self._release_now(ref.object_id)
            raise GpuUnavailable(
                f"{name!r} is a CUDA object: it has no host memory to map (get it with "
                "get_tensor, which returns a CUDA tensor)", 10)
        try:
            if ref.segment not in self._seg_ro:
                self._fetch_segment(ref.segment)
            seg = (self._seg_rw if writable else self._seg_ro)[ref.segment]
            owner = np.frombuffer(seg, np.uint8, ref.data_size, ref.offset)
        except Exception as e:
            self._release_quietly(ref.object_id)
            if isinstance(e, VovpError):
                raise
            if ref.segment not in self._seg_rw:
                raise ProtocolError(f"object {name!r} lies in unknown segment {ref.segment}")
            raise ProtocolError(
                f"object {name!r} ({ref.data_size} bytes at {ref.offset}) lies outside segment "
                f"{ref.segment}") from None
        key = ref.segment
        if writable and ref.segment not in self._own_segments:
            key = (ref.segment, "private")
        lease = _Lease(owner, self, ref.object_id, name, key, ref.offset, ref.data_size)
        _LEASES[lease.key] = lease
        return owner

    def _cuda_owner(self, ref, name):
        """``cuda.DeviceBuffer`` over a CUDA ``ref``, registered like ``_owner``'s arrays.

        Maps the object's pool through CUDA IPC (once per pool). On failure (no driver here:
        GpuUnavailable; a handle the driver refuses: GpuError) the reference is released at once.
        """
        try:
            owner = C.open_block(ref.segment, ref.pool, ref.ipc_handle, ref.offset,
                                 ref.data_size)
        except BaseException:
            self._release_quietly(ref.object_id)
            raise
        lease = _Lease(owner, self, ref.object_id, name, None, owner.ptr, ref.data_size,
                       cuda=True)
        _LEASES[lease.key] = lease
        return owner

    def _release_quietly(self, oid):
        # Error paths: the error being raised matters more than a failed release (the
        # connection's end releases it anyway).
        try:
            self._release_now(oid)
        except VovpError:
            pass

    def _drop_owner(self, owner):
        """Release ``owner``'s reference now (error paths)."""
        lease = _LEASES.get(id(owner))
        if lease is not None and lease() is owner and _claim(lease):
            if self._unsealed.get(lease.name) == lease.oid:
                del self._unsealed[lease.name]
            try:
                if lease.generation == self._generation:
                    self._release_now(lease.oid)
            except VovpError:
                pass

    # -- raw objects ----------------------------------------------------------------------------

    def _create(self, nb, size, flags, metadata, name):
        rid = self._next_id()
        payload = P.create_payload(nb, size, flags, metadata)
        frame = P.HEADER.pack(12 + len(payload), P.VERSION, P.CREATE, 0, rid) + payload
        ref = self._roundtrip(frame, P.CREATE, rid, _parse_objref)
        owner = self._owner(ref, name, writable=True)
        self._unsealed[name] = ref.object_id
        return owner

    def _create_cuda(self, nb, size, flags, metadata, name, device):
        """CREATE on cuda:``device``; the DeviceBuffer holding the creator's reference."""
        rid = self._next_id()
        payload = P.create_payload(nb, size, flags, metadata, P.DEVICE_CUDA, device)
        frame = P.HEADER.pack(12 + len(payload), P.VERSION, P.CREATE, 0, rid) + payload
        ref = self._roundtrip(frame, P.CREATE, rid, _parse_objref)
        if ref.kind != P.LOC_CUDA:
            self._release_quietly(ref.object_id)  # aborts it
            raise ProtocolError(f"a CUDA create of {name!r} returned a host object")
        owner = self._cuda_owner(ref, name)
        self._unsealed[name] = ref.object_id
        return owner

    def _put_inline(self, nb, flags, metadata, data, size, name, keep, writable=False):
        rid = self._next_id()
        # Everything after the name depends only on (flags, metadata, size): cached.
        tail_key = (flags, metadata, size)
        tail = _PUT_TAILS.get(tail_key)
        if tail is None:
            tail = P.PUT_MID.pack(flags, len(metadata)) + metadata + P.U64.pack(size)
            if len(_PUT_TAILS) >= 4096:
                _PUT_TAILS.clear()
            _PUT_TAILS[tail_key] = tail
        prefix = P.PUT_PREFIX.pack(14 + len(nb) + len(tail) + size, P.VERSION, P.PUT, 0, rid,
                                   len(nb))
        if size > SMALL_CONCAT:
            ref = self._roundtrip([prefix, nb, tail, data], P.PUT, rid, _parse_objref)
        else:  # copying a few KiB is cheaper than sendmsg's gather setup
            ref = self._roundtrip(b"".join((prefix, nb, tail, data)), P.PUT, rid,
                                  _parse_objref)
        if keep:
            return self._owner(ref, name, writable)
        return ref

    def create(self, name, size: int, metadata=b"", ephemeral: bool = False) -> np.ndarray:
        """Create an unsealed object and return a writable uint8 array over its bytes.

        The returned array holds the creator's reference: keep it alive until ``seal(name)``
        (dropping it before aborts the object); after the seal it keeps the object alive and
        writable *for this client only* (other clients see the same physical memory).
        """
        nb = P.encode_name(name)
        metadata = P.check_metadata(metadata)
        flags = P.OBJ_EPHEMERAL if ephemeral else 0
        size = int(size)
        if not 0 <= size < 2**64:
            raise InvalidArgument(f"size must be between 0 and 2**64 - 1 bytes, got {size}")
        return self._create(nb, size, flags, metadata, name)

    def create_tensor(self, name, shape, dtype, ephemeral: bool = False) -> np.ndarray:
        """Create an unsealed tensor object; fill the returned writable array, then ``seal``."""
        dtype = np.dtype(dtype)
        code = T.numpy_code(dtype)
        store_dt = T.little_endian_dtype(dtype)
        shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(d) for d in shape)
        meta = T.encode_header(code, shape)
        size = store_dt.itemsize * int(np.prod(shape, dtype=np.int64))
        owner = self.create(name, size, meta, ephemeral)
        return owner.view(store_dt).reshape(shape)

    def seal(self, name) -> None:
        """Seal an object created by this client: it becomes immutable and visible to GET."""
        self._name_op(P.SEAL, name)
        self._unsealed.pop(name, None)

    def abort(self, name) -> None:
        """Abort an unsealed object created by this client; its memory is freed."""
        self._name_op(P.ABORT, name)
        # The creator's reference went with the object; do not release it again later.
        oid = self._unsealed.pop(name, None)
        for lease in list(_LEASES.values()):
            if lease.client is self and lease.oid == oid:
                _claim(lease)

    def put(self, name, data, metadata=b"", ephemeral: bool = False) -> int:
        """Store ``data`` (any bytes-like object) as a sealed object; returns its object id.

        The client keeps no reference: the object lives until deleted (or evicted when nobody
        holds it). ``ephemeral=True`` objects vanish when their last reference is released,
        so with ``put`` (which holds none) only a GET racing the put would see them.
        """
        nb = P.encode_name(name)
        metadata = P.check_metadata(metadata)
        mv = memoryview(data)
        if not mv.c_contiguous:
            mv = memoryview(mv.tobytes())
        mv = mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv
        size = mv.nbytes
        flags = P.OBJ_EPHEMERAL if ephemeral else 0
        if size <= self._inline_limit:
            return self._put_inline(nb, flags, metadata, mv, size, name, keep=False).object_id
        owner = self._create(nb, size, flags, metadata, name)
        oid = _LEASES[id(owner)].oid
        try:
            copy_into(owner, np.frombuffer(mv, np.uint8))
            self.seal(name)
        except BaseException:
            self._drop_owner(owner)  # releasing the creator's reference aborts the object
            raise
        self._drop_owner(owner)
        return oid

    def get_buffer(self, name, timeout=None, writable: bool = False,
                   with_metadata: bool = False):
        """A memoryview of a sealed object's bytes (read-only unless ``writable``).

        ``timeout``: None = don't wait, seconds to wait for the object to appear/be sealed,
        negative = forever. Raises ObjectNotFound when it is still missing.
        With ``with_metadata=True`` returns ``(memoryview, metadata bytes)``.
        """
        ref = self._get1(name, timeout)
        owner = self._owner(ref, name, writable)
        mv = memoryview(owner)
        return (mv, ref.metadata) if with_metadata else mv

    def _get1(self, name, timeout):
        nb = P.encode_name(name)
        rid = self._next_id()
        frame = P.GET1_PREFIX.pack(26 + len(nb), P.VERSION, P.GET, 0, rid,
                                   0 if timeout is None else P.timeout_ms(timeout), 1,
                                   len(nb)) + nb
        ref = self._roundtrip(frame, P.GET, rid, _parse_get1)
        if ref is None:
            raise ObjectNotFound(f"no sealed object named {name!r}", 1)
        return ref

    def get_buffers(self, names, timeout=None, writable: bool = False) -> list:
        """Several objects in one GET: a list with ``(memoryview, metadata bytes)`` per name, or
        None for a name still missing or unsealed when ``timeout`` ran out.

        The daemon waits until *every* name is sealed or the timeout passes (``timeout`` as in
        ``get_buffer``), so a batch costs one round trip and one wait. Each memoryview holds its
        own reference, released like ``get_buffer``'s.
        """
        tms = 0 if timeout is None else P.timeout_ms(timeout)
        rid = self._next_id()
        if len(names) == 1:  # the common case: the one-name frame and parser of get_buffer
            nb = P.encode_name(names[0])
            frame = P.GET1_PREFIX.pack(26 + len(nb), P.VERSION, P.GET, 0, rid, tms, 1,
                                       len(nb)) + nb
            refs = [self._roundtrip(frame, P.GET, rid, _parse_get1)]
        else:
            payload = P.get_payload([P.encode_name(n) for n in names], tms)
            refs = self._roundtrip(P.frame(P.GET, rid, payload), P.GET, rid, P.decode_get)
        if len(refs) != len(names):
            for ref in refs:
                if ref is not None:
                    self._release_quietly(ref.object_id)
            raise ProtocolError(f"GET of {len(names)} names returned {len(refs)} entries")
        out = []
        for i, ref in enumerate(refs):
            if ref is None:
                out.append(None)
                continue
            try:
                owner = self._owner(ref, names[i], writable)
            except BaseException:
                # _owner released this reference; release the rest before raising.
                for later in refs[i + 1:]:
                    if later is not None:
                        self._release_quietly(later.object_id)
                raise
            out.append((memoryview(owner), ref.metadata))
        return out

    def contains(self, name) -> bool:
        """Whether a sealed object of that name exists."""
        return self._name_op(P.CONTAINS, name, _parse_u8)

    def __contains__(self, name) -> bool:
        return self.contains(name)

    def delete(self, name) -> None:
        """Remove the name now; the memory is freed when the last holder releases it."""
        self._name_op(P.DELETE, name)

    def list(self) -> list:
        """Every object: dicts with name, id, size, device, sealed, ephemeral, refcount,
        last_access (unix seconds), metadata, and dtype/shape for tensor objects."""
        entries = []
        start = 0
        while start != P.LIST_END:  # the daemon pages LIST so no reply outgrows a frame
            page, start = self._simple(P.LIST, P.list_payload(start), P.decode_list)
            entries.extend(page)
        for e in entries:
            meta = e["metadata"]
            if T.is_tensor_header(meta):
                try:
                    tm = T.decode_header(meta)
                    e["dtype"] = tm.dtype_name
                    e["shape"] = tm.shape
                except ProtocolError:
                    pass
        return entries

    def stats(self) -> dict:
        """Store counters (the STATS fields of PROTOCOL.md)."""
        return self._simple(P.STATS, b"", P.decode_stats)

    def evict(self, nbytes: int) -> int:
        """Evict unreferenced sealed objects until ``nbytes`` are free; returns bytes freed."""
        return self._simple(P.EVICT, P.U64.pack(int(nbytes)), _parse_u64)

    # -- tensors --------------------------------------------------------------------------------

    def put_tensor(self, name, t, ephemeral: bool = False, writable: bool = False,
                   _seal_later: bool = False):
        """Store a numpy array or torch tensor (CPU or CUDA); return the store's copy, zero-copy.

        The result (numpy array, or torch tensor for torch input) is a view of the store's
        memory and holds one reference to the object until it and every view of it are
        garbage collected (or ``release``d). It is read-only unless ``writable`` (torch
        tensors are always writable). Non-contiguous input is made C-contiguous and
        big-endian input is converted to little-endian during the copy.

        A CUDA torch tensor becomes a CUDA object on its device (device-to-device copy) and
        the result is a torch tensor on that device aliasing the store's device memory; any
        other object with ``__cuda_array_interface__`` goes through ``put_cuda``. Without a
        usable CUDA driver in this process they raise GpuUnavailable (with the reason).
        """
        if T.is_torch_tensor(t) and t.device.type == "cuda":
            return self._put_torch_cuda(name, t, ephemeral)
        if not T.is_torch_tensor(t) and type(t) is not np.ndarray and \
                C.cuda_interface(t) is not None:
            return self.put_cuda(name, t, ephemeral=ephemeral, writable=writable)
        src, code, store_dt, view_dt, meta, torch_in = _host_source(t)
        writable = writable or torch_in
        nb = P.encode_name(name)
        size = src.nbytes
        flags = P.OBJ_EPHEMERAL if ephemeral else 0
        if size <= self._inline_limit:
            if src.dtype is not store_dt or not src.flags.c_contiguous:
                src = np.ascontiguousarray(src, dtype=store_dt)
            owner = self._put_inline(nb, flags | P.OBJ_KEEP_REFERENCE, meta,
                                     src.reshape(-1).view(np.uint8), size, name, True,
                                     writable)
        else:
            owner = self._create(nb, size, flags, meta, name)
            try:
                copy_into(owner.view(store_dt).reshape(src.shape), src)
                if _seal_later:
                    self._seal_later(name)
                else:
                    self.seal(name)
            except BaseException:
                self._drop_owner(owner)
                raise
        return _host_result(owner, view_dt, src.shape, code, torch_in, writable)

    def put_tensors(self, tensors, ephemeral: bool = False, writable: bool = False) -> dict:
        """``put_tensor`` of every ``name -> tensor`` item of a mapping (or of (name, tensor)
        pairs); returns ``{name: store's copy}`` in the same order.

        Small host tensors (up to the inline limit) are pipelined: their PUTs go out together
        and their replies are read together, one round trip for many tensors. Larger ones and
        CUDA tensors are put one after the other. If any put fails, the first error is raised
        after all were attempted; the others stay stored (``delete`` them if needed).
        """
        items = list(tensors.items() if hasattr(tensors, "items") else tensors)
        flags = (P.OBJ_EPHEMERAL if ephemeral else 0) | P.OBJ_KEEP_REFERENCE
        results = {}  # filled in input order: placeholders first
        error = None
        sequential = []  # CUDA and large tensors: put_tensor one by one
        batch = []  # (name, frame, request id, view dtype, shape, code, torch input)
        batch_bytes = 0
        for name, t in items:
            cuda = (T.is_torch_tensor(t) and t.device.type == "cuda") or (
                not T.is_torch_tensor(t) and type(t) is not np.ndarray
                and C.cuda_interface(t) is not None)
            try:
                nb = P.encode_name(name)
                if not cuda:
                    src, code, store_dt, view_dt, meta, torch_in = _host_source(t)
            except Exception as e:  # noqa: BLE001 (raised once the others are stored)
                error = error or e
                continue
            if cuda or src.nbytes > self._inline_limit:
                sequential.append((name, t))
                results[name] = None
                continue
            if src.dtype is not store_dt or not src.flags.c_contiguous:
                src = np.ascontiguousarray(src, dtype=store_dt)
            data = src.reshape(-1).view(np.uint8).tobytes()
            head = P.put_payload_head(nb, flags, meta, len(data))
            rid = self._next_id()
            frame = P.HEADER.pack(12 + len(head) + len(data), P.VERSION, P.PUT, 0, rid) + \
                head + data
            batch.append((name, frame, rid, view_dt, src.shape, code, torch_in))
            results[name] = None
            batch_bytes += len(frame)
            # Bounded batches: the daemon's replies must never fill our receive buffer while
            # we are still sending.
            if len(batch) >= 64 or batch_bytes >= (4 << 20):
                error = self._put_batch(batch, results, writable) or error
                batch, batch_bytes = [], 0
        if batch:
            error = self._put_batch(batch, results, writable) or error
        for name, t in sequential:
            try:
                results[name] = self.put_tensor(name, t, ephemeral, writable)
            except Exception as e:  # noqa: BLE001
                error = error or e
                results.pop(name, None)
        if error is not None:
            raise error
        return results

    def _put_batch(self, batch, results, writable):
        """Pipelined inline PUTs (see put_tensors); returns the first error, or None."""
        replies = self._roundtrip_many([b[1] for b in batch], P.PUT, [b[2] for b in batch],
                                       _parse_objref)
        error = None
        for (name, _, _, view_dt, shape, code, torch_in), ref in zip(batch, replies):
            if isinstance(ref, Exception):
                error = error or ref
                results.pop(name, None)
                continue
            owner = self._owner(ref, name, writable or torch_in)
            results[name] = _host_result(owner, view_dt, shape, code, torch_in,
                                         writable or torch_in)
        return error

    def _roundtrip_many(self, frames, opcode, rids, parse):
        """Send several requests at once, then read their replies: a parsed result or the
        error of each (statuses that desynchronise the stream break the connection)."""
        if os.getpid() != self._pid:
            self._check_usable()
        with self._lock:
            if self._closed:
                self._check_usable()
            out = []
            try:
                data = b"".join(frames)
                if self._pending:
                    data = self._drain_pending() + data
                self._sock.sendall(data)
                if self._unread:
                    self._read_unread()
                for rid in rids:
                    buf = self._read_frame()
                    try:
                        pos = P.check_reply(buf, opcode, rid)
                        out.append(parse(buf, pos))
                    except VovpError as e:
                        if e.status in (0, 13):
                            raise
                        out.append(e)
            except VovpError:
                self._mark_broken()
                raise
            except OSError as e:
                self._mark_broken()
                raise ConnectionError(f"connection to the vovp daemon failed: {e}") from e
            return out

    def get_tensor(self, name, timeout=None, framework=None, writable: bool = False):
        """The tensor stored under ``name``, zero-copy.

        ``timeout``: None = don't wait, seconds to wait, negative = forever; raises
        ObjectNotFound when missing. ``framework``: None returns what was put: a torch tensor
        for an object put from torch (recorded in its tensor header) when this process can
        import torch, otherwise a numpy array (read-only unless ``writable``); "numpy" or
        "torch" (via torch.from_numpy, no copy) force one.
        An object without a tensor header comes back as a 1-D uint8 array.
        A waiting GET occupies this client's connection: other threads' requests on the same
        client queue behind it (use a separate client for long waits).

        CUDA objects come back aliasing the store's device memory (mapped through CUDA IPC):
        with framework None as a torch CUDA tensor when torch is installed and sees CUDA,
        otherwise as a ``vovp.cuda.CudaTensor`` (``__cuda_array_interface__``, DLPack,
        ``.to_numpy()``); "torch" or "cuda" (CudaTensor) force one. "numpy" is refused for
        them (TypeError): there is no host memory to view; ``.to_numpy()`` copies. Without a
        CUDA driver in this process a CUDA object raises GpuUnavailable.
        """
        _check_framework(framework)
        return self._tensor_from_ref(self._get1(name, timeout), name, framework, writable)

    def get_tensors(self, names, timeout=None, framework=None, writable: bool = False) -> list:
        """``[get_tensor(n) for n in names]`` in one round trip (one GET of many names).

        ``timeout`` bounds the wait for all of them together (None: don't wait). When any is
        still missing, raises ObjectNotFound naming the missing ones and holds nothing.
        ``framework`` and ``writable`` apply to every result, as in ``get_tensor``.
        """
        _check_framework(framework)
        names = list(names)
        if not names:
            return []
        encoded = [P.encode_name(n) for n in names]
        rid = self._next_id()
        payload = P.get_payload(encoded, P.timeout_ms(timeout))
        refs = self._roundtrip(P.frame(P.GET, rid, payload), P.GET, rid, P.decode_get)
        missing = [n for n, ref in zip(names, refs) if ref is None]
        if missing or len(refs) != len(names):
            for ref in refs:
                if ref is not None:
                    self._release_quietly(ref.object_id)
            if len(refs) != len(names):
                raise ProtocolError(f"GET of {len(names)} names returned {len(refs)} entries")
            shown = ", ".join(repr(n) for n in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ObjectNotFound(f"no sealed object named {shown}{more}", 1)
        out = []
        try:
            for i, (name, ref) in enumerate(zip(names, refs)):
                out.append(self._tensor_from_ref(ref, name, framework, writable))
        except BaseException:
            # _tensor_from_ref released the failing one; release those not wrapped yet and
            # let the ones already wrapped go with ``out``.
            for ref in refs[i + 1:]:
                self._release_quietly(ref.object_id)
            raise
        return out

    def _tensor_from_ref(self, ref, name, framework, writable):
        """The result of ``get_tensor`` for a granted reference (released on failure)."""
        if ref.kind != P.LOC_HOST:
            return self._get_cuda(ref, name, framework, writable)
        if framework == "cuda":
            self._release_quietly(ref.object_id)
            raise TypeError(f"{name!r} is a host object; framework='cuda' is for CUDA objects "
                            "(copy it to a device with to_device)")
        meta = ref.metadata
        plan = None
        if meta[:4] == T.MAGIC:
            try:
                plan = T.get_plan(meta)
                if plan[4] != T.DEVICE_CPU:
                    raise ProtocolError(f"{name!r} is a host object with a CUDA tensor header")
                if plan[3] != ref.data_size:
                    raise ProtocolError(
                        f"{name!r}: tensor header describes {plan[3]} bytes, object has "
                        f"{ref.data_size}")
            except BaseException:
                self._release_quietly(ref.object_id)
                raise
        if framework is None:
            torch_out = plan is not None and plan[5] == T.FRAMEWORK_TORCH and \
                T.torch_importable()
        else:
            torch_out = framework == "torch"
        # torch has no read-only tensors: a torch result needs the writable mapping.
        owner = self._owner(ref, name, writable or torch_out)
        if plan is None:
            arr, code = owner, T.UINT8
        else:
            code, view_dt, shape = plan[0], plan[1], plan[2]
            arr = owner.view(view_dt).reshape(shape)
        if torch_out:
            return T.numpy_to_torch(arr, code)
        return arr

    # -- CUDA tensors ---------------------------------------------------------------------------

    def put_cuda(self, name, ptr, nbytes=None, dtype=None, shape=None, device=None,
                 ephemeral: bool = False, writable: bool = False, framework: str = "cuda",
                 stream=None):
        """Store device memory as a CUDA tensor object; return the store's copy, zero-copy.

        ``ptr``: a device address (int) with ``nbytes``/``dtype`` (default uint8)/``shape``
        (default 1-D), or any object with ``__cuda_array_interface__`` (C-contiguous; its
        shape, dtype and stream are used). ``device``: the ordinal to store on; by default the
        device ``ptr`` lives on (asked from the driver). ``stream``: a CUDA stream handle to
        wait for before copying (the interface's own ``stream`` is honoured too).

        Creates the object on the device, copies device-to-device into the store's memory,
        waits for the copy, seals. Returns a ``CudaTensor`` (read-only unless ``writable``),
        or a torch tensor with ``framework="torch"``; it holds one reference like every
        result. Raises GpuUnavailable when this process has no usable CUDA driver (or the
        daemon has none), before anything is created.
        """
        C.driver()  # the reason, before anything reaches the daemon
        fw = self._cuda_framework(framework, name)
        byte_order = T.LITTLE
        iface = None if isinstance(ptr, int) else C.cuda_interface(ptr)
        if iface is not None:
            if iface.get("mask") is not None:
                raise ValueError("masked CUDA arrays are not supported")
            src = int(iface["data"][0])
            np_dt = np.dtype(iface["typestr"])
            ishape = tuple(int(d) for d in iface["shape"])
            strides = iface.get("strides")
            if strides is not None and tuple(strides) != _c_strides(ishape, np_dt.itemsize):
                raise ValueError("put_cuda needs a C-contiguous CUDA array; make it contiguous "
                                 "first")
            if dtype is not None and np.dtype(dtype) != np_dt:
                raise ValueError(f"dtype {dtype!r} does not match the array's {np_dt}")
            if shape is not None and tuple(shape) != ishape:
                raise ValueError(f"shape {shape!r} does not match the array's {ishape}")
            code = T.numpy_code(np_dt)
            byte_order = T.BIG if np_dt.byteorder == ">" else T.LITTLE
            shape = ishape
            size = np_dt.itemsize * int(np.prod(shape, dtype=np.int64))
            if nbytes is not None and int(nbytes) != size:
                raise ValueError(f"nbytes={nbytes} but the array has {size} bytes")
            nbytes = size
            if stream is None:
                stream = iface.get("stream")
        else:
            try:
                src = int(ptr)
            except TypeError:
                raise TypeError("put_cuda takes a device address (int) or an object with "
                                f"__cuda_array_interface__, not {type(ptr).__name__}") from None
            code = _dtype_code(dtype if dtype is not None else np.uint8)
            itemsize = T.ITEMSIZE[code]
            if shape is None:
                if nbytes is None:
                    raise ValueError("put_cuda of a raw pointer needs nbytes or shape")
                if int(nbytes) % itemsize:
                    raise ValueError(f"nbytes={nbytes} is not a multiple of the {itemsize}-byte "
                                     "item size")
                shape = (int(nbytes) // itemsize,)
            shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(d) for d in shape)
            size = itemsize * int(np.prod(shape, dtype=np.int64))
            if nbytes is not None and int(nbytes) != size:
                raise ValueError(f"nbytes={nbytes} does not match shape {shape} of "
                                 f"{T.DTYPE_NAMES[code]} ({size} bytes)")
            nbytes = size
        if device is None:
            device = C.device_of(src) if nbytes else 0
        device = int(device)
        pre_copy = None if stream is None else (lambda: C.sync_stream(stream))
        owner = self._put_device(name, src, nbytes, code, shape, byte_order, device, ephemeral,
                                 pre_copy)
        return self._cuda_result(owner, code, shape, byte_order, fw, writable, name)

    def _put_torch_cuda(self, name, t, ephemeral):
        """put_tensor of a CUDA torch tensor (see put_tensor)."""
        C.driver()
        import torch  # noqa: PLC0415 (t is a torch tensor: torch is imported)

        to_code, _ = T.torch_tables()
        code = to_code.get(t.dtype)
        if code is None:
            raise TypeError(f"vovp cannot store torch dtype {t.dtype}")
        # detach: no autograd history in the store; resolve_*: materialise lazy conj/neg bits;
        # contiguous: the store keeps C-contiguous data. All may queue kernels on torch's
        # current stream, which is synchronised before the copy.
        t = t.detach().resolve_conj().resolve_neg().contiguous()
        device = t.device.index if t.device.index is not None else torch.cuda.current_device()
        shape = tuple(t.shape)
        nbytes = t.numel() * t.element_size()

        def pre_copy():
            # The data may still be being computed on torch's stream; ours does not wait for it.
            torch.cuda.current_stream(t.device).synchronize()

        owner = self._put_device(name, t.data_ptr(), nbytes, code, shape, T.LITTLE, device,
                                 ephemeral, pre_copy, T.FRAMEWORK_TORCH)
        return self._cuda_result(owner, code, shape, T.LITTLE, "torch", True, name)

    def _put_device(self, name, src, nbytes, code, shape, byte_order, device, ephemeral,
                    pre_copy=None, framework=T.FRAMEWORK_UNSPECIFIED):
        """CREATE on cuda:device, D2D copy from ``src`` (device address), wait, SEAL; the
        DeviceBuffer holding the (now sealed) creator's reference."""
        nb = P.encode_name(name)
        meta = T.encode_header(code, shape, byte_order, T.DEVICE_CUDA, device, framework)
        flags = P.OBJ_EPHEMERAL if ephemeral else 0
        owner = self._create_cuda(nb, nbytes, flags, meta, name, device)
        try:
            if pre_copy is not None:
                pre_copy()
            C.copy_d2d(owner.ptr, src, nbytes, device)
            self.seal(name)
        except BaseException:
            self._drop_owner(owner)  # releasing the creator's reference aborts the object
            raise
        return owner

    def to_device(self, name, new_name, device: int = 0, ephemeral: bool = False,
                  framework=None, writable: bool = False, timeout=None):
        """Store a copy of object ``name`` on cuda:``device`` under ``new_name``.

        A host object is copied host-to-device straight from the store's mapping; a CUDA
        object device-to-device (e.g. to another GPU). The tensor header, if any, is kept
        with its device fields updated. Returns the new object like ``get_tensor`` would
        (``framework``: None, "torch" or "cuda"); the source's reference is released before
        returning. GpuUnavailable without a usable CUDA driver.
        """
        C.driver()
        fw = self._cuda_framework(framework, new_name)
        device = int(device)
        nb = P.encode_name(new_name)
        ref = self._get1(name, timeout)
        # Both release the reference themselves if they fail.
        if ref.kind == P.LOC_HOST:
            src_owner = self._owner(ref, name, False)
        else:
            src_owner = self._cuda_owner(ref, name)
        try:
            meta = ref.metadata
            code, shape, order = T.UINT8, (ref.data_size,), T.LITTLE
            if T.is_tensor_header(meta):
                m = T.decode_header(meta)
                if m.nbytes != ref.data_size:
                    raise ProtocolError(f"{name!r}: tensor header describes {m.nbytes} bytes, "
                                        f"object has {ref.data_size}")
                code, shape, order = m.dtype_code, m.shape, m.byte_order
                meta = T.encode_header(code, shape, order, T.DEVICE_CUDA, device, m.framework)
            flags = P.OBJ_EPHEMERAL if ephemeral else 0
            dst = self._create_cuda(nb, ref.data_size, flags, meta, new_name, device)
            try:
                if ref.kind == P.LOC_HOST:
                    C.copy_h2d(dst.ptr, src_owner, device)
                else:
                    C.copy_d2d(dst.ptr, src_owner.ptr, ref.data_size, device)
                self.seal(new_name)
            except BaseException:
                self._drop_owner(dst)
                raise
        finally:
            self._drop_owner(src_owner)  # the source's reference is not needed any more
        return self._cuda_result(dst, code, shape, order, fw, writable, new_name)

    def _get_cuda(self, ref, name, framework, writable):
        """get_tensor of a CUDA object: validate, map, wrap (reference released on failure)."""
        try:
            fw = self._cuda_framework(framework, name)
            meta = ref.metadata
            code, shape, order = T.UINT8, (ref.data_size,), T.LITTLE
            if meta[:4] == T.MAGIC:
                m = T.decode_header(meta)
                if m.device_type != T.DEVICE_CUDA:
                    raise ProtocolError(f"{name!r} is a CUDA object with a host tensor header")
                if m.nbytes != ref.data_size:
                    raise ProtocolError(f"{name!r}: tensor header describes {m.nbytes} bytes, "
                                        f"object has {ref.data_size}")
                code, shape, order = m.dtype_code, m.shape, m.byte_order
        except BaseException:
            self._release_quietly(ref.object_id)
            raise
        owner = self._cuda_owner(ref, name)
        return self._cuda_result(owner, code, shape, order, fw, writable, name)

    @staticmethod
    def _cuda_framework(framework, name):
        """'torch' or 'cuda' for a CUDA result; None picks torch when it is usable."""
        if framework is None:
            return "torch" if C.torch_cuda_usable() else "cuda"
        if framework in ("torch", "cuda"):
            return framework
        if framework in ("numpy", "np"):
            raise TypeError(f"{name!r} is a CUDA object: numpy cannot view device memory; use "
                            "framework='cuda' and .to_numpy() for a host copy")
        raise ValueError(f"framework must be None, 'torch' or 'cuda', not {framework!r}")

    @staticmethod
    def _cuda_result(owner, code, shape, byte_order, framework, writable, name):
        if framework == "torch":
            return C.to_torch(owner, code, shape, byte_order)
        return C.CudaTensor(owner, code, shape, byte_order, readonly=not writable, name=name)

    def subscribe(self):
        """A new connection that yields notifications: (kind, name, size, metadata) tuples,
        kind being "sealed", "deleted" or "evicted". Close it with ``.close()``."""
        return Subscription(self._path)


def _host_source(t):
    """(numpy view of the data, dtype code, dtype to store, dtype of the result, header,
    torch input) for a numpy array, CPU torch tensor or array-like."""
    if type(t) is np.ndarray:
        return (t, *T.put_plan(t.dtype, t.shape), False)
    if T.is_torch_tensor(t):
        if t.device.type != "cpu":
            raise GpuUnavailable(
                f"cannot put a {t.device} tensor: vovp stores host and CUDA tensors only", 10)
        src, code = T.torch_to_numpy(t)
        return (src, *T.put_plan(src.dtype, src.shape, code, T.FRAMEWORK_TORCH), True)
    src = np.asarray(t)
    return (src, *T.put_plan(src.dtype, src.shape), False)


def _host_result(owner, view_dt, shape, code, torch_in, writable):
    arr = owner.view(view_dt).reshape(shape)
    if torch_in:
        return T.numpy_to_torch(arr, code)
    if not writable:
        arr.flags.writeable = False
    return arr


def _check_framework(framework):
    if framework not in (None, "numpy", "np", "torch", "cuda"):
        raise ValueError(
            f"framework must be None, 'numpy', 'torch' or 'cuda', not {framework!r}")


def _c_strides(shape, itemsize):
    """Byte strides of a C-contiguous array (for checking ``__cuda_array_interface__``)."""
    strides = []
    step = itemsize
    for d in reversed(shape):
        strides.append(step)
        step *= max(int(d), 1)
    return tuple(reversed(strides))


def _dtype_code(dtype) -> int:
    """Protocol dtype code of a numpy dtype, a dtype name ("bfloat16" too) or a torch dtype."""
    if type(dtype).__module__ == "torch":  # torch.float32 and friends
        to_code, _ = T.torch_tables()
        code = to_code.get(dtype)
        if code is None:
            raise TypeError(f"vovp cannot store torch dtype {dtype}")
        return code
    if isinstance(dtype, str):
        for code, n in T.DTYPE_NAMES.items():
            if n == dtype:
                return code
    return T.numpy_code(np.dtype(dtype))


def _flusher(client_ref, q):
    """Thread body: sends deferred releases of an idle client (see Client._release_soon)."""
    while True:
        if q.get() is None:
            return
        client = client_ref()
        if client is None or client._closed:
            return
        delay = client._release_delay
        del client  # do not keep the client alive while sleeping
        time.sleep(delay)
        client = client_ref()
        if client is None or client._closed:
            return
        try:
            client.flush()
        except Exception:  # noqa: BLE001 (closed or broken meanwhile)
            pass
        del client


_PUT_TAILS: dict = {}


# --- reply parsers (module-level so the hot path creates no closures) ---------------------------


def _parse_objref(buf, pos):
    return P.decode_objref(buf, pos)[0]


def _parse_get1(buf, pos):
    n = P.U32.unpack_from(buf, pos)[0]
    if n != 1:
        raise ProtocolError(f"GET of one name returned {n} entries")
    if not buf[pos + 4]:
        return None
    return P.decode_objref(buf, pos + 5)[0]


def _parse_u8(buf, pos):
    return bool(buf[pos])


def _parse_u64(buf, pos):
    return P.U64.unpack_from(buf, pos)[0]


class Subscription:
    """Notification stream (SUBSCRIBE): iterate to receive events as they happen."""

    KINDS = {P.NOTIFY_SEALED: "sealed", P.NOTIFY_DELETED: "deleted", P.NOTIFY_EVICTED: "evicted"}

    def __init__(self, path):
        self._client = Client(path)
        c = self._client
        rid = c._next_id()
        c._roundtrip(P.frame(P.SUBSCRIBE, rid), P.SUBSCRIBE, rid)

    def __iter__(self):
        return self

    def __next__(self):
        c = self._client
        try:
            with c._lock:
                buf = c._read_frame()
                op = buf[5]
                if op != P.NOTIFY:
                    raise ProtocolError(f"unexpected opcode {op:#x} on a subscription")
                kind, name, size, meta = P.decode_notify(buf, P.HEADER_SIZE)
        except (ConnectionError, OSError):
            raise StopIteration from None
        return self.KINDS.get(kind, kind), name, size, meta

    def close(self):
        self._client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# The most recent init_client() of this process: (weak reference to the client, its path, pid).
# init_reduction() without an argument sends through it (the seed's
# ``client = vovp.init_client(path); vovp.init_reduction()``). Weak: dropping the client must
# still close it; its path is remembered.
_last_init = {"ref": None, "path": None, "pid": None}


def init_client(path: str = None, connect_timeout: float = 0.0,
                reconnect: bool = False) -> Client:
    """Connect to the daemon at ``path`` (default: $VOVP_SOCKET or /tmp/vovp.sock).

    The client becomes this process's default for ``vovp.init_reduction()``.
    ``reconnect=True``: if the daemon goes away (restarted, killed), the next call connects
    again and is retried once; objects that died with the old daemon are not found, arrays
    got before keep their (old, intact) memory."""
    client = Client(path, connect_timeout, reconnect=reconnect)
    _last_init.update(ref=weakref.ref(client), path=client.path, pid=os.getpid())
    return client


def last_init_client():
    """(client or None, path or None) of this process's most recent ``init_client``.

    A forked child has made none: its parent's record does not count (the child then follows
    $VOVP_SOCKET, which the parent's ``init_reduction`` exported)."""
    if _last_init["path"] is None or _last_init["pid"] != os.getpid():
        return None, None
    client = _last_init["ref"]()
    if client is None or client.closed:
        client = None
    return client, _last_init["path"]
