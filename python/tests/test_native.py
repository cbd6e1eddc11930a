"""vovp._native, the native core over the Rust client, against the real daemon.

Every test crosses a process boundary (the daemon; for cross-client checks a second client's
connection, or a child process) and checks what the daemon itself reports.
"""

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import vovp
from _helpers import wait_for

N = pytest.importorskip("vovp._native", reason="the native core is not built")


def refcount(client, name):
    """The daemon's reference count of ``name`` (via vovp.Client's LIST, a connection of its own)."""
    return next((e["refcount"] for e in client.list() if e["name"] == name), None)


def exporter(arr):
    """The object numpy made ``arr`` from: its base (numpy >= 1.23 keeps the
    ``__array_struct__`` capsule beside it, as the tuple ``(exporter, capsule)``)."""
    base = arr.base
    return base[0] if type(base) is tuple else base


def put_bytes(native, name, data: bytes, metadata=b"", keep=False):
    """The put the package's raw ``put`` makes (waited for), or a kept one."""
    options = N.PutOptions(keep_reference=keep)
    return native.put_with(name, np.frombuffer(data, np.uint8), options, metadata)


def test_put_get_is_zero_copy_and_read_only(daemon, client):
    n = N.Client(daemon.socket)
    put_bytes(n, "a", bytes(range(200)), b"meta")
    [obj] = n.get(["a"])
    arr = np.asarray(obj)
    assert exporter(arr) is obj and not arr.flags.writeable and not arr.flags.owndata
    assert arr.tobytes() == bytes(range(200)) and obj.metadata == b"meta"
    assert obj.name == "a" and obj.size == 200 and obj.location == ("host", None)
    assert arr.ctypes.data == obj.address
    # Another connection's get of the same object maps the same shared memory: what the
    # other client (vovp.Client) reads is the bytes of this process's view.
    assert client.get_buffer("a").tobytes() == arr.tobytes()
    with pytest.raises(ValueError):
        arr[0] = 1
    assert n.get(["missing"]) == [None]


def test_reference_lives_as_long_as_an_array_over_it(daemon, client):
    n = N.Client(daemon.socket)
    put_bytes(n, "r", b"x" * 64)
    [obj] = n.get(["r"])
    view = np.asarray(obj)[8:16].reshape(2, 4)  # a derived array keeps the object alive
    del obj
    gc.collect()
    assert wait_for(lambda: refcount(client, "r") == 1)
    assert view.tobytes() == b"x" * 8
    del view
    gc.collect()
    # The release rides ahead of the next request, or is sent at once when the client is idle.
    n.contains("r")
    assert wait_for(lambda: refcount(client, "r") == 0)


def test_explicit_release_once(daemon, client):
    n = N.Client(daemon.socket)
    put_bytes(n, "e", b"y" * 10)
    [obj] = n.get(["e"])
    assert refcount(client, "e") == 1
    assert obj.release() and obj.released
    assert not obj.release()
    n.contains("e")
    assert wait_for(lambda: refcount(client, "e") == 0)


def test_create_seal_and_abort_by_dropping(daemon, client):
    n = N.Client(daemon.socket)
    buf = n.create("c", 16, b"m", ephemeral=False)
    arr = np.asarray(buf)
    assert arr.flags.writeable and exporter(arr) is buf
    arr[:] = np.arange(16, dtype=np.uint8)
    assert not client.contains("c")  # unsealed: invisible to others
    n.seal("c")
    assert client.get_buffer("c").tobytes() == bytes(range(16))
    with pytest.raises(vovp.AlreadySealed):
        n.seal("c")
    # An unsealed object whose buffer is dropped is aborted: its name is free again.
    b2 = n.create("d", 8)
    del b2
    gc.collect()
    n.contains("d")
    assert wait_for(lambda: refcount(client, "d") is None)
    put_bytes(n, "d", b"again")
    assert client.get_buffer("d").tobytes() == b"again"


