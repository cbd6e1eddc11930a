"""Send numpy arrays and torch tensors between processes through the store.

``init_reduction()`` registers reducers with ``multiprocessing.reduction.ForkingPickler`` (the
pickler behind ``multiprocessing.Queue``, ``Pipe``, ``Pool`` and ``Process(args=...)`` with the
spawn/forkserver start methods). A large array is then put into the store **once** as an
EPHEMERAL object and only its name travels through the pipe; the receiver maps the same memory.

Lifetime (who holds a store reference when):

* The sender keeps one reference for as long as the *source* array lives (a weakref on it), so
  sending the same array again reuses the stored copy instead of putting it twice. The stored
  copy is a snapshot: changes made to the source after its first send are not sent.
* Each receiver holds one reference for as long as its array (or any view of it) lives.
* Between pickling and unpickling, nobody would otherwise hold the object: ``q.put(np.ones(n))``
  drops the temporary right after the queue's feeder thread pickled it, before any receiver
  had a chance to GET it, and the ephemeral object would vanish. So every send also takes an
  *in-flight hold* in the sender, released when the receiver acknowledges with a datagram on a
  per-process abstract Unix socket (no store objects, so store statistics stay exact). A
  message that is never unpickled keeps its hold until the sender exits; at exit a sender
  process that still has unacknowledged sends waits for them (up to ``$VOVP_HANDOFF_TIMEOUT``
  seconds, default 30) while its parent process is alive, so a worker can return a large
  result through a queue and exit at once.

The object disappears when all of these are gone. Arrays smaller than ``threshold`` bytes
(default 64 KiB), object arrays and unsupported dtypes are pickled by value as usual, as are
torch tensors that are not on the CPU or that require grad (torch's own reducer handles them).

Received numpy arrays are read-only (store objects are immutable); received torch tensors are
writable, as torch has no read-only tensors, but writes are visible to every receiver of the
same send and must be avoided.

The receiving process needs no setup: unpickling connects a per-process default client to the
socket path recorded in the message (reconnecting after fork, as a child must not share its
parent's connection). Re-sending a received array from a process that called
``init_reduction`` sends it by name again, without a copy.
"""

from __future__ import annotations

import itertools
import multiprocessing
import multiprocessing.reduction as mp_reduction
import multiprocessing.util as mp_util
import os
import socket
import struct
import threading
import time
import uuid
import warnings
import weakref

import numpy as np

from . import tensor as T
from .client import DEFAULT_SOCKET, Client, find_lease
from .errors import VovpError

__all__ = ["init_reduction", "default_client", "DEFAULT_THRESHOLD"]

DEFAULT_THRESHOLD = 64 << 10

_U64 = struct.Struct("<Q")

_config = {"path": None, "client": None, "threshold": DEFAULT_THRESHOLD, "installed": False}

# Per-process default clients, by socket path.
_clients: dict = {}
_clients_lock = threading.Lock()

# id(source) -> (weakref to source, stored copy, name, oid, path): the sender's reference.
_sent: dict = {}
# id(source) -> lock serialising its first put (see _stored_copy).
_put_locks: dict = {}
_put_locks_lock = threading.Lock()
# send sequence number -> stored array/tensor: the in-flight holds.
_holds: dict = {}
_holds_cv = threading.Condition()
_seq = itertools.count(1)
# Ack listener of this process: (socket, abstract address) once started.
_ack = {"sock": None, "addr": None, "pid": None, "exit_hook": None}
_ack_lock = threading.Lock()
# Socket used by receivers to send acks.
_ack_out = {"sock": None, "pid": None}


def _after_fork_in_child():
    # Nothing of the parent's sending state is ours: its holds are acknowledged to the parent's
    # listener, its references belong to the parent's connection. Locks are new: one of the
    # parent's other threads may have held them at the fork.
    global _clients_lock, _put_locks_lock, _holds_cv, _ack_lock
    _clients_lock = threading.Lock()
    _put_locks_lock = threading.Lock()
    _holds_cv = threading.Condition()
    _ack_lock = threading.Lock()
    _put_locks.clear()
    _clients.clear()
    _sent.clear()
    _holds.clear()
    _ack.update(sock=None, addr=None, pid=None)
    _ack_out.update(sock=None, pid=None)


os.register_at_fork(after_in_child=_after_fork_in_child)


def default_client(path: str = None) -> Client:
    """This process's shared client for ``path`` (default $VOVP_SOCKET), created on first use.

    A client inherited through fork is never reused: the child gets a connection of its own.
    """
    path = path or os.environ.get("VOVP_SOCKET") or DEFAULT_SOCKET
    c = _clients.get(path)
    if c is None or c.closed or c._pid != os.getpid():
        with _clients_lock:
            c = _clients.get(path)
            if c is None or c.closed or c._pid != os.getpid():
                c = Client(path)
                _clients[path] = c
    return c


