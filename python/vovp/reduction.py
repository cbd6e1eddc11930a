"""Send numpy arrays and torch tensors between processes through the store.

``init_reduction()`` registers reducers with ``multiprocessing.reduction.ForkingPickler`` (the
pickler behind ``multiprocessing.Queue``, ``Pipe``, ``Pool`` and ``Process(args=...)`` with the
spawn/forkserver start methods, and ``torch.multiprocessing``). A large array is then put into
the store as an EPHEMERAL object and only its name travels through the pipe; the receiver maps
the same memory.

Which store: ``init_reduction(client_or_path)``; without an argument the most recent
``vovp.init_client(...)`` of the process, then ``$VOVP_SOCKET``, then /tmp/vovp.sock. It
connects at once, so an unreachable store is an error of ``init_reduction`` itself.

Lifetime (who holds a store reference when):

* Every send puts a copy of what the array holds *at that moment* (like pickling by value, so
  a buffer refilled in place and sent again sends its new contents). An array that already is
  store memory (received, or returned by ``get_tensor``/``put_tensor``) is sent by name
  without a copy: store objects are immutable.
* A large send seals its object without waiting for the daemon's reply (read before the
  sender's next request); the receiver's GET waits up to ``RECEIVE_TIMEOUT`` (10 s) for the
  seal, which may reach the daemon after the GET does. (A sender that dies in between aborts
  the object: the receiver's unpickling then fails with ObjectNotFound after that wait.)
* Each receiver holds one reference for as long as its array (or any view of it) lives.
* Between pickling and unpickling, nobody would otherwise hold the object: ``q.put(np.ones(n))``
  drops the temporary right after the queue's feeder thread pickled it, before any receiver
  had a chance to GET it, and the ephemeral object would vanish. So every send takes an
  *in-flight hold* in the sender, released when the receiver acknowledges with a datagram on a
  per-process abstract Unix socket (no store objects, so store statistics stay exact). This is
  the only reference the sender keeps: once every receiver has dropped its array, the object is
  gone, however long the sender keeps its source. A message that is never unpickled keeps its
  hold until the sender exits; at exit a sender process that still has unacknowledged sends
  waits for them (up to ``$VOVP_HANDOFF_TIMEOUT`` seconds, default 30) while its parent process
  is alive, so a worker can return a large result through a queue and exit at once. A torch
  DataLoader worker waits only briefly: it exits when its loader is done with it, and what it
  sent and was not received by then never will be.

Arrays and CPU tensors smaller than ``threshold`` bytes (default 64 KiB, or
``$VOVP_REDUCTION_THRESHOLD``) travel by value in the message; object arrays and unsupported
dtypes are pickled as usual; torch tensors that are not on the CPU, that require grad, or that
are sparse or quantized go through torch's own reducer (CUDA IPC, shared memory keeping
``requires_grad``). A store that is full (OutOfMemory even after eviction) makes a send fall back
to pickling by value with a RuntimeWarning; any other store error is raised.

Received numpy arrays are read-only (store objects are immutable); received torch tensors are
writable, as torch has no read-only tensors, but writes are visible to every receiver of the
same send and must be avoided.

The receiving process needs no setup: unpickling connects a per-process default client to the
socket path recorded in the message (reconnecting after fork, as a child must not share its
parent's connection). A process that sends must have called ``init_reduction``: a forked child
inherits it; a spawned one calls it itself (``$VOVP_SOCKET`` and ``$VOVP_REDUCTION_THRESHOLD``
are exported for it), e.g. ``DataLoader(..., worker_init_fn=vovp.worker_init_fn)``.
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
from typing import Any, Optional, Union

import numpy as np

from . import tensor as T
from ._lookup import find_lease
from ._puts import put_host
from .client import DEFAULT_SOCKET, Client, last_init_client
from .errors import ConnectionError, OutOfMemory, VovpError

__all__ = ["init_reduction", "default_client", "worker_init_fn", "DEFAULT_THRESHOLD"]

DEFAULT_THRESHOLD = 64 << 10
# How long a receiver waits for the sender's seal of a large object (sent without waiting).
RECEIVE_TIMEOUT = 10.0

_U64 = struct.Struct("<Q")

_config: dict[str, Any] = {"path": None, "client": None, "threshold": DEFAULT_THRESHOLD, "installed": False}

# Per-process default clients, by socket path.
_clients: dict[str, Client] = {}
_clients_lock = threading.Lock()

# send sequence number -> stored array/tensor: the in-flight holds.
_holds: dict[int, Any] = {}
_holds_cv = threading.Condition()
_seq = itertools.count(1)
# Ack listener of this process: (socket, abstract address) once started.
_ack: dict[str, Any] = {"sock": None, "addr": None, "pid": None, "exit_hook": None,
        # Holds the ack thread is dropping right now, and the pid whose exit drain has run
        # (from then on the ack thread drops nothing: see _drain_holds).
        "dropping": 0, "closed": None}
_ack_lock = threading.Lock()
# Socket used by receivers to send acks.
_ack_out: dict[str, Any] = {"sock": None, "pid": None}


def _after_fork_in_child():
    # Nothing of the parent's sending state is ours: its holds are acknowledged to the parent's
    # listener, its references belong to the parent's connection. Locks are new: one of the
    # parent's other threads may have held them at the fork.
    global _clients_lock, _holds_cv, _ack_lock
    _clients_lock = threading.Lock()
    _holds_cv = threading.Condition()
    _ack_lock = threading.Lock()
    _clients.clear()
    _holds.clear()
    _ack.update(sock=None, addr=None, pid=None, dropping=0, closed=None)
    _ack_out.update(sock=None, pid=None)


os.register_at_fork(after_in_child=_after_fork_in_child)


def default_client(path: Optional[str] = None) -> Client:
    """This process's shared client for ``path`` (default $VOVP_SOCKET), created on first use.

    A client inherited through fork is never reused: the child gets a connection of its own.
    """
    path = path or os.environ.get("VOVP_SOCKET") or DEFAULT_SOCKET
    c = _clients.get(path)
    if c is None or not c.core.usable_here():
        with _clients_lock:
            c = _clients.get(path)
            if c is None or not c.core.usable_here():
                c = Client(path)
                _clients[path] = c
    return c


def _sender_client() -> Client:
    c = _config["client"]
    if c is not None and c.core.usable_here():
        return c
    return default_client(_config["path"])


def init_reduction(client_or_path: Union[Client, str, os.PathLike[str], None] = None,
                   threshold: Optional[int] = None) -> None:
    """Make multiprocessing send numpy arrays (and torch tensors) through the store.

    ``client_or_path``: a ``Client`` to put with, or a socket path. Default: the most recent
    ``vovp.init_client(...)`` of this process, then $VOVP_SOCKET, then /tmp/vovp.sock.
    Connects at once: raises ``vovp.ConnectionError`` when the store cannot be reached.
    The path is exported as $VOVP_SOCKET for child processes and also travels in every
    message. ``threshold``: arrays with fewer bytes are pickled by value (default
    $VOVP_REDUCTION_THRESHOLD or 64 KiB; exported too).
    Call it after importing torch if you use torch (torch.multiprocessing registers its own
    tensor reducer on import; ours replaces it and falls back to it for CUDA/grad tensors).
    """
    if isinstance(client_or_path, Client):
        client, path = client_or_path, client_or_path.path
        if client.closed:
            raise ConnectionError(f"init_reduction: the client of {path!r} is closed")
    else:
        client = None
        if client_or_path is not None:
            path = os.fspath(client_or_path)
        else:
            client, last_path = last_init_client()
            path = last_path or os.environ.get("VOVP_SOCKET") or DEFAULT_SOCKET
        if client is None:
            try:
                client = default_client(path)
            except ConnectionError as e:
                raise ConnectionError(
                    f"init_reduction: cannot reach the vovp store at {path!r}: {e}") from e
    if threshold is None:
        threshold = int(os.environ.get("VOVP_REDUCTION_THRESHOLD", DEFAULT_THRESHOLD))
    _config["client"] = client
    _config["path"] = path
    _config["threshold"] = int(threshold)
    os.environ["VOVP_SOCKET"] = path
    os.environ["VOVP_REDUCTION_THRESHOLD"] = str(int(threshold))
    fp = mp_reduction.ForkingPickler
    fp.register(np.ndarray, _reduce_ndarray)
    torch: Any = None
    try:
        import torch  # noqa: PLC0415 (optional)
    except ImportError:
        pass
    if torch is not None:
        prev = fp._extra_reducers.get(torch.Tensor)  # type: ignore[attr-defined]  # private, no stub
        if prev is not _reduce_tensor:
            _config["torch_fallback"] = prev
        fp.register(torch.Tensor, _reduce_tensor)
    _register_exit_hook()
    # A forked multiprocessing child starts with an empty finalizer registry.
    mp_util.register_after_fork(_AFTER_FORK, lambda _: _register_exit_hook())
    _config["installed"] = True


def worker_init_fn(worker_id: Optional[int] = None) -> None:
    """``torch.utils.data.DataLoader(..., worker_init_fn=vovp.worker_init_fn)``: the workers
    send their batches through the store (fork, spawn and forkserver workers alike).

    Calls ``init_reduction()`` in the worker: it finds the store through $VOVP_SOCKET, which
    ``init_reduction`` in the main process exported (call that first). A worker_init_fn of
    your own can call ``vovp.init_reduction()`` instead.
    """
    init_reduction()


# --- sending -----------------------------------------------------------------------------------


def _reduce_ndarray(arr):
    if (arr.nbytes < _config["threshold"] or arr.dtype.hasobject
            or not _supported(arr.dtype)):
        return arr.__reduce__()
    try:
        return _share(arr, arr, None)
    except OutOfMemory as e:
        # A full store is a capacity problem, not a bug: the data still arrives, by value.
        warnings.warn(f"vovp: the store is full, sending the array by value: {e}",
                      RuntimeWarning, stacklevel=2)
        return arr.__reduce__()


def _reduce_tensor(t):
    if (t.device.type != "cpu" or t.requires_grad or t.layout is not _torch().strided
            or t.is_quantized or t.dtype not in T.torch_tables()[0]):
        return _torch_own_reduction(t)
    if t.element_size() * t.numel() < _config["threshold"]:
        return _tensor_by_value(t)
    try:
        return _share(t, T.torch_to_numpy(t)[0], t.dtype)
    except OutOfMemory as e:
        warnings.warn(f"vovp: the store is full, sending the tensor by value: {e}",
                      RuntimeWarning, stacklevel=2)
        return _tensor_by_value(t)


def _torch_own_reduction(t):
    """torch's reducer (CUDA IPC, shared memory keeping requires_grad, sparse...)."""
    prev = _config.get("torch_fallback")
    return prev(t) if prev is not None else t.__reduce_ex__(4)