def test_only_the_creator_seals(daemon):
    a, b = N.Client(daemon.socket), N.Client(daemon.socket)
    buf = a.create("o", 4)
    with pytest.raises(vovp.NotCreator) as e:
        b.seal("o")
    assert e.value.status == 6
    a.seal("o")
    del buf


def test_errors_are_vovp_errors(daemon):
    n = N.Client(daemon.socket)
    put_bytes(n, "x", b"1")
    with pytest.raises(vovp.ObjectExists) as e:
        put_bytes(n, "x", b"2")
    assert e.value.status == 2 and "already exists" in str(e.value)
    with pytest.raises(vovp.InvalidName):
        put_bytes(n, "", b"2")
    with pytest.raises(vovp.ObjectNotFound):
        n.delete("nope")
    with pytest.raises(ValueError):
        n.get(["x"], timeout=-1)


def test_connect_errors_and_connect_timeout(tmp_path):
    missing = f"/tmp/vovp-native-missing-{os.getpid()}.sock"
    with pytest.raises(vovp.ConnectionError):
        N.Client(missing)
    # connect_timeout: a daemon that appears while the client waits is reached.
    from conftest import Daemon

    box = {}
    t = threading.Thread(target=lambda: box.update(c=N.Client(missing, connect_timeout=20)))
    t.start()
    time.sleep(0.3)
    d = Daemon(16 << 20, socket_path=missing)
    try:
        t.join(30)
        assert box["c"].capacity == 16 << 20
    finally:
        d.stop()


def test_get_waits_with_the_gil_released(daemon, client):
    n = N.Client(daemon.socket)
    box = {}

    def waiter():
        box["got"] = n.get(["later"], timeout=20)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.2)
    # This thread runs Python (and puts through another connection) while the other one waits
    # in the native get: it could not if the GIL were held there.
    client.put("later", np.arange(4, dtype=np.uint8))
    t.join(20)
    assert not t.is_alive()
    [obj] = box["got"]
    assert np.asarray(obj).tobytes() == bytes(range(4))
    start = time.monotonic()
    assert n.get(["never"], timeout=0.2) == [None]
    assert time.monotonic() - start >= 0.19


def test_large_put_through_the_mapping_and_keep(daemon, client):
    n = N.Client(daemon.socket)
    data = np.random.default_rng(1).integers(0, 255, 3 << 20, dtype=np.uint8)
    kept = n.put_with("big", data, N.PutOptions(keep_reference=True))
    assert np.array_equal(np.asarray(kept), data)
    assert refcount(client, "big") == 1
    assert np.array_equal(client.get_buffer("big"), data)


def test_object_of_another_process(daemon, subprocess_env):
    code = textwrap.dedent(f"""
        import numpy as np, vovp
        c = vovp.Client({daemon.socket!r})
        c.put("child", np.full(1000, 9, dtype=np.uint8), metadata=b"from-child")
        c.close()
    """)
    subprocess.run([sys.executable, "-c", code], env=subprocess_env, check=True, timeout=60)
    n = N.Client(daemon.socket)
    [obj] = n.get(["child"], timeout=5)
    assert obj.metadata == b"from-child"
    assert np.asarray(obj).sum() == 9000


def test_list_and_stats_match_the_python_client(daemon, client):
    n = N.Client(daemon.socket)
    put_bytes(n, "l", b"abc", b"md")
    [native_entry] = n.list()
    [py_entry] = client.list()
    for k in ("name", "id", "size", "device", "sealed", "ephemeral", "refcount", "metadata"):
        assert native_entry[k] == py_entry[k], k
    ns, ps = n.stats(), client.stats()
    assert set(ns) == set(ps)
    assert ns["objects"] == ps["objects"] == 1 and ns["capacity"] == ps["capacity"]
    assert n.evict(1 << 20) >= 0