def _sender_client() -> Client:
    c = _config["client"]
    if c is not None and not c.closed and c._pid == os.getpid():
        return c
    return default_client(_config["path"])


def init_reduction(client_or_path=None, threshold: int = DEFAULT_THRESHOLD) -> None:
    """Make multiprocessing send numpy arrays (and torch tensors) through the store.

    ``client_or_path``: a ``Client`` to put with, or a socket path (default $VOVP_SOCKET or
    /tmp/vovp.sock). The path is exported as $VOVP_SOCKET for child processes and also travels
    in every message. ``threshold``: arrays with fewer bytes are pickled by value.
    Call it after importing torch if you use torch (torch.multiprocessing registers its own
    tensor reducer on import; ours replaces it and falls back to it for CUDA/grad tensors).
    """
    if isinstance(client_or_path, Client):
        _config["client"] = client_or_path
        _config["path"] = client_or_path.path
    else:
        _config["client"] = None
        _config["path"] = os.fspath(client_or_path) if client_or_path is not None else \
            os.environ.get("VOVP_SOCKET", DEFAULT_SOCKET)
    os.environ["VOVP_SOCKET"] = _config["path"]
    _config["threshold"] = int(threshold)
    fp = mp_reduction.ForkingPickler
    fp.register(np.ndarray, _reduce_ndarray)
    try:
        import torch  # noqa: PLC0415 (optional)
    except ImportError:
        torch = None
    if torch is not None:
        prev = fp._extra_reducers.get(torch.Tensor)
        if prev is not _reduce_tensor:
            _config["torch_fallback"] = prev
        fp.register(torch.Tensor, _reduce_tensor)
    _register_exit_hook()
    # A forked multiprocessing child starts with an empty finalizer registry.
    mp_util.register_after_fork(_AFTER_FORK, lambda _: _register_exit_hook())
    _config["installed"] = True


# --- sending -----------------------------------------------------------------------------------


def _reduce_ndarray(arr):
    if (arr.nbytes < _config["threshold"] or arr.dtype.hasobject
            or not _supported(arr.dtype)):
        return arr.__reduce__()
    try:
        return _share(arr, arr, None)
    except VovpError as e:
        # Pickling runs in the queue's feeder thread, where an exception loses the item and
        # hangs the receiver: fall back to a copy through the pipe instead.
        warnings.warn(f"vovp: sending array by value: {e}", RuntimeWarning, stacklevel=2)
        return arr.__reduce__()


def _reduce_tensor(t):
    if (t.device.type != "cpu" or t.requires_grad or t.layout is not _torch().strided
            or t.is_quantized or t.dtype not in T.torch_tables()[0]
            or t.element_size() * t.numel() < _config["threshold"]):
        prev = _config.get("torch_fallback")
        return prev(t) if prev is not None else t.__reduce_ex__(4)
    try:
        return _share(t, T.torch_to_numpy(t)[0], t.dtype)
    except VovpError as e:
        warnings.warn(f"vovp: sending tensor by value: {e}", RuntimeWarning, stacklevel=2)
        prev = _config.get("torch_fallback")
        return prev(t) if prev is not None else t.__reduce_ex__(4)


def _torch():
    import torch  # noqa: PLC0415

    return torch


def _supported(dtype) -> bool:
    try:
        T.numpy_code(dtype)
        return True
    except TypeError:
        return False


def _share(src, arr, torch_dtype):
    """Reduce value for ``src`` (ndarray or tensor; ``arr`` its numpy view) sent by name."""
    lease = find_lease(src)
    if lease is not None and lease.token and lease.client._pid == os.getpid() \
            and not lease.client.closed and lease.client.contains(lease.name):
        # Already in the store (received or got earlier): send the view's coordinates.
        client = lease.client
        base = client._seg_addr[lease.segment] + lease.offset
        offset = arr.__array_interface__["data"][0] - base
        holder, name, oid, path = src, lease.name, lease.oid, client.path
        view = arr
    else:
        _, holder, name, oid, path = _stored_copy(src)
        view = T.torch_to_numpy(holder)[0] if torch_dtype is not None else holder
        offset = 0
    seq = next(_seq)
    addr = _ack_address()
    with _holds_cv:
        _holds[seq] = holder
    return _rebuild, (path, name, oid, offset, view.dtype, view.shape, view.strides,
                      torch_dtype, addr, seq)


