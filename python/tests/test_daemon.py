"""A store started from Python (``vovp.start_store``, ``vovp.daemon.ensure_store``) and the CLI
behind ``python -m vovp``: real daemons, real processes, the starter killed by SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import vovp
from vovp import daemon

from conftest import ENGINE, PYTHON_DIR, REPO

pytestmark = pytest.mark.skipif(not ENGINE.exists(), reason="no vovp-engine binary built")


@pytest.fixture(autouse=True)
def _engine_bin(monkeypatch):
    monkeypatch.setenv("VOVP_ENGINE_BIN", str(ENGINE))


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # A zombie of ours counts as gone once reaped.
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.02)
    return False


def _python(code: str, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(PYTHON_DIR), VOVP_ENGINE_BIN=str(ENGINE))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def test_a_started_store_serves_and_stops_with_its_block():
    with vovp.start_store(memory="64M") as store:
        assert store.alive() and os.path.exists(store.socket)
        client = vovp.init_client(store.socket)
        client.put_tensor("x", __import__("numpy").arange(6.0))
        assert list(vovp.init_client(store.socket).get_tensor("x")) == [0, 1, 2, 3, 4, 5]
        assert client.stats()["capacity"] == 64 << 20
        client.close()
        pid, path = store.pid, store.socket
    assert _gone(pid), "the daemon outlived its with block"
    assert not os.path.exists(path)


def test_daemon_flags_are_keywords_and_a_bad_one_is_a_clear_error(tmp_path):
    path = str(tmp_path / "s.sock")
    with vovp.start_store("32M", path, log_level="debug", no_shared_reads=True) as store:
        assert store.socket == path
        assert vovp.init_client(path).stats()["capacity"] == 32 << 20
    with pytest.raises(vovp.ConnectionError, match="no-such-flag"):
        vovp.start_store("32M", str(tmp_path / "t.sock"), no_such_flag=True)
    # The same with the socket in a directory of start_store's own (removed on failure).
    with pytest.raises(vovp.ConnectionError, match="no-such-flag"):
        vovp.start_store("32M", no_such_flag=True)


def test_the_daemon_dies_with_its_starter_even_by_sigkill():
    starter = _python("""
        import vovp
        s = vovp.start_store(memory="32M")
        print(s.pid, s.socket, flush=True)
        import time; time.sleep(600)
    """)
    line = starter.stdout.readline().split()
    assert line, starter.stderr.read()
    pid, path = int(line[0]), line[1]
    assert vovp.init_client(path).stats()["capacity"] == 32 << 20
    starter.send_signal(signal.SIGKILL)
    starter.wait()
    assert _gone(pid), "the daemon outlived the process that started it"


def test_a_detached_store_outlives_its_starter(tmp_path):
    path = str(tmp_path / "d.sock")
    starter = _python(f"""
        import vovp
        s = vovp.start_store(memory="32M", socket={path!r}, detach=True)
        print(s.pid, flush=True)
    """)
    out, err = starter.communicate(timeout=60)
    assert starter.returncode == 0, err
    pid = int(out.split()[0])
    try:
        time.sleep(0.2)
        assert vovp.init_client(path).stats()["capacity"] == 32 << 20
    finally:
        os.kill(pid, signal.SIGTERM)
    assert _gone(pid)


def test_starters_racing_for_one_socket_end_with_one_daemon(tmp_path):
    path = str(tmp_path / "race.sock")
    code = f"""
        import os, sys, time
        import vovp
        from vovp import daemon
        go = float(sys.argv[1])
        while time.time() < go:
            pass
        started = daemon.ensure_store({path!r}, "32M")
        c = vovp.init_client({path!r})
        c.put(f"from-{{os.getpid()}}", b"x", wait=True)
        print("started" if started else "joined", started.pid if started else 0, flush=True)
        sys.stdin.read()  # stay (and keep a started daemon) until told
    """
    go = time.time() + 1.0
    env = dict(os.environ, PYTHONPATH=str(PYTHON_DIR), VOVP_ENGINE_BIN=str(ENGINE))
    racers = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(go)], env=env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
              for _ in range(4)]
    try:
        answers = [r.stdout.readline().split() for r in racers]
        assert sorted(a[0] for a in answers) == ["joined"] * 3 + ["started"], answers
        names = {i["name"] for i in vovp.init_client(path).list()}
        assert names == {f"from-{r.pid}" for r in racers}, names
    finally:
        for r in racers:
            r.stdin.close()
            r.wait(timeout=30)
    assert _gone(int(next(a[1] for a in answers if a[0] == "started")))


def test_a_missing_engine_names_the_ways_to_get_one(monkeypatch, tmp_path):
    monkeypatch.setenv("VOVP_ENGINE_BIN", str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError, match="VOVP_ENGINE_BIN"):
        vovp.start_store()


def test_python_dash_m_vovp_runs_the_cli(tmp_path):
    cli = Path(os.environ.get("VOVP_CLI_BIN", REPO / "target" / "debug" / "vovp"))
    env = dict(os.environ, PYTHONPATH=str(PYTHON_DIR), VOVP_CLI_BIN=str(cli))
    with vovp.start_store("32M", str(tmp_path / "c.sock")) as store:
        vovp.init_client(store.socket).put("hello", b"abc")
        out = subprocess.run([sys.executable, "-m", "vovp", "-s", store.socket, "list"],
                             env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "hello" in out.stdout and "NAME" in out.stdout


def test_init_client_starts_a_store_only_where_none_answers(tmp_path):
    path = str(tmp_path / "auto.sock")
    with pytest.raises(vovp.ConnectionError) as missing:
        vovp.init_client(path)
    for hint in (path, "vovp-engine -m 1G -s", "start=True", "start_store"):
        assert hint in str(missing.value), str(missing.value)
    first = vovp.init_client(path, start=True, memory="48M")
    started = daemon._started[path]
    assert first.stats()["capacity"] == 48 << 20
    # A store answers now: start=True connects to it and starts nothing.
    second = vovp.init_client(path, start=True, memory="16M")
    assert second.stats()["capacity"] == 48 << 20 and daemon._started[path] is started
    first.close()
    second.close()
    started.stop()
    assert not os.path.exists(path)
