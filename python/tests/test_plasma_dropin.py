"""vovp.plasma (Plasma's API over the daemon), against real daemons and other processes.

Plasma's own test file runs against vovp.plasma in scripts/plasma-conformance.sh (with
pyarrow); these tests cover what it does not: cross-process use, the vovp side of the mapping,
the buffers without pyarrow, bad input, and the daemon's Plasma flags.
"""

from __future__ import annotations

import gc
import os
import pickle
import socket
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

import vovp
import vovp.plasma as plasma

from conftest import ENGINE


@pytest.fixture
def store(daemon):
    return daemon.socket


@pytest.fixture
def pc(store):
    c = plasma.connect(store)
    yield c
    c.disconnect()


def run_child(code, env, *args, timeout=60):
    """Run ``code`` in a fresh Python; returns its stdout (fails the test on a non-zero exit)."""
    p = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr
    return p.stdout


# --- ObjectID ----------------------------------------------------------------------------------


def test_object_id_is_20_bytes_hashable_picklable_and_named_like_the_engine():
    with pytest.raises(ValueError):
        plasma.ObjectID(b"short")
    with pytest.raises(ValueError):
        plasma.ObjectID("x" * 20)  # str, not bytes
    a, b = plasma.ObjectID(b"\x01" * 20), plasma.ObjectID(b"\x01" * 20)
    assert a == b and hash(a) == hash(b) and a != plasma.ObjectID(b"\x02" * 20)
    assert a != b"\x01" * 20
    assert pickle.loads(pickle.dumps(a)) == a
    assert a.binary() == b"\x01" * 20
    # The vovp name of an ObjectID: "plasma:" and its 40 lowercase hex digits.
    assert a.name == "plasma:" + "01" * 20
    assert plasma.ObjectID.from_random() != plasma.ObjectID.from_random()


# --- across processes ------------------------------------------------------------------------------

CHILD_GET = """
import pickle, sys
import vovp.plasma as plasma
from vovp.client import find_lease
c = plasma.connect(sys.argv[1])
oid = pickle.loads(bytes.fromhex(sys.argv[2]))
arr = c.get(oid, timeout_ms=10000)
print(float(arr.sum()), arr.dtype, arr.shape, arr.flags.writeable,
      find_lease(arr) is not None)
"""


def test_put_in_one_process_get_zero_copy_in_another(pc, store, subprocess_env):
    a = np.arange(300_000, dtype=np.float64).reshape(1000, 300)
    oid = pc.put(a)
    out = run_child(CHILD_GET, subprocess_env, store, pickle.dumps(oid).hex()).split()
    assert out == [str(float(a.sum())), "float64", "(1000,", "300)", "False", "True"]
    # Here too: the array is the store's memory (read-only), not a copy.
    got = pc.get(oid)
    assert not got.flags.writeable and np.array_equal(got, a)
    assert vovp.client.find_lease(got) is not None


CHILD_WAIT_SEVERAL = """
import pickle, sys, time
import vovp.plasma as plasma
c = plasma.connect(sys.argv[1])
ids = pickle.loads(bytes.fromhex(sys.argv[2]))
print("ready", flush=True)
t = time.monotonic()
bufs = c.get_buffers(ids, timeout_ms=int(sys.argv[3]))
print(round(time.monotonic() - t, 2), [None if b is None else b.to_pybytes().decode() for b in bufs])
"""