def _stored_copy(src):
    """The ``_sent`` entry for ``src``, putting it into the store on its first send.

    Each multiprocessing.Queue pickles in its own feeder thread, so the same array sent to
    several queues is reduced concurrently: a per-source lock makes it one put.
    """
    key = id(src)
    entry = _sent.get(key)
    if entry is not None and entry[0]() is src:
        return entry
    with _put_locks_lock:
        lock = _put_locks.setdefault(key, threading.Lock())
    try:
        with lock:
            entry = _sent.get(key)
            if entry is not None and entry[0]() is src:
                return entry
            client = _sender_client()
            name = f"vovp-mp-{uuid.uuid4().hex}"
            stored = client.put_tensor(name, src, ephemeral=True)
            oid = find_lease(stored).oid
            ref = weakref.ref(src, lambda wr, key=key: _source_died(key, wr))
            entry = (ref, stored, name, oid, client.path)
            _sent[key] = entry
            return entry
    finally:
        with _put_locks_lock:
            if _put_locks.get(key) is lock:
                del _put_locks[key]


def _source_died(key, wr):
    try:
        entry = _sent.get(key)
        if entry is not None and entry[0] is wr:
            del _sent[key]  # drops the stored copy, hence the sender's reference
    except BaseException:  # noqa: BLE001 (called from GC)
        pass


# --- acknowledgements ----------------------------------------------------------------------------


def _ack_address():
    if _ack["pid"] == os.getpid():
        return _ack["addr"]
    with _ack_lock:
        if _ack["pid"] != os.getpid():
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            addr = f"\0vovp-ack-{os.getpid()}-{uuid.uuid4().hex[:12]}"
            sock.bind(addr)
            threading.Thread(target=_ack_loop, args=(sock,), name="vovp-ack",
                             daemon=True).start()
            _register_exit_hook()  # normally done by init_reduction already
            _ack.update(sock=sock, addr=addr, pid=os.getpid())
    return _ack["addr"]


def _register_exit_hook():
    """Run _drain_holds at exit: after the queue feeder threads are joined (exitpriority -5),
    in the main process via atexit and in multiprocessing children when their target returns.

    Registered from init_reduction rather than on first send: the first send usually happens
    in a queue feeder thread, possibly while the exit finalizers already run, too late to be
    picked up by them.
    """
    if _ack["exit_hook"] != os.getpid():
        mp_util.Finalize(None, _drain_holds, exitpriority=-10)
        _ack["exit_hook"] = os.getpid()


class _AfterFork:
    """Anchor for multiprocessing's after-fork hook (it holds its objects weakly)."""


_AFTER_FORK = _AfterFork()


def _ack_loop(sock):
    while True:
        try:
            data = sock.recv(4096)
        except OSError:
            return
        with _holds_cv:
            dropped = [_holds.pop(seq, None)
                       for (seq,) in _U64.iter_unpack(data[:len(data) // 8 * 8])]
            _holds_cv.notify_all()
        # Released here, outside the condition's lock (dropping them may run release
        # callbacks); and no local may keep the last one alive while this thread blocks.
        dropped.clear()


def _send_ack(addr, seq):
    try:
        if _ack_out["pid"] != os.getpid():
            _ack_out.update(sock=socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM),
                            pid=os.getpid())
        _ack_out["sock"].sendto(_U64.pack(seq), addr)
    except OSError:
        pass  # the sender is gone: its hold went with its connection


def _drain_holds():
    """At exit: give receivers time to pick up what this process sent (see module doc)."""
    timeout = float(os.environ.get("VOVP_HANDOFF_TIMEOUT", "30"))
    deadline = time.monotonic() + timeout
    parent = multiprocessing.parent_process()
    with _holds_cv:
        while _holds and time.monotonic() < deadline:
            others = (parent is not None and parent.is_alive()) or \
                multiprocessing.active_children()
            if not others:
                break
            _holds_cv.wait(0.1)


def pending_sends() -> int:
    """Sends of this process not yet acknowledged by their receiver."""
    return len(_holds)


# --- receiving -----------------------------------------------------------------------------------


def _rebuild(path, name, oid, offset, dtype, shape, strides, torch_dtype, ack_addr, seq):
    client = default_client(path)
    try:
        ref = client._get1(name, None)
        owner = client._owner(ref, name, writable=torch_dtype is not None)
    finally:
        # Ack even on failure: the sender's hold cannot help a receiver that already failed.
        _send_ack(ack_addr, seq)
    if ref.object_id != oid:
        client._drop_owner(owner)
        raise VovpError(f"store object {name!r} was replaced before it was received")
    arr = np.ndarray(shape, dtype, buffer=owner, offset=offset, strides=strides)
    if torch_dtype is None:
        return arr
    t = _torch().from_numpy(arr)
    return t.view(torch_dtype) if t.dtype != torch_dtype else t