def test_reconnect_after_a_daemon_restart():
    from conftest import Daemon

    first = Daemon(16 << 20)
    path = first.socket
    n = N.Client(path, reconnect=True)
    put_bytes(n, "old", b"1")
    [old] = n.get(["old"])
    kept = np.asarray(old)
    first.proc.kill()
    first.proc.wait(10)
    os.unlink(path)
    second = Daemon(16 << 20, socket_path=path)
    try:
        assert not n.contains("old")  # reconnected: the new daemon never had it
        put_bytes(n, "new", b"2")
        assert kept.tobytes() == b"1"  # the old mapping stays valid while viewed
        del old, kept
        gc.collect()
        [new] = n.get(["new"])
        assert np.asarray(new).tobytes() == b"2"
    finally:
        second.stop()
        first.stop()  # its folder holds the socket path both used


def test_forked_child_neither_talks_nor_releases(daemon, client):
    n = N.Client(daemon.socket)
    put_bytes(n, "f", b"z" * 32)
    [obj] = n.get(["f"])
    arr = np.asarray(obj)
    pid = os.fork()
    if pid == 0:  # child: reads the inherited view, cannot use the client, drops everything
        code = 0
        try:
            if arr.tobytes() != b"z" * 32:
                code = 1
            try:
                n.contains("f")
                code = 2
            except vovp.ConnectionError:
                pass
            del arr
            obj.release()  # the parent's reference: must not be released from here
            gc.collect()
        except BaseException:  # noqa: BLE001
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    # The parent's connection still works and its reference is intact.
    assert n.contains("f")
    assert refcount(client, "f") == 1
    del arr, obj
    gc.collect()
    n.contains("f")
    assert wait_for(lambda: refcount(client, "f") == 0)


def test_subscription_sees_seal_and_delete(daemon):
    n = N.Client(daemon.socket)
    sub = n.subscribe()
    put_bytes(n, "s", b"abc", b"meta")
    n.delete("s")
    assert sub.next(timeout=10) == ("sealed", "s", 3, b"meta")
    kind, name, _, _ = sub.next(timeout=10)
    assert (kind, name) == ("deleted", "s")
    assert sub.next(timeout=0.1) is None  # nothing more
    sub.close()
    assert sub.next() is None


def test_writable_view_of_another_clients_object_is_private(daemon, client):
    n = N.Client(daemon.socket)
    client.put("w", np.zeros(4096, dtype=np.uint8))
    [obj] = n.get(["w"], writable=True)
    arr = np.asarray(obj)
    assert arr.flags.writeable and not obj.readonly
    arr[:4] = 9  # copy-on-write: this process only
    assert client.get_buffer("w").tobytes()[:4] == b"\0\0\0\0"
    [again] = n.get(["w"])
    assert np.asarray(again).tobytes()[:4] == b"\0\0\0\0"
    # An object in this client's own arena is writable in place (the creator's mapping).
    kept = put_bytes(n, "own", b"\1" * 300000, keep=True)
    [own] = n.get(["own"], writable=True)
    assert np.asarray(own).ctypes.data == np.asarray(kept).ctypes.data


def test_close_releases_everything_and_refuses_calls(daemon, client):
    n = N.Client(daemon.socket)
    put_bytes(n, "k", b"k" * 8)
    [obj] = n.get(["k"])
    assert refcount(client, "k") == 1
    n.close()
    assert wait_for(lambda: refcount(client, "k") == 0)
    with pytest.raises(vovp.ConnectionError):
        n.contains("k")
    assert np.asarray(obj).size == 8  # still mapped
    del obj
    gc.collect()
    assert client.stats()["connections"] == 1


def test_release_delay_queues_releases_for_the_flusher(daemon, client):
    # "Queued, not sent" holds only until the delay passes: a check that came later (a loaded
    # machine) proves nothing either way, so it is made again with a longer delay.
    for delay in (3.0, 12.0, 48.0):
        n = N.Client(daemon.socket, release_delay=delay, shared_reads=False)
        put_bytes(n, "q1", b"1")
        put_bytes(n, "q2", b"2")
        [a] = n.get(["q1"])
        released = time.monotonic()
        del a
        gc.collect()
        count = refcount(client, "q1")
        if time.monotonic() - released < delay:
            break
        n.close()
        client.delete("q1")
        client.delete("q2")
    # Queued, not sent: the daemon still counts the reference...
    assert count == 1
    # ... until the flusher sends it after the delay, with no request from this client.
    assert wait_for(lambda: refcount(client, "q1") == 0, timeout=delay + 30)
    [b] = n.get(["q2"])
    del b
    gc.collect()
    n.flush()  # now
    assert refcount(client, "q2") == 0


