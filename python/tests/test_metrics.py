"""The store's metrics from Python: ``vovp.start_store(metrics=...)`` serves them where told
(and not unless asked), ``Client.metrics()`` gets the same text over the socket, and the values,
read with ``prometheus_client``'s own parser, move with the operations made: puts, gets over the
socket and through the shared directory, evictions, a client killed while holding references.
Malformed or oversized HTTP to the metrics port is refused while the store serves."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap
import threading
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

import vovp
from vovp.errors import ObjectNotFound

from _helpers import wait_for
from conftest import ENGINE


@pytest.fixture(autouse=True)
def _engine_bin(monkeypatch):
    monkeypatch.setenv("VOVP_ENGINE_BIN", str(ENGINE))


@pytest.fixture
def store():
    with vovp.start_store("16M", metrics="127.0.0.1:0") as s:
        yield s


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a Prometheus text page, by (name, labels)."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(store) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://{store.metrics_address}/metrics", timeout=20) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return samples(r.read().decode())


def value(s, name: str, **labels: str) -> float:
    return s[(name, frozenset(labels.items()))]


def test_the_port_is_opened_only_when_asked_and_binds_where_told():
    with vovp.start_store("16M") as plain:
        assert plain.metrics_address is None
        # METRICS over the socket works without the port.
        with vovp.Client(plain.socket) as c:
            assert value(samples(c.metrics()), "vovp_capacity_bytes") == 16 << 20
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with vovp.start_store("16M", metrics=f"127.0.0.1:{port}") as told:
        assert told.metrics_address == f"127.0.0.1:{port}"
        assert value(scrape(told), "vovp_capacity_bytes") == 16 << 20


def test_values_move_with_puts_gets_and_evictions(store):
    before = scrape(store)
    assert value(before, "vovp_seals_total") == 0
    shared = vovp.Client(store.socket)
    by_socket = vovp.Client(store.socket, shared_reads=False)
    for i in range(4):
        shared.put(f"o{i}", b"x" * 100)
    shared.sync()
    for i in range(4):
        assert bytes(shared.get_buffer(f"o{i}")) == b"x" * 100
    for i in range(2):
        assert bytes(by_socket.get_buffer(f"o{i}")) == b"x" * 100
    with pytest.raises(ObjectNotFound):
        by_socket.get_buffer("absent")
    s = scrape(store)
    assert value(s, "vovp_seals_total") == 4
    assert value(s, "vovp_sealed_bytes_total") == 400
    assert value(s, "vovp_objects", state="sealed") == 4
    assert value(s, "vovp_shared_gets_total") == 4
    assert value(s, "vovp_shared_get_bytes_total") == 400
    assert value(s, "vovp_socket_gets_total", result="hit") == 2
    assert value(s, "vovp_socket_gets_total", result="miss") == 1
    assert value(s, "vovp_socket_get_bytes_total") == 200
    assert value(s, "vovp_request_duration_seconds_count", op="GET") >= 3
    assert value(s, "vovp_resident_bytes") >= value(s, "vovp_used_bytes") > 0
    # Client.metrics() answers the same families over the socket.
    over_socket = samples(shared.metrics())
    assert value(over_socket, "vovp_seals_total") == 4

    # Evictions: 24 objects of 1 MiB through a 16 MiB store.
    for i in range(24):
        shared.put(f"big{i}", b"\0" * (1 << 20))
    shared.sync()
    s = scrape(store)
    assert value(s, "vovp_evicted_objects_total") >= 1
    assert value(s, "vovp_evicted_bytes_total") >= 1 << 20
    assert value(s, "vovp_used_bytes") <= value(s, "vovp_capacity_bytes")
    shared.close()
    by_socket.close()


HOLDER = textwrap.dedent("""
    import sys, time
    import vovp
    c = vovp.Client(sys.argv[1])
    held = [c.get_buffer("held-a"), c.get_buffer("held-b")]
    print("holding", flush=True)
    time.sleep(600)
""")


def test_a_client_killed_while_holding_references_drops_out(store, subprocess_env):
    with vovp.Client(store.socket) as c:
        c.put("held-a", b"a" * 1000)
        c.put("held-b", b"b" * 24)
        c.sync()
        idle = scrape(store)
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, store.socket],
                                  env=subprocess_env, stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "holding"
            pid = str(holder.pid)
            s = scrape(store)
            assert value(s, "vovp_client_references", pid=pid) == 2
            assert value(s, "vovp_client_held_bytes", pid=pid) == 1024
            assert value(s, "vovp_references") == value(idle, "vovp_references") + 2
            assert value(s, "vovp_holders") == value(idle, "vovp_holders") + 1
        finally:
            holder.send_signal(signal.SIGKILL)
            holder.wait()
            holder.stdout.close()

        def released():
            s = scrape(store)
            return (("vovp_client_references", frozenset({("pid", pid)})) not in s
                    and value(s, "vovp_references") == value(idle, "vovp_references"))
        wait_for(released)
        s = scrape(store)
        assert value(s, "vovp_connections_closed_total") >= 1
        # Its gets through the directory stay counted.
        assert value(s, "vovp_shared_gets_total") >= 2


def _http(address: str, request: bytes) -> str:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=20) as s:
        try:
            s.sendall(request)
        except OSError:
            pass  # the server may close before it read everything (a refused head)
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            data += chunk
    return data.decode(errors="replace").split("\r\n", 1)[0]


def test_malformed_and_oversized_http_is_refused_while_the_store_serves(store):
    stop = threading.Event()
    errors: list[BaseException] = []
    done = [0]

    def work():
        try:
            with vovp.Client(store.socket) as c:
                while not stop.is_set():
                    name = f"w{done[0] % 16}"
                    c.put(name, done[0].to_bytes(8, "little"), replace=True)
                    assert len(bytes(c.get_buffer(name, timeout=5))) == 8
                    done[0] += 1
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            errors.append(e)

    worker = threading.Thread(target=work)
    worker.start()
    try:
        wait_for(lambda: done[0] > 10)
        huge = b"GET /metrics HTTP/1.1\r\nHost: v\r\nX-Pad: " + b"a" * (16 << 10) + b"\r\n\r\n"
        assert " 431 " in _http(store.metrics_address, huge)
        assert " 400 " in _http(store.metrics_address, b"\x00\x01 hello\r\n\r\n")
        assert " 404 " in _http(store.metrics_address,
                                b"GET / HTTP/1.1\r\nHost: v\r\nConnection: close\r\n\r\n")
        then = done[0]
        wait_for(lambda: done[0] > then)
    finally:
        stop.set()
        worker.join(30)
    assert not errors, errors
    assert value(scrape(store), "vovp_seals_total") >= 10
