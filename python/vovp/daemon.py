"""Starting a store from Python: ``vovp.start_store`` and ``init_client(start=True)``.

The daemon is the ``vovp-engine`` executable: ``$VOVP_ENGINE_BIN`` if set, else the one
``pip install`` put beside this interpreter (the wheel carries it), else the first on PATH.
A store started here goes away with the process that started it, even one killed by SIGKILL
(``PR_SET_PDEATHSIG``), unless started with ``detach=True``.

    with vovp.start_store(memory="1G") as store:
        client = vovp.init_client(store.socket)

One caveat of ``PR_SET_PDEATHSIG``: it fires when the *thread* that started the daemon ends.
Start stores from a thread that lives as long as you need them (the main thread, typically).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import re
import shutil
import signal
import socket as _socket
import subprocess
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Tuple, Union

from .errors import ConnectionError as VovpConnectionError
from .errors import InvalidArgument

__all__ = ["StoreProcess", "engine_binary", "start_store", "ensure_store"]

_PR_SET_PDEATHSIG = 1
# Daemon flags whose short form Plasma's users know; every other keyword is `--kebab-case`.
_SHORT_FLAGS = {"directory": "-d"}
# Stores this process started for init_client(start=True): kept so they live as long as it does.
_started: dict[str, "StoreProcess"] = {}


def engine_binary() -> str:
    """Path of the ``vovp-engine`` to run; a clear error when there is none."""
    explicit = os.environ.get("VOVP_ENGINE_BIN")
    if explicit:
        if os.path.isfile(explicit) and os.access(explicit, os.X_OK):
            return explicit
        raise FileNotFoundError(f"VOVP_ENGINE_BIN={explicit!r} is not an executable file")
    candidates = [os.path.join(sysconfig.get_path("scripts"), "vovp-engine")]
    on_path = shutil.which("vovp-engine")
    if on_path:
        candidates.append(on_path)
    # A source tree used without installing (PYTHONPATH=python): its newest build.
    root = Path(__file__).resolve().parents[2]
    builds = [root / "target" / kind / "vovp-engine" for kind in ("release", "debug")]
    builds = sorted((b for b in builds if b.is_file()), key=lambda b: b.stat().st_mtime)
    candidates += [str(b) for b in reversed(builds)]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise FileNotFoundError(
        "no vovp-engine executable: `pip install ./python` installs one beside the interpreter "
        "(" + sysconfig.get_path("scripts") + "); or set VOVP_ENGINE_BIN, or put one on PATH "
        "(`cargo install --path transport`)")


def _flags(options: dict[str, Any]) -> list[str]:
    """``huge_pages=True`` → ``--huge-pages``; ``gpu_memory="0:8G"`` → ``--gpu-memory 0:8G``;
    a list repeats the flag; False/None leave it out."""
    out = []
    for key, value in options.items():
        flag = _SHORT_FLAGS.get(key, "--" + key.replace("_", "-"))
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            for v in value:
                out += [flag, str(v)]
        else:
            out += [flag, os.fspath(value) if isinstance(value, Path) else str(value)]
    return out


def _answers(path: str) -> bool:
    """True when a daemon accepts connections at ``path`` (it binds only once it serves)."""
    probe = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


class StoreProcess:
    """A ``vovp-engine`` started by :func:`start_store`: its ``socket``, ``pid`` and ``stop()``.
    A context manager: leaving the block stops the daemon."""

    def __init__(self, process: subprocess.Popen[bytes], socket: str, log: str,
                 owned_dir: Optional[str], detached: bool):
        self.process = process
        self.socket = socket
        self.log = log
        self.detached = detached
        self._owned_dir = owned_dir

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def metrics_address(self) -> Optional[str]:
        """``host:port`` of the metrics endpoint (``start_store(metrics=...)``; the port the
        kernel picked for port 0), from the daemon's log; None when it serves none."""
        try:
            text = Path(self.log).read_text(errors="replace")
        except OSError:
            return None
        # `metrics_addr=127.0.0.1:9464` (text log) or `"metrics_addr":"127.0.0.1:9464"` (JSON).
        found = re.findall(r'metrics_addr"?[=:]"?([^\s",]+)', text)
        return found[-1] if found else None

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 10.0) -> Optional[int]:
        """SIGTERM (the daemon removes its socket), SIGKILL after ``timeout``; the exit code."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        _started.pop(self.socket, None)
        if self._owned_dir is not None:
            shutil.rmtree(self._owned_dir, ignore_errors=True)
            self._owned_dir = None
        return self.process.returncode

    def __enter__(self) -> "StoreProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.alive() else f"exited {self.process.returncode}"
        return f"<vovp.StoreProcess pid={self.pid} socket={self.socket!r} {state}>"


def _die_with(parent: int) -> Callable[[], None]:
    def preexec() -> None:
        # SIGTERM when the starting thread's process dies, even by SIGKILL; and if it died
        # before this line ran, there is no one to serve.
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)
    return preexec


def start_store(memory: Any = "1G", socket: Optional[str] = None, *, detach: bool = False,
                timeout: float = 30.0, spill_dir: Optional[str] = None,
                spill_max: Any = None, metrics: Optional[str] = None,
                transfer: Optional[str] = None,
                transfer_key: Union[bytes, str, None] = None,
                **options: Any) -> StoreProcess:
    """Starts a ``vovp-engine`` and returns once it serves.

    ``memory``: the store's size (``-m``: bytes, or ``"512M"``, ``"4G"``). ``socket``: where it
    listens; by default a fresh path in a private temporary directory. ``spill_dir``: spill
    unreferenced objects to files there instead of evicting them when memory is needed (a get
    reads them back; the directory is this daemon's alone and emptied at start), at most
    ``spill_max`` bytes of them (``"10G"``; default: what the disk takes). ``metrics``: serve
    the Prometheus metrics at ``http://ADDR/metrics`` (``"127.0.0.1:9464"``; port 0 takes a
    free port, which ``StoreProcess.metrics_address`` tells; ``--metrics``, off by default).
    Other daemon flags are keywords: ``huge_pages=True``, ``directory="/mnt/huge"`` (``-d``),
    ``gpu_memory="0:8G"``, ``allow_uid=[1001]``, ``log_level="debug"``... (``vovp-engine
    --help`` lists them).

    The daemon stops with this process (even by SIGKILL) unless ``detach=True``; ``stop()`` or
    leaving a ``with`` block stops it earlier. Its output goes to ``<socket>.log``.

    ``transfer="ip:port"`` serves transfers to other engines there (``--transfer``; port 0
    takes a free one: ``Client.transfer_address()`` says which); ``transfer_key`` is the
    cluster's shared key (32 bytes, or 64 hex digits), needed to serve and to fetch. It is
    handed to the daemon in its environment (``VOVP_TRANSFER_KEY``), never on its command
    line; ``transfer_key_file=PATH`` (a file of mode 0600) passes a file instead.
    """
    if spill_max is not None and spill_dir is None:
        raise InvalidArgument("spill_max needs spill_dir")
    options = {**options, "spill_dir": spill_dir, "spill_max": spill_max, "metrics": metrics,
               "transfer": transfer}
    env = None
    if transfer_key is not None:
        env = {**os.environ, "VOVP_TRANSFER_KEY": key_hex(transfer_key)}
    return spawn((), memory, socket, detach, timeout, options, env=env)


def key_hex(key: Union[bytes, str]) -> str:
    """A transfer key as the daemon reads it: 64 hex digits."""
    if isinstance(key, (bytes, bytearray)):
        if len(key) != 32:
            raise ValueError(f"a transfer key is 32 bytes, not {len(key)}")
        return bytes(key).hex()
    key = key.strip()
    if len(key) != 64 or any(c not in "0123456789abcdefABCDEF" for c in key):
        raise ValueError("a transfer key is 32 bytes or 64 hex digits")
    return key


def spawn(prefix: Tuple[str, ...], memory: Any, socket: Optional[str], detach: bool,
           timeout: float, options: dict[str, Any], extra: Tuple[str, ...] = (),
           binary: Optional[str] = None,
           env: Optional[dict[str, str]] = None) -> StoreProcess:
    """``start_store``, for the package's other starters (``vovp.plasma``,
    ``vovp.cluster``): ``prefix`` runs the daemon under another program (Plasma's
    ``use_valgrind``), ``extra`` are raw daemon arguments, ``binary`` a daemon to run,
    ``env`` its environment (None: this process's)."""
    owned_dir = None
    if socket is None:
        owned_dir = tempfile.mkdtemp(prefix="vovp-")
        socket = os.path.join(owned_dir, "vovp.sock")
    socket = os.fspath(socket)
    command = [*prefix, binary or engine_binary(), "-m", str(memory), "-s", socket,
               *_flags(options), *extra]
    log_path = socket + ".log"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
            start_new_session=detach,
            preexec_fn=None if detach else _die_with(os.getpid()))
    store = StoreProcess(process, socket, log_path, owned_dir, detach)
    deadline = time.monotonic() + timeout
    while not _answers(socket):
        code = process.poll()
        if code is not None or time.monotonic() > deadline:
            # The log first: stopping removes a directory this call made, log included.
            tail = Path(log_path).read_text(errors="replace").strip().splitlines()[-5:]
            store.stop()
            why = (f"exited with code {code}" if code is not None
                   else f"did not serve within {timeout} s")
            raise VovpConnectionError(
                f"vovp-engine at {socket} {why}: {' | '.join(tail) or 'no output'} "
                f"(command: {' '.join(command)})")
        time.sleep(0.01)
    return store


def ensure_store(socket: str, memory: Any = "1G", **options: Any) -> Optional[StoreProcess]:
    """A daemon at ``socket``: the one already serving there, or one started now. Processes
    doing this at once end with one daemon: starters take turns under a lock file
    (``<socket>.lock``) and look again before starting. Returns the store this call started
    (kept alive with this process), or None."""
    socket = os.fspath(socket)
    if _answers(socket):
        return None
    lock_path = socket + ".lock"
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if _answers(socket):
                return None
            store = start_store(memory, socket, **options)
            _started[socket] = store
            return store
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