# -- put_with / put_batch: the one native put and its options -------------------------------------


def test_put_options_are_one_immutable_object():
    o = N.PutOptions(ephemeral=True, replace=True, keep_reference=True, pipelined=True,
                     writable=True)
    assert (o.ephemeral, o.replace, o.keep_reference, o.pipelined, o.writable) == (True,) * 5
    assert o.device is None
    assert repr(o) == ("PutOptions(ephemeral=True, replace=True, keep_reference=True, "
                       "pipelined=True, writable=True)")
    plain = N.PutOptions()
    assert not any((plain.ephemeral, plain.replace, plain.keep_reference, plain.pipelined,
                    plain.writable))
    assert N.PutOptions(device=1).device == 1
    with pytest.raises(AttributeError):
        o.ephemeral = False
    with pytest.raises(TypeError):
        N.PutOptions(True)  # keywords only


def test_put_with_answers_an_id_nothing_or_the_stored_copy(daemon, client):
    n = N.Client(daemon.socket)
    src = np.arange(32, dtype=np.uint8)
    oid = n.put_with("waited", src, N.PutOptions(), b"m")
    assert isinstance(oid, int) and oid > 0
    assert client.get_buffer("waited", with_metadata=True)[1] == b"m"
    assert n.put_with("later", src, N.PutOptions(pipelined=True)) is None
    n.sync()
    assert client.get_buffer("later").tobytes() == src.tobytes()
    kept = n.put_with("kept", src, N.PutOptions(keep_reference=True))
    assert isinstance(kept, N.Object) and np.array_equal(np.asarray(kept), src)
    assert refcount(client, "kept") == 1
    # Neither of the others keeps a reference.
    assert refcount(client, "waited") == 0 and refcount(client, "later") == 0


def test_put_with_shows_a_kept_result_with_its_layout(daemon):
    n = N.Client(daemon.socket)
    src = np.arange(12, dtype=np.int32).reshape(3, 4)
    kept = n.put_with("shaped", src, N.PutOptions(keep_reference=True), b"",
                      ("i", 4, (3, 4)))
    arr = np.asarray(kept)
    assert arr.dtype == np.int32 and arr.shape == (3, 4) and np.array_equal(arr, src)
    # A layout that is not exactly the bytes is refused before anything is sent.
    with pytest.raises(ValueError):
        n.put_with("too-big", src, N.PutOptions(keep_reference=True), b"", ("i", 4, (4, 4)))
    assert not n.contains("too-big")


def test_put_with_replace_makes_the_next_version(daemon, client):
    n = N.Client(daemon.socket)
    put_bytes(n, "v", b"one")
    with pytest.raises(vovp.ObjectExists):
        put_bytes(n, "v", b"two")
    n.put_with("v", np.frombuffer(b"two", np.uint8), N.PutOptions(replace=True))
    buf, meta = client.get_buffer("v", with_metadata=True)
    assert buf.tobytes() == b"two"
    assert next(e["version"] for e in client.list() if e["name"] == "v") == 2


def test_put_with_ephemeral_goes_with_its_last_reference(daemon, client):
    n = N.Client(daemon.socket)
    kept = n.put_with("eph", np.zeros(8, np.uint8),
                      N.PutOptions(ephemeral=True, keep_reference=True))
    entry = next(e for e in client.list() if e["name"] == "eph")
    assert entry["ephemeral"] and entry["refcount"] == 1
    assert kept.release()
    n.contains("eph")  # (the release rides ahead of the next request)
    assert wait_for(lambda: refcount(client, "eph") is None)
    # Not ephemeral: it stays once nobody holds it.
    n.put_with("stays", np.zeros(8, np.uint8), N.PutOptions())
    assert refcount(client, "stays") == 0