def _tensor_by_value(t):
    """A small CPU tensor as its bytes in the message (a copy, like large tensors are).

    torch's own reducer would move it to a fresh shared-memory file and pass the descriptor
    through a helper thread: several system calls and round trips for a few bytes."""
    arr, code = T.torch_to_numpy(t)
    return _rebuild_by_value, (np.ascontiguousarray(arr).tobytes(), arr.dtype.str, arr.shape,
                               t.dtype)


def _rebuild_by_value(data, dtype, shape, torch_dtype):
    torch = _torch()
    arr = np.frombuffer(bytearray(data), dtype=np.dtype(dtype)).reshape(shape)  # writable
    t = torch.from_numpy(arr)
    return t.view(torch_dtype) if t.dtype != torch_dtype else t


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
    # (A lease's client is the connection that holds it: vovp._core.ClientCore.)
    if lease is not None and lease.token and lease.client.usable_here() \
            and lease.client.native.contains(lease.name):
        # Already store memory (received or got earlier), hence immutable: send the view's
        # coordinates in that object, no copy.
        offset = arr.__array_interface__["data"][0] - lease.start
        holder, name, oid, path = src, lease.name, lease.oid, lease.client.path
        view = arr
    else:
        # A copy per send: the source may be refilled in place and sent again.
        core = _sender_client().core
        name = f"vovp-mp-{uuid.uuid4().hex}"
        # put_tensor's planning and host routes, except that a large one's SEAL is sent
        # without waiting for its reply: the receiver's GET waits for the seal.
        plan = T.plan_host_put(src)
        assert plan is not None, "only host arrays and CPU tensors are sent through the store"
        holder = put_host(core, name, plan, ephemeral=True, writable=False, replace=False,
                          seal_later=True)
        lease = find_lease(holder)
        assert lease is not None, "put_tensor's result is a store lease"
        oid = lease.oid
        path = core.path
        view = T.torch_to_numpy(holder)[0] if torch_dtype is not None else holder
        offset = 0
    seq = next(_seq)
    addr = _ack_address()
    with _holds_cv:
        _holds[seq] = holder
    return _rebuild, (path, name, oid, offset, view.dtype, view.shape, view.strides,
                      torch_dtype, addr, seq)


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
            if _ack["closed"] == os.getpid():
                return  # past the exit drain: the main thread dropped what was left
            dropped = [_holds.pop(seq, None)
                       for (seq,) in _U64.iter_unpack(data[:len(data) // 8 * 8])]
            _ack["dropping"] += 1
        # Released here, outside the condition's lock (dropping them may run release
        # callbacks); and no local may keep the last one alive while this thread blocks.
        # Counted until done: _drain_holds waits for it, because a torch tensor dropped by
        # this (daemon) thread while the interpreter finalizes aborts the process (torch's
        # deleter takes the GIL, the finalizing interpreter ends the thread inside C++).
        try:
            dropped.clear()
        finally:
            with _holds_cv:
                _ack["dropping"] -= 1
                _holds_cv.notify_all()


def _send_ack(addr, seq):
    try:
        if _ack_out["pid"] != os.getpid():
            _ack_out.update(sock=socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM),
                            pid=os.getpid())
        _ack_out["sock"].sendto(_U64.pack(seq), addr)
    except OSError:
        pass  # the sender is gone: its hold went with its connection


# How long a DataLoader worker waits at exit for acknowledgements already on their way.
DATALOADER_WORKER_GRACE = 0.5


def _is_dataloader_worker() -> bool:
    # torch clears get_worker_info() when the worker loop ends, before exit: recognise the
    # worker by its process target instead.
    target = getattr(multiprocessing.current_process(), "_target", None)
    return getattr(target, "__module__", "") == "torch.utils.data._utils.worker"


def _drain_holds():
    """At exit: give receivers time to pick up what this process sent (see module doc)."""
    timeout = float(os.environ.get("VOVP_HANDOFF_TIMEOUT", "30"))
    if _is_dataloader_worker():
        timeout = min(timeout, DATALOADER_WORKER_GRACE)
    deadline = time.monotonic() + timeout
    parent = multiprocessing.parent_process()
    with _holds_cv:
        while _holds and time.monotonic() < deadline:
            others = (parent is not None and parent.is_alive()) or \
                multiprocessing.active_children()
            if not others:
                break
            _holds_cv.wait(0.1)
        # From here on the ack thread drops nothing; a drop it has begun is waited for (it
        # takes microseconds; bounded all the same). What is left is dropped below, by this
        # thread, while the interpreter is still whole.
        _ack["closed"] = os.getpid()
        left = list(_holds.values())
        _holds.clear()
        _holds_cv.notify_all()
        end = time.monotonic() + 1.0
        while _ack["dropping"] and time.monotonic() < end:
            _holds_cv.wait(0.05)
    left.clear()


def pending_sends() -> int:
    """Sends of this process not yet acknowledged by their receiver."""
    return len(_holds)


# --- receiving -----------------------------------------------------------------------------------


def _rebuild(path, name, oid, offset, dtype, shape, strides, torch_dtype, ack_addr, seq):
    client = default_client(path)
    try:
        # Waits for the sender's seal, which may reach the daemon after this GET does.
        obj = client.core.get1(name, RECEIVE_TIMEOUT, writable=torch_dtype is not None)
        owner = client.core.owner(obj)
    finally:
        # Ack even on failure: the sender's hold cannot help a receiver that already failed.
        _send_ack(ack_addr, seq)
    if obj.id != oid:
        client.core.drop_owner(owner)
        raise VovpError(f"store object {name!r} was replaced before it was received")
    arr = np.ndarray(shape, dtype, buffer=owner, offset=offset, strides=strides)
    if torch_dtype is None:
        return arr
    t = _torch().from_numpy(arr)
    return t.view(torch_dtype) if t.dtype != torch_dtype else t
