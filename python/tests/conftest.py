"""Fixtures that run the real ``vovp-engine`` daemon.

The binary is $VOVP_ENGINE_BIN, or target/debug/vovp-engine of this repository (build it with
``cargo build -p vovp-transport --bin vovp-engine``). A missing binary fails the tests that need
it instead of skipping them: silently skipping every integration test would hide a broken build.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

# vovp.cluster's tests run a Ray cluster of several nodes on this machine. Ray reads this once,
# when it is imported: without it Ray replaces 127.0.0.1 with the machine's interface address
# and the nodes' traffic leaves loopback (or cannot connect at all in a sandbox).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

PYTHON_DIR = Path(__file__).resolve().parents[1]
REPO = Path(__file__).resolve().parents[2]
# Test the source tree (and let spawned children, which inherit sys.path, find it too).
if str(PYTHON_DIR) not in sys.path:
    sys.path.insert(0, str(PYTHON_DIR))

import vovp  # noqa: E402


def _use_installed_native_core():
    """The native core (``vovp._native``, built by cargo) is not in the source tree unless it
    was built in place (``maturin develop``): then test this tree's Python over the native
    module of the installed package (scripts/test.sh installs ./python first)."""
    if any(Path(vovp.__file__).parent.glob("_native*.so")):
        return
    import sysconfig

    for key in ("platlib", "purelib"):
        installed = Path(sysconfig.get_paths()[key]) / "vovp"
        if any(installed.glob("_native*.so")):
            vovp.__path__.append(str(installed))
            return


_use_installed_native_core()

ENGINE = Path(os.environ.get("VOVP_ENGINE_BIN", REPO / "target" / "debug" / "vovp-engine"))
# The Rust test fixture (tests/src/bin/vovp-fixture.rs): test-only client commands such as the
# CUDA ones, kept out of the user-facing `vovp` CLI.
FIXTURE = Path(os.environ.get("VOVP_FIXTURE_BIN", REPO / "target" / "debug" / "vovp-fixture"))

# CI installs torch: there, a test skipped because torch cannot be imported is a failure (a
# broken install must not turn every torch test into a silent skip).
REQUIRE_TORCH = os.environ.get("VOVP_REQUIRE_TORCH") == "1"


def _fail_if_torch_missing(report):
    if REQUIRE_TORCH and report.skipped and "could not import 'torch" in str(report.longrepr):
        report.outcome = "failed"
        report.longrepr = f"VOVP_REQUIRE_TORCH=1 but torch is missing: {report.longrepr}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_if_torch_missing(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_if_torch_missing(outcome.get_result())


class Daemon:
    """A running vovp-engine; ``socket`` is its path, ``stop()`` kills it."""

    def __init__(self, memory: int, extra_args=(), socket_path=None):
        if not ENGINE.is_file():
            pytest.fail(
                f"vovp-engine binary not found at {ENGINE}: build it with "
                "`cargo build -p vovp-transport --bin vovp-engine` or set VOVP_ENGINE_BIN",
                pytrace=False)
        # Short path under /tmp: AF_UNIX paths are limited to 107 bytes and pytest's tmp_path
        # can be longer.
        self.dir = tempfile.mkdtemp(prefix="vovp-", dir="/tmp")
        # socket_path: serve a path another (dead) daemon used, e.g. to test restarts.
        self.socket = socket_path or os.path.join(self.dir, "s.sock")
        self.memory = memory
        self.log_path = os.path.join(self.dir, "engine.log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [str(ENGINE), "-m", str(memory), "-s", self.socket, *extra_args],
            stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready(10.0)

    def _wait_ready(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                pytest.fail(f"vovp-engine exited with {self.proc.returncode}:\n{self.log()}",
                            pytrace=False)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(self.socket)
                return
            except OSError:
                time.sleep(0.02)
            finally:
                s.close()
        self.stop()
        pytest.fail(f"vovp-engine did not accept connections within {timeout} s:\n{self.log()}",
                    pytrace=False)

    def log(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")[-4000:]
        except OSError:
            return ""

    def client(self, **kw) -> vovp.Client:
        return vovp.Client(self.socket, **kw)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def start_daemon():
    """Factory: ``start_daemon(memory=bytes, extra_args=())`` -> Daemon, killed at teardown."""
    daemons = []

    def start(memory: int = 256 << 20, extra_args=()):
        d = Daemon(memory, extra_args)
        daemons.append(d)
        return d

    yield start
    for d in daemons:
        d.stop()


@pytest.fixture
def daemon(start_daemon):
    """A daemon with 256 MiB."""
    return start_daemon()


@pytest.fixture
def client(daemon):
    c = daemon.client()
    yield c
    c.close()


@pytest.fixture
def subprocess_env():
    """Environment for child Python processes that import vovp from this tree."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(PYTHON_DIR) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture
def reduction_to(monkeypatch):
    """init_reduction(path), undone at teardown (the pickler registry is process-global)."""
    import gc

    import numpy as np
    from multiprocessing.reduction import ForkingPickler

    # Restore only the entries init_reduction touches: multiprocessing registers its own
    # reducers (e.g. for Connection) lazily, and dropping those would break later tests.
    reg = ForkingPickler._extra_reducers
    keys = [np.ndarray]
    try:
        import torch
        keys.append(torch.Tensor)
    except ImportError:
        pass
    saved = {k: reg[k] for k in keys if k in reg}
    monkeypatch.setenv("VOVP_HANDOFF_TIMEOUT", "10")
    # init_reduction exports these for child processes: restored at teardown.
    monkeypatch.delenv("VOVP_SOCKET", raising=False)
    monkeypatch.delenv("VOVP_REDUCTION_THRESHOLD", raising=False)

    def init(path, **kw):
        vovp.init_reduction(path, **kw)

    yield init
    for k in keys:
        reg.pop(k, None)
    reg.update(saved)
    gc.collect()