def test_get_buffers_waits_for_every_object_or_the_timeout(pc, store, subprocess_env):
    ids = [plasma.ObjectID.from_random() for _ in range(3)]
    child = subprocess.Popen([sys.executable, "-c", CHILD_WAIT_SEVERAL, store,
                              pickle.dumps(ids).hex(), "20000"], env=subprocess_env,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "ready\n"
    for i, oid in enumerate(ids):
        time.sleep(0.2)
        pc.create_and_seal(oid, f"v{i}".encode())
    out, _ = child.communicate(timeout=30)
    waited, values = out.split(" ", 1)
    assert values.strip() == "['v0', 'v1', 'v2']"
    assert 0.5 < float(waited) < 10  # returned once the last one was sealed
    # Timeout with one missing: partial results after the timeout.
    missing = plasma.ObjectID.from_random()
    out = run_child(CHILD_WAIT_SEVERAL, subprocess_env, store,
                    pickle.dumps([ids[0], missing]).hex(), "300")
    waited, values = out.split("\n", 1)[1].split(" ", 1)
    assert values.strip() == "['v0', None]" and float(waited) >= 0.25


def test_notification_socket_reports_seals_by_others_and_evictions(pc, store, subprocess_env):
    pc.subscribe()
    sock = pc.get_notification_socket()
    assert pc.get_notification_socket() is sock
    oid = plasma.ObjectID.from_random()
    run_child("import sys, pickle, vovp.plasma as p; c = p.connect(sys.argv[1]); "
              "c.create_and_seal(pickle.loads(bytes.fromhex(sys.argv[2])), b'x' * 10, b'm' * 3)",
              subprocess_env, store, pickle.dumps(oid).hex())
    sock.settimeout(10)
    (n,) = struct.unpack("L", sock.recv(8))
    ids, dsizes, msizes = pc.decode_notifications(sock.recv(n))
    assert (ids, dsizes, msizes) == ([oid], [10], [3])
    assert pc.evict(1) == 13
    assert pc.get_next_notification() == (oid, -1, -1)
    # Native vovp objects are not Plasma objects: no notification for them.
    vovp.Client(store).put("native", b"abc")
    other = plasma.ObjectID.from_random()
    pc.create_and_seal(other, b"y")
    assert pc.get_next_notification() == (other, 1, 0)


# --- Plasma's reference counting ---------------------------------------------------------------------


def test_dropping_the_create_buffer_before_seal_does_not_abort(pc, store):
    oid = plasma.ObjectID.from_random()
    buf = pc.create(oid, 4, b"meta")
    np.frombuffer(buf, np.uint8)[:] = [1, 2, 3, 4]
    del buf
    gc.collect()
    assert pc.list()[oid]["state"] == "created"
    pc.seal(oid)
    other = plasma.connect(store)
    [(meta, data)] = other.get_buffers([oid], timeout_ms=0, with_meta=True)
    assert meta == b"meta" and data.to_pybytes() == b"\x01\x02\x03\x04"
    assert other.list()[oid]["ref_count"] == 1  # `data` holds other's one reference
    del data
    assert other.list()[oid]["ref_count"] == 0  # released with other's next request


def test_buffers_keep_their_object_alive_after_delete_and_views_keep_buffers(pc, store):
    oid = pc.put_raw_buffer(b"hello world")
    [buf] = pc.get_buffers([oid])
    view = memoryview(buf)[6:]  # a view of the buffer keeps it (and the object) alive
    arr = np.frombuffer(buf, np.uint8)[:5]
    del buf
    pc.delete([oid])
    assert not vovp.Client(store).contains(oid.name)  # the id is gone from the store at once
    # ... but the memory stays valid and unchanged while views of it exist
    pc.put_raw_buffer(b"X" * 11, object_id=plasma.ObjectID.from_random())
    assert bytes(view) == b"world" and arr.tobytes() == b"hello"
    del view, arr
    gc.collect()
    pc.contains(oid)  # (carries the release, deferred until pc's next request)
    assert vovp.Client(store).stats()["references"] == 0


def test_a_buffer_outlives_its_client(store):
    c = plasma.connect(store)
    oid = c.put(np.ones(1000))
    arr = c.get(oid)
    del c
    gc.collect()
    assert arr.sum() == 1000.0
    assert vovp.Client(store).list()[0]["refcount"] == 1
    del arr
    gc.collect()
    from _helpers import wait_for

    # No client left to send it with a request: the release goes within 2 ms.
    assert wait_for(lambda: vovp.Client(store).list()[0]["refcount"] == 0, timeout=5)


def test_a_get_in_a_forked_child_is_a_plasma_error(pc):
    """A client used in a forked child refuses (it would talk on its parent's socket) with the
    drop-in's own error type, an ArrowException, on the single-get path as on the others."""
    oid = pc.put(np.arange(10))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what the get raised, then leave without cleanup
        try:
            pc.get_buffers([oid], timeout_ms=0)
            verdict = b"no error"
        except plasma.ArrowException as err:
            verdict = type(err).__name__.encode()
        except BaseException as err:  # noqa: BLE001
            verdict = b"wrong type: " + type(err).__name__.encode()
        os.write(w, verdict)
        os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    verdict = os.read(r, 200).decode()
    os.close(r)
    assert status == 0 and verdict == "PlasmaConnectionError", verdict
    # The parent's client is untouched.
    assert np.array_equal(pc.get(oid), np.arange(10))


def test_dying_client_releases_everything(store, subprocess_env):
    code = ("import sys, os, vovp.plasma as p; c = p.connect(sys.argv[1]); "
            "oid = p.ObjectID(b'k' * 20); c.create_and_seal(oid, b'x' * 100); "
            "b = c.get_buffers([oid]); c.create(p.ObjectID(b'u' * 20), 10); "
            "print('held', flush=True); os._exit(0)")
    assert run_child(code, subprocess_env, store).strip() == "held"
    c = plasma.connect(store)
    assert vovp.client.Client(store).stats()["references"] == 0
    listed = c.list()
    assert listed[plasma.ObjectID(b"k" * 20)]["ref_count"] == 0
    assert plasma.ObjectID(b"u" * 20) not in listed  # the unsealed one was aborted


# --- errors ----------------------------------------------------------------------------------------


def test_misuse_gets_plasma_errors_and_the_store_keeps_serving(pc, store):
    oid = plasma.ObjectID.from_random()
    buf = pc.create(oid, 10)
    with pytest.raises(plasma.PlasmaObjectExists) as e:
        pc.create(oid, 10)
    assert isinstance(e.value, plasma.ArrowException) and isinstance(e.value, vovp.ObjectExists)
    with pytest.raises(plasma.PlasmaObjectExists):
        plasma.connect(store).create(oid, 10)  # another client: the daemon says so
    with pytest.raises(plasma.ArrowInvalid):
        pc.abort(oid)  # the buffer is still alive (Plasma: "cannot have a reference")
    with pytest.raises(plasma.ArrowInvalid):
        pc.get_buffers([oid], timeout_ms=-1)  # would wait for ourselves forever
    assert pc.get_buffers([oid], timeout_ms=0) == [None]
    del buf
    pc.abort(oid)
    assert oid not in pc.list()
    with pytest.raises(plasma.PlasmaObjectNotFound):
        pc.seal(oid)
    with pytest.raises(plasma.PlasmaObjectNotFound):
        pc.abort(oid)
    pc.create(oid, 1)
    pc.seal(oid)
    with pytest.raises(plasma.PlasmaObjectNotFound):
        pc.seal(oid)  # sealed and no longer referenced by this client
    keep = pc.get_buffers([oid])
    with pytest.raises(plasma.PlasmaObjectAlreadySealed):
        pc.seal(oid)  # sealed and still referenced
    with pytest.raises(plasma.PlasmaObjectNotFound):
        pc.hash(plasma.ObjectID.from_random())
    with pytest.raises(TypeError):
        pc.create(12345, 10)
    with pytest.raises(ValueError):
        pc.create(plasma.ObjectID.from_random(), -1)
    with pytest.raises(NotImplementedError):
        pc.put(1, serialization_context=object())
    with pytest.raises(plasma.ArrowInvalid):
        pc.get(pc.put_raw_buffer(b"raw"))  # not written by put()
    pc.delete([plasma.ObjectID.from_random()])  # unknown ids are ignored, as in Plasma
    assert pc.contains(oid) and keep[0].to_pybytes() == b"\x00"


def test_store_full_and_connection_errors(start_daemon):
    d = start_daemon(memory=1 << 20)
    c = plasma.connect(d.socket)
    held = c.create(plasma.ObjectID.from_random(), 700_000)
    with pytest.raises(plasma.PlasmaStoreFull) as e:
        c.create(plasma.ObjectID.from_random(), 400_000)
    assert isinstance(e.value, MemoryError) and e.value.requested >= 400_000
    del held
    t = time.monotonic()
    with pytest.raises(IOError):
        plasma.connect(d.socket + ".missing", num_retries=1)
    assert time.monotonic() - t < 1
    c.disconnect()
    with pytest.raises(plasma.PlasmaConnectionError):
        c.contains(plasma.ObjectID.from_random())


# --- layout, sizes, eviction ----------------------------------------------------------------------


def test_metadata_may_exceed_vovp_metadata_limit_and_counts_as_memory(pc, store):
    oid = plasma.ObjectID.from_random()
    meta = bytes(range(256)) * 1024  # 256 KiB: over vovp's 64 KiB metadata limit
    buf = pc.create(oid, 1000, meta)
    assert len(buf) == 1000 and buf.is_mutable
    del buf
    pc.seal(oid)
    [m] = pc.get_metadata([oid])
    assert m.to_pybytes() == meta and not m.is_mutable
    info = pc.list()[oid]
    assert (info["data_size"], info["metadata_size"]) == (1000, len(meta))
    # The vovp object is data || metadata, under the engine's Plasma name.
    mv, header = vovp.Client(store).get_buffer(oid.name, with_metadata=True)
    assert mv.nbytes == 1000 + len(meta) and bytes(mv[1000:]) == meta and header[:4] == b"VPLS"


CHILD_CREATE = """
import sys
import vovp.plasma as plasma
c = plasma.connect(sys.argv[1])
oid = plasma.ObjectID(bytes.fromhex(sys.argv[2]))
c.create_and_seal(oid, b"z" * 1000)
"""


def test_objects_without_metadata_are_plain_vovp_objects_and_may_fill_the_store(
        start_daemon, subprocess_env):
    d = start_daemon(memory=1 << 20)
    pc = plasma.connect(d.socket)
    for _ in range(8):  # unreferenced: evicted to make room
        pc.create_and_seal(plasma.ObjectID.from_random(), b"x" * 100_000)
    t0 = time.time()
    oid = plasma.ObjectID.from_random()
    buf = pc.create(oid, 1 << 20)  # the store's whole memory, as in Plasma
    np.frombuffer(buf, np.uint8)[-1] = 7
    del buf
    pc.seal(oid)
    info = pc.list()[oid]
    assert (info["data_size"], info["metadata_size"], info["state"]) == (1 << 20, 0, "sealed")
    assert t0 - 1 <= info["create_time"] <= time.time() + 1
    # No header: to a native client it is what it is, 1 MiB of data and no metadata.
    native = vovp.Client(d.socket)
    mv, meta = native.get_buffer(oid.name, with_metadata=True)
    assert (mv.nbytes, meta, mv[-1]) == (1 << 20, b"", 7)
    with pytest.raises(plasma.PlasmaStoreFull):  # held by `mv`: nothing can be evicted
        pc.create(plasma.ObjectID.from_random(), 1)
    del mv
    native.flush()  # (the native client sends releases with its next request otherwise)
    # The flushed release is one-way: a round trip on the same connection orders it before
    # the next create, which arrives on another connection (it failed now and then without).
    assert native.contains(oid.name)
    # put() objects keep the header (the pickled flag), so do objects with metadata.
    small = pc.put(1)
    assert native.get_buffer(small.name, with_metadata=True)[1][:4] == b"VPLS"
    # Made in another process: the same sizes through list() and gets here.
    other = plasma.ObjectID.from_random()
    run_child(CHILD_CREATE, subprocess_env, d.socket, other.binary().hex())
    assert (pc.list()[other]["data_size"], pc.list()[other]["metadata_size"]) == (1000, 0)
    [(meta, data)] = pc.get_buffers([other], with_meta=True)
    assert meta == b"" and data.to_pybytes() == b"z" * 1000
    pc.disconnect()
    native.close()


def test_evict_counts_data_plus_metadata_in_lru_order(pc):
    ids = [plasma.ObjectID.from_random() for _ in range(3)]
    for i, oid in enumerate(ids):
        pc.create_and_seal(oid, b"d" * (100 + i), b"m" * i)
    [keep] = pc.get_buffers([ids[0]])  # referenced: not evictable
    assert pc.evict(150) == 101 + 1 + 102 + 2  # two objects: 102 < 150
    assert pc.contains(ids[0]) and not pc.contains(ids[1]) and not pc.contains(ids[2])
    assert pc.evict(1) == 0
    del keep
    assert pc.evict(1) == 100


def test_hash_depends_on_data_and_metadata(pc):
    a, b, c, d = (plasma.ObjectID.from_random() for _ in range(4))
    pc.create_and_seal(a, b"ab", b"c")
    pc.create_and_seal(b, b"ab", b"c")
    pc.create_and_seal(c, b"a", b"bc")  # same bytes, split differently
    pc.create_and_seal(d, b"ab", b"d")
    assert pc.hash(a) == pc.hash(b) and len(pc.hash(a)) == 8
    assert len({pc.hash(a), pc.hash(c), pc.hash(d)}) == 3


def test_put_get_python_objects_and_arrays_stay_zero_copy(pc):
    value = {"x": np.arange(10, dtype=np.int32), "s": "text", "n": None, "b": bytearray(b"12")}
    oid = pc.put(value)
    got = pc.get(oid)
    assert got["s"] == "text" and got["n"] is None and got["b"] == bytearray(b"12")
    assert np.array_equal(got["x"], value["x"]) and not got["x"].flags.writeable
    assert got["x"].ctypes.data % 64 == 0  # out-of-band buffers are 64-byte aligned
    assert pc.get([oid, plasma.ObjectID.from_random()], timeout_ms=0)[1] is \
        plasma.ObjectNotAvailable
    with pytest.raises(plasma.PlasmaObjectExists):
        pc.put(1, object_id=oid)


def test_large_objects_go_through_the_mapping(pc, store):
    a = np.random.default_rng(1).integers(0, 255, 8 << 20, dtype=np.uint8)
    oid = pc.put_raw_buffer(a, metadata=b"big")
    # The creator's reference is gone when put returns (evictable for others at once).
    [e] = [e for e in vovp.Client(store).list() if e["name"] == oid.name]
    assert e["refcount"] == 0 and e["size"] == (8 << 20) + 3
    [(meta, buf)] = pc.get_buffers([oid], with_meta=True)
    assert meta == b"big" and np.array_equal(np.frombuffer(buf, np.uint8), a)
    got = pc.get(pc.put(a))
    assert np.array_equal(got, a)


def test_str_names_work_like_ids_and_native_clients_see_them(pc, store):
    pc.create_and_seal("weights", b"\x01\x02", b"hdr")
    assert pc.contains("weights") and pc.list()["weights"]["metadata_size"] == 3
    assert bytes(vovp.Client(store).get_buffer("weights")) == b"\x01\x02hdr"
    # A native vovp object read through the Plasma API: all data, its vovp metadata as metadata.
    vovp.Client(store).put_tensor("t", np.arange(4, dtype=np.uint8))
    [(meta, data)] = pc.get_buffers(["t"], with_meta=True)
    assert data.to_pybytes() == b"\x00\x01\x02\x03" and meta[:4] == b"VTNS"
    assert "t" not in pc.list()  # not a Plasma object


def test_buffers_without_pyarrow_are_plasma_buffers(pc):
    if plasma.pa is not None:
        pytest.skip("pyarrow is importable here: buffers are pyarrow.Buffer "
                    "(scripts/plasma-conformance.sh covers that path)")
    oid = plasma.ObjectID.from_random()
    buf = pc.create(oid, 3)
    assert isinstance(buf, plasma.PlasmaBuffer) and buf.is_mutable
    buf[:] = [7, 8, 9]
    with pytest.raises(IndexError):
        buf[3]
    pc.seal(oid)
    [got] = pc.get_buffers([oid])
    assert got.to_pybytes() == b"\x07\x08\x09" and not got.is_mutable
    with pytest.raises(ValueError):
        got[0] = 1


# --- starting a store ----------------------------------------------------------------------------


def test_start_plasma_store_runs_vovp_engine(monkeypatch):
    monkeypatch.setenv("VOVP_ENGINE_BIN", str(ENGINE))
    with plasma.start_plasma_store(plasma_store_memory=10_000_000) as (name, proc):
        assert proc.poll() is None
        c = plasma.connect(name)
        assert c.store_capacity() == 10_000_000
        oid = c.put("x")
        assert c.get(oid) == "x"
    assert proc.poll() is not None and not os.path.exists(name)


def test_external_store_is_spilling_and_every_object_comes_back(monkeypatch):
    """Plasma's -e: a 1000 KiB store, 20 objects of 100 KiB put, every one got back (pyarrow
    11's TestEvictionToExternalStore::test_eviction), the spill directory gone with the store."""
    monkeypatch.setenv("VOVP_ENGINE_BIN", str(ENGINE))
    with plasma.start_plasma_store(1000 * 1024, external_store="hashtable://test") as (name, proc):
        c = plasma.connect(name)
        spill_dir = proc.args[proc.args.index("--spill-dir") + 1]
        assert os.path.isdir(spill_dir)
        ids = [plasma.ObjectID.from_random() for _ in range(20)]
        data = [bytes([i]) * (100 * 1024) for i in range(20)]
        for oid, d in zip(ids, data):
            assert not c.contains(oid)
            c.create_and_seal(oid, d, b"")
            assert c.contains(oid)
        for oid, d in zip(ids, data):
            [result] = c.get_buffers([oid])
            assert result.to_pybytes() == d
            del result
        [missing] = c.get_buffers([plasma.ObjectID.from_random()], timeout_ms=100)
        assert missing is None
        c.disconnect()
    assert not os.path.exists(spill_dir)


def test_daemon_takes_plasma_store_server_flags(tmp_path):
    """The seed's `plasma-store-server -m 1000000000 -s /tmp/dgl_socket` with the binary name
    changed (plus Plasma's -d)."""
    sock = f"/tmp/vovp-dgl-{os.getpid()}.sock"
    proc = subprocess.Popen([str(ENGINE), "-m", "1000000000", "-s", sock, "-d", "/dev/shm"],
                            stderr=subprocess.PIPE, text=True)
    try:
        c = plasma.connect(sock)
        assert c.store_capacity() == 1_000_000_000
        c.disconnect()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0
    assert "-d /dev/shm: accepted for Plasma compatibility" in err
    bad = subprocess.run([str(ENGINE), "-m", "1000000", "-s", sock, "-d", str(tmp_path / "no")],
                         capture_output=True, text=True, timeout=10)
    assert bad.returncode == 2 and "not a directory" in bad.stderr
    bad = subprocess.run([str(ENGINE), "-m", "1000000", "-s", sock, "-e", "hashtable://x"],
                         capture_output=True, text=True, timeout=10)
    assert bad.returncode == 2


def test_socket_is_a_real_socket(pc):
    pc.subscribe()
    assert isinstance(pc.get_notification_socket(), socket.socket)


def test_deferred_release_reaches_the_store_soon_or_with_the_next_request(store):
    from _helpers import wait_for

    c = plasma.connect(store)  # deferred, as vovp's own client
    oid = c.put_raw_buffer(b"abc")
    watcher = vovp.Client(store)
    [buf] = c.get_buffers([oid])
    assert watcher.stats()["references"] == 1
    del buf  # queued, not sent yet ...
    assert wait_for(lambda: watcher.stats()["references"] == 0, timeout=5)  # ... within 2 ms
    [buf] = c.get_buffers([oid])
    del buf
    assert c.list()[oid]["ref_count"] == 0  # this client's next request carries it
    # Plasma's timing: the store learns of it at once.
    now = plasma.connect(store, deferred_release=False)
    [buf] = now.get_buffers([oid])
    assert watcher.stats()["references"] == 1
    del buf
    assert watcher.stats()["references"] == 0


def test_gets_of_an_object_in_use_share_one_reference(pc, store):
    watcher = vovp.Client(store)
    oid = pc.put_raw_buffer(b"abcd", metadata=b"m")
    [a] = pc.get_buffers([oid])
    [(meta, b)] = pc.get_buffers([oid], with_meta=True)
    [m] = pc.get_metadata([oid])
    assert meta == b"m" and a.to_pybytes() == b.to_pybytes() == b"abcd"
    assert pc.list()[oid]["ref_count"] == 1  # one reference for all three, as in Plasma
    view = np.frombuffer(b, np.uint8)[1:]  # keeps b's object alive after b itself goes
    del a, b, m
    assert pc.list()[oid]["ref_count"] == 1 and bytes(view) == b"bcd"
    del view
    pc.contains(oid)  # any request carries the deferred release
    assert watcher.stats()["references"] == 0
    # A get of an object this client created (and still writes) is read-only.
    mine = plasma.ObjectID.from_random()
    w = pc.create(mine, 3)
    np.frombuffer(w, np.uint8)[:] = 7
    pc.seal(mine)
    [r] = pc.get_buffers([mine])
    assert not r.is_mutable and r.to_pybytes() == b"\x07" * 3
    with pytest.raises(ValueError):
        np.frombuffer(r, np.uint8)[0] = 1
    assert pc.list()[mine]["ref_count"] == 1
    del w, r
    pc.contains(mine)
    assert watcher.stats()["references"] == 0
    watcher.close()


def test_views_of_get_buffers_are_found_by_address_and_released_by_vovp(pc, store):
    # vovp's own calls take a drop-in buffer's views (init_reduction sends such arrays by name,
    # vovp.Client.release gives their reference back): the drop-in's gets make no lease, so
    # the object is found by address. With pyarrow the anchor is the native object itself.
    watcher = vovp.Client(store)
    oid = pc.put_raw_buffer(b"abcdefgh", metadata=b"meta")
    [buf] = pc.get_buffers([oid])
    view = np.frombuffer(buf, np.uint8)[2:]
    lease = vovp.client.find_lease(view)
    assert lease is not None and lease.name == oid.name and lease.size == 8 + len(b"meta")
    assert vovp.client.find_lease(view) is lease  # made once, then indexed
    assert watcher.stats()["references"] == 1
    assert pc._vovp.release(view) is True
    assert pc._vovp.release(view) is False  # one reference, released once
    pc._vovp.flush()
    assert watcher.stats()["references"] == 0
    # The released anchor no longer serves gets (its bytes are not this client's any more):
    # the next get asks the store for a reference of its own.
    [again] = pc.get_buffers([oid])
    assert again.to_pybytes() == b"abcdefgh" and watcher.stats()["references"] == 1
    assert pc.list()[oid]["ref_count"] == 1
    del again
    pc._vovp.flush()
    assert watcher.stats()["references"] == 0
    # The same through a batched get (its anchors are arrays over vovp.Client's owners).
    other = pc.put_raw_buffer(b"xyz")
    [b1, b2] = pc.get_buffers([oid, other])
    assert watcher.stats()["references"] == 2
    assert pc._vovp.release(np.frombuffer(b1, np.uint8)) is True
    pc._vovp.flush()
    assert watcher.stats()["references"] == 1
    [b3] = pc.get_buffers([oid])
    assert b3.to_pybytes() == b"abcdefgh" and watcher.stats()["references"] == 2
    del b1, b2, b3
    pc._vovp.flush()
    assert watcher.stats()["references"] == 0
    assert vovp.client.find_lease(np.arange(3)) is None  # not store memory
    watcher.close()


def test_entries_of_objects_no_longer_used_do_not_pile_up(pc):
    ids = [plasma.ObjectID.from_random() for _ in range(2500)]
    for oid in ids:
        pc.create_and_seal(oid, b"x")
    kept = []
    for i, oid in enumerate(ids):
        [buf] = pc.get_buffers([oid])
        if i % 500 == 0:
            kept.append((oid, buf))
    # Dead entries are swept when the table doubles: bounded by twice the live ones (>= 1024).
    assert len(pc._in_use) < 2 * 1024
    for oid, buf in kept:  # the live ones survived every sweep
        assert pc._in_use[oid.name]() is not None and buf.to_pybytes() == b"x"