def test_put_with_a_kept_pipelined_put_comes_back_pending(daemon, client):
    n = N.Client(daemon.socket, release_delay=0.05)
    kept = n.put_with("pend", np.full(64, 7, np.uint8),
                      N.PutOptions(keep_reference=True, pipelined=True))
    assert isinstance(kept, N.Object) and np.asarray(kept).tobytes() == bytes([7]) * 64
    assert kept.pending  # (its id comes with the store's answer, read when asked for)
    n.sync()
    assert kept.id > 0 and not kept.pending
    assert client.get_buffer("pend").tobytes() == bytes([7]) * 64


def test_put_with_writable_gives_a_private_writable_view(daemon, client):
    n = N.Client(daemon.socket)
    kept = n.put_with("w", np.zeros(16, np.uint8),
                      N.PutOptions(keep_reference=True, writable=True))
    arr = np.asarray(kept)
    assert arr.flags.writeable
    arr[0] = 5
    # A small object lives in the store's segment: the write stays in this process.
    assert client.get_buffer("w")[0] == 0


def test_put_with_refuses_a_device(daemon, client):
    n = N.Client(daemon.socket)
    with pytest.raises(vovp.GpuError) as e:
        n.put_with("dev", np.zeros(8, np.uint8), N.PutOptions(device=0))
    assert "host bytes" in str(e.value)
    assert not client.contains("dev")


def test_put_with_a_tensor_as_it_is_or_nothing(daemon, client):
    n = N.Client(daemon.socket)
    src = np.arange(6, dtype=np.float32).reshape(2, 3)
    kept = n.put_with("t", src, N.PutOptions(keep_reference=True), framework=1)
    arr = np.asarray(kept)
    assert arr.dtype == np.float32 and arr.shape == (2, 3) and np.array_equal(arr, src)
    assert client.get_tensor("t").shape == (2, 3)
    # An array that is not stored as it is (big-endian) is left to the caller: nothing sent.
    assert n.put_with("be", src.astype(">f4"), N.PutOptions(keep_reference=True),
                      framework=1) is None
    assert not client.contains("be")


def test_put_batch_gives_each_item_its_result_or_its_error(daemon, client):
    n = N.Client(daemon.socket, release_delay=0.05)
    put_bytes(n, "taken", b"x")
    items = [
        ("b0", np.arange(4, dtype=np.uint8), b"m0", None, False),
        ("taken", np.arange(4, dtype=np.uint8), b"", None, False),
        ("b2", np.arange(6, dtype=np.int16), b"", ("i", 2, (2, 3)), True),
    ]
    got = n.put_batch(items, N.PutOptions(keep_reference=True))
    assert isinstance(got[1], vovp.ObjectExists)
    assert np.asarray(got[0]).tobytes() == bytes(range(4)) and got[0].metadata == b"m0"
    shaped = np.asarray(got[2])
    assert shaped.shape == (2, 3) and shaped.flags.writeable  # (the item asked writable)
    assert not np.asarray(got[0]).flags.writeable
    assert refcount(client, "b0") == 1 and refcount(client, "b2") == 1
    # Not kept: ids (waited for), or nothing (pipelined; a name the shared directory shows
    # taken is refused at once, before anything is sent).
    ids = n.put_batch([("c0", np.zeros(2, np.uint8), b"", None, False)], N.PutOptions())
    assert isinstance(ids[0], int) and refcount(client, "c0") == 0
    later = n.put_batch([("c1", np.zeros(2, np.uint8), b"", None, False),
                         ("taken", np.zeros(2, np.uint8), b"", None, False)],
                        N.PutOptions(pipelined=True))
    assert later[0] is None and isinstance(later[1], vovp.ObjectExists)
    n.sync()
    assert client.contains("c1") and refcount(client, "c1") == 0

