"""Client against the real daemon: round trips, sharing, lifetimes, errors."""

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
import _wire as P
from vovp import tensor as T
from _helpers import RawConnection, wait_for

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "complex64", "complex128"]
SHAPES = [(), (0,), (7,), (2, 3), (0, 3), (3, 0, 2), (2, 3, 4)]


def sample(dtype, shape):
    n = int(np.prod(shape, dtype=np.int64))
    dt = np.dtype(dtype)
    if dt.kind == "b":
        a = np.arange(n) % 3 == 0
    elif dt.kind == "c":
        a = np.arange(n) + 1j * np.arange(n)[::-1]
    elif dt.kind == "f":
        a = np.arange(n) / 4 - 1
    elif dt.kind == "u":
        a = np.arange(n) * 37 % 251
    else:
        a = np.arange(n) * 37 % 251 - 120
    return a.astype(dt).reshape(shape)


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_every_dtype_and_shape(client, daemon, dtype):
    other = daemon.client()
    for i, shape in enumerate(SHAPES):
        a = sample(dtype, shape)
        name = f"{dtype}-{i}"
        r = client.put_tensor(name, a)
        assert r.dtype == a.dtype and r.shape == a.shape
        np.testing.assert_array_equal(r, a)
        assert not r.flags.writeable
        g = other.get_tensor(name)
        assert g.dtype == a.dtype and g.shape == shape
        np.testing.assert_array_equal(g, a)
        assert not g.flags.writeable
        # Same bytes of the same object: the two clients see one allocation.
        meta = {e["name"]: e for e in other.list()}[name]
        assert meta["dtype"] == dtype and meta["shape"] == shape
        assert meta["size"] == a.nbytes
    other.close()


def test_issue_example(client, daemon):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    ret_a = client.put_tensor("test111", a)
    np.testing.assert_array_equal(ret_a, a)
    ret_a2 = vovp.init_client(daemon.socket).get_tensor("test111")
    np.testing.assert_array_equal(ret_a2, a)


def test_put_returns_store_memory(client):
    a = np.arange(10, dtype=np.int64)
    r = client.put_tensor("x", a)
    # The result is a view of the mapping, not of the input.
    assert not np.shares_memory(r, a)
    from vovp.client import find_lease
    lease = find_lease(r)
    assert lease is not None and lease.name == "x" and lease.size == a.nbytes
    assert r.__array_interface__["data"][0] == \
        lease.start
    assert lease.start % 64 == 0  # segments are page-aligned: the offset is 64-aligned


@pytest.mark.parametrize("nbytes", [1 << 20, (1 << 20) + 8, 24 << 20])
def test_large_put_goes_through_create(client, nbytes):
    a = np.random.default_rng(1).integers(0, 1 << 62, nbytes // 8, dtype=np.int64)
    before = client.stats()["creates"]
    r = client.put_tensor("big", a)
    np.testing.assert_array_equal(r, a)
    g = client.get_tensor("big")
    np.testing.assert_array_equal(g, a)
    assert client.stats()["creates"] == before + 1


def test_non_contiguous_input(client):
    base = np.arange(4 * 300 * 500, dtype=np.float32).reshape(4, 300, 500)
    for name, a in [("t", base.transpose(2, 0, 1)), ("s", base[:, ::3, 1::2]),
                    ("small", base[0, :5, ::7].T)]:
        r = client.put_tensor(name, a)
        assert r.flags.c_contiguous
        np.testing.assert_array_equal(r, a)
        np.testing.assert_array_equal(client.get_tensor(name), a)


@pytest.mark.parametrize("n", [10, 600_000])
def test_big_endian_input_is_stored_little_endian(client, n):
    a = np.arange(n, dtype=">f8") * 1.5
    r = client.put_tensor("be", a)
    assert r.dtype == np.dtype("<f8")
    np.testing.assert_array_equal(r, a)
    e = {e["name"]: e for e in client.list()}["be"]
    assert T.decode_header(e["metadata"]).byte_order == T.LITTLE


@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3, 4)])
def test_put_tensor_writes_the_header_encode_header_writes(client, shape, monkeypatch):
    """An array the store keeps as it is goes through one native call that reads its dtype
    and shape and writes the tensor header itself (the Python plan is not asked); for every
    dtype that header is byte for byte ``encode_header``'s, the one a big-endian copy
    (converted first, through the plan) gets, and a torch tensor's ends with the torch
    framework byte."""
    import torch

    T.torch_tables()  # (a process's first torch put looks torch up: the Python way, once)
    planned = []
    plan = T.put_plan
    monkeypatch.setattr(T, "put_plan", lambda dt, *a: planned.append(dt) or plan(dt, *a))
    expect = {}
    for code, name in T.DTYPE_NAMES.items():
        if code == T.BFLOAT16:
            continue
        a = (np.arange(int(np.prod(shape))) % 2).astype(name).reshape(shape)
        r = client.put_tensor(f"{name}", a)
        assert (r.dtype, r.shape, r.flags.writeable) == (a.dtype, a.shape, False)
        np.testing.assert_array_equal(r, a)
        expect[name] = T.encode_header(code, shape)
        if getattr(torch, name, None) is not None:
            t = client.put_tensor(f"{name}-torch", torch.from_numpy(a))
            assert isinstance(t, torch.Tensor) and t.shape == a.shape
            np.testing.assert_array_equal(t.numpy(), a)
            expect[f"{name}-torch"] = T.encode_header(code, shape,
                                                      framework=T.FRAMEWORK_TORCH)
        assert planned == [], "an array stored as it is went the Python way"
        if a.dtype.itemsize > 1:
            be = a.astype(a.dtype.newbyteorder(">"))
            r = client.put_tensor(f"{name}-be", be)
            np.testing.assert_array_equal(r, a)
            assert planned == [be.dtype]
            planned.clear()
            expect[f"{name}-be"] = expect[name]
    got = {e["name"]: e["metadata"] for e in client.list()}
    assert {k: got[k] for k in expect} == expect


def test_copy_into_large_arrays_of_every_kind(monkeypatch):
    """The parallel copy behind large puts: byte-for-byte (native), converting the byte order,
    strided, and between overlapping ranges of one array (numpy's copy, never slabs at once)."""
    from vovp import _copy
    from vovp.client import copy_into

    # Two copy threads at least (a one-CPU runner copies with numpy alone), and the native
    # byte copy counted: the first two copies below must take it, the others must not.
    monkeypatch.setattr(_copy, "_WORKERS", 2)
    native = []
    copy_bytes = _copy._native.copy_bytes
    monkeypatch.setattr(_copy, "_native", type("N", (), {"copy_bytes": staticmethod(
        lambda d, s: native.append(d.nbytes) or copy_bytes(d, s))}))
    rng = np.random.default_rng(5)
    src = rng.integers(0, 1 << 62, 3 << 17, dtype=np.int64)  # 3 MiB
    dst = np.zeros_like(src)
    copy_into(dst, src)
    np.testing.assert_array_equal(dst, src)
    assert native == [src.nbytes]
    be = src.astype(">i8")
    dst = np.zeros(src.shape, "<i8")
    copy_into(dst, be)
    np.testing.assert_array_equal(dst, src)
    grid = src.reshape(768, 512)
    dst = np.zeros((512, 768), np.int64)
    copy_into(dst, grid.T)
    np.testing.assert_array_equal(dst, grid.T)
    for shift in (1000, -1000):  # overlapping, forwards and backwards
        buf = np.arange(1 << 20, dtype=np.int64)  # 8 MiB
        expect = np.arange(1 << 20, dtype=np.int64)
        a, b = (slice(shift, None), slice(None, -shift)) if shift > 0 else \
            (slice(None, shift), slice(-shift, None))
        copy_into(buf[a], buf[b])
        expect[a] = expect[b].copy()
        np.testing.assert_array_equal(buf, expect)
    strided = np.arange(1 << 21, dtype=np.int64)
    want = strided.copy()
    copy_into(strided[2::2], strided[:-2:2])
    want[2::2] = want[:-2:2].copy()
    np.testing.assert_array_equal(strided, want)
    # Byte copies: the first, and the two overlapping ones (which numpy then makes).
    assert native == [src.nbytes] + [buf.nbytes - 8000] * 2
    rec = np.zeros(1 << 18, dtype=[("a", "<i8"), ("b", "<f8")])  # 4 MiB of records
    rec["a"] = np.arange(rec.size)
    out = np.zeros_like(rec)
    copy_into(out, rec)  # (structured: numpy's copy)
    assert (out == rec).all() and len(native) == 3
    with pytest.raises(ValueError):  # a read-only destination
        copy_into(np.frombuffer(bytes(src.nbytes), np.int64), src)


def test_big_endian_header_is_honoured(client):
    data = np.arange(5, dtype=">i4")
    client.put("raw-be", data.tobytes(), metadata=T.encode_header(T.INT32, (5,), T.BIG))
    g = client.get_tensor("raw-be")
    assert g.dtype == np.dtype(">i4")
    np.testing.assert_array_equal(g, np.arange(5))


def test_bfloat16_without_torch_is_raw_bits(client):
    bits = np.array([0x3F80, 0x4000, 0xC040], dtype="<u2")  # 1.0, 2.0, -3.0
    client.put("bf", bits.tobytes(), metadata=T.encode_header(T.BFLOAT16, (3,)))
    g = client.get_tensor("bf")
    if T._bfloat16_numpy() is None:
        assert g.dtype == np.dtype("<u2")
        np.testing.assert_array_equal(g, bits)
    else:
        np.testing.assert_array_equal(g.astype(np.float32), [1.0, 2.0, -3.0])


def test_array_likes_and_writable(client):
    r = client.put_tensor("lst", [[1, 2], [3, 4]], writable=True)
    assert r.flags.writeable and r.dtype == np.int64
    g = client.get_tensor("lst", writable=True)
    g[0, 0] = 9  # writable views alias the same memory
    assert r[0, 0] == 9


def test_raw_put_get_buffer(client):
    assert client.put("raw", b"hello world", metadata=b"meta") is None  # sent, not awaited
    assert isinstance(client.put("raw-id", b"x", wait=True), int)
    mv, meta = client.get_buffer("raw", with_metadata=True)
    assert bytes(mv) == b"hello world" and meta == b"meta"
    assert mv.readonly
    # Not a tensor: get_tensor gives the bytes.
    np.testing.assert_array_equal(client.get_tensor("raw"), np.frombuffer(b"hello world",
                                                                           np.uint8))
    big = os.urandom(3 << 20)
    client.put("rawbig", big)
    assert bytes(client.get_buffer("rawbig")) == big
    client.put("empty", b"")
    assert bytes(client.get_buffer("empty")) == b""


def test_put_holds_no_reference(client):
    client.put("p", b"x" * 100)
    assert client.stats()["references"] == 0


def test_create_seal_abort(client, daemon):
    buf = client.create("c", 16, metadata=b"m")
    assert buf.flags.writeable and buf.dtype == np.uint8 and buf.shape == (16,)
    buf[:] = np.arange(16, dtype=np.uint8)
    assert not client.contains("c")
    with pytest.raises(vovp.ObjectNotFound):
        client.get_buffer("c")  # unsealed: invisible to a non-waiting GET
    with pytest.raises(vovp.NotSealed):
        client.delete("c")
    other = daemon.client()
    with pytest.raises(vovp.NotCreator):
        other.seal("c")
    client.seal("c")
    with pytest.raises(vovp.AlreadySealed):
        client.seal("c")
    assert client.contains("c") and "c" in client
    assert bytes(other.get_buffer("c")) == bytes(range(16))

    b2 = client.create("d", 8)
    client.abort("d")
    del b2
    gc.collect()
    assert not client.contains("d")
    st = client.stats()
    assert st["unsealed"] == 0 and st["objects"] == 1
    other.close()


def test_dropping_unsealed_buffer_aborts(client):
    buf = client.create("gone", 64)
    del buf
    gc.collect()
    client.flush()
    assert wait_for(lambda: client.stats()["objects"] == 0)
    client.create("gone", 64)  # the name is free again


def test_create_tensor(client, daemon):
    t = client.create_tensor("ct", (3, 4), np.float64)
    t[...] = np.arange(12).reshape(3, 4)
    client.seal("ct")
    g = daemon.client().get_tensor("ct")
    np.testing.assert_array_equal(g, np.arange(12).reshape(3, 4))


def test_get_waits_for_seal(client, daemon):
    creator = daemon.client()
    buf = creator.create_tensor("later", (4,), np.int32)

    def finish():
        time.sleep(0.3)
        buf[:] = [1, 2, 3, 4]
        creator.seal("later")

    th = threading.Thread(target=finish)
    th.start()
    t0 = time.monotonic()
    g = client.get_tensor("later", timeout=10)
    assert time.monotonic() - t0 >= 0.2
    np.testing.assert_array_equal(g, [1, 2, 3, 4])
    th.join()
    with pytest.raises(vovp.ObjectNotFound):
        client.get_tensor("never", timeout=0.2)
    creator.close()


def test_missing_name(client):
    with pytest.raises(vovp.ObjectNotFound) as ei:
        client.get_tensor("missing")
    assert ei.value.status == 1
    with pytest.raises(KeyError):
        client.get_buffer("missing")
    assert not client.contains("missing")
    with pytest.raises(vovp.ObjectNotFound):
        client.delete("missing")


def test_duplicate_name(client):
    client.put_tensor("dup", np.zeros(3))
    with pytest.raises(vovp.ObjectExists):
        client.put_tensor("dup", np.zeros(3))
    with pytest.raises(vovp.ObjectExists):
        client.create("dup", 10)


def test_invalid_name_client_side(client):
    with pytest.raises(vovp.InvalidName):
        client.put_tensor("n" * 300, np.zeros(1))
    with pytest.raises(vovp.InvalidName):
        client.get_tensor("")
    # The connection is still fine.
    client.put_tensor("ok", np.zeros(1))


def test_invalid_name_daemon_side(daemon):
    """The daemon itself rejects a 300-byte name (bypassing the client's own check)."""
    c = RawConnection(daemon.socket)
    nb = b"n" * 300
    rid = 77
    frame = P.frame(P.CONTAINS, rid, P.enc_str(nb))
    with pytest.raises(vovp.InvalidName) as ei:
        c.roundtrip(frame, P.CONTAINS, rid)
    assert ei.value.status == 7
    frame = P.frame(P.CONTAINS, 78, P.enc_str(b""))
    with pytest.raises(vovp.InvalidName):
        c.roundtrip(frame, P.CONTAINS, 78)
    assert not c.contains("still-usable")
    c.close()


def test_non_utf8_name_daemon_side(daemon):
    c = RawConnection(daemon.socket)
    frame = P.frame(P.CONTAINS, 78, P.enc_str(b"\xff\xfe"))
    try:
        with pytest.raises(vovp.InvalidName):
            c.roundtrip(frame, P.CONTAINS, 78)
    finally:
        assert not c.contains("still-usable")
        c.close()


def test_malformed_and_unknown_opcode_keep_connection(daemon, client):
    raw = RawConnection(daemon.socket)
    frame = P.frame(P.CONTAINS, 5, b"\x05")  # truncated str
    with pytest.raises(vovp.ProtocolError) as ei:
        raw.roundtrip(frame, P.CONTAINS, 5)
    assert ei.value.status == 12
    frame = P.frame(0x3F, 6, b"")
    with pytest.raises(vovp.ProtocolError) as ei:
        raw.roundtrip(frame, 0x3F, 6)
    assert ei.value.status == 14
    frame = P.frame(P.CONTAINS, 7, P.enc_str(b"a") + b"trailing")
    with pytest.raises(vovp.ProtocolError):
        raw.roundtrip(frame, P.CONTAINS, 7)
    assert not raw.contains("a")  # the same connection still works
    raw.close()
    assert client.stats()["objects"] == 0


def test_metadata_too_large(client):
    with pytest.raises(vovp.MetadataTooLarge):
        client.put("m", b"", metadata=b"x" * 70000)


def test_out_of_memory(start_daemon):
    d = start_daemon(memory=4 << 20)
    c = d.client()
    with pytest.raises(vovp.OutOfMemory) as ei:
        c.put_tensor("huge", np.zeros(8 << 20, dtype=np.uint8))
    e = ei.value
    assert e.status == 3 and isinstance(e, MemoryError)
    assert e.requested >= 8 << 20 and e.available <= 4 << 20
    # Referenced objects are not evicted; unreferenced ones are.
    held = c.put_tensor("held", np.ones(3 << 20, dtype=np.uint8))
    with pytest.raises(vovp.OutOfMemory):
        c.put_tensor("second", np.ones(3 << 20, dtype=np.uint8))
    del held
    gc.collect()
    r = c.put_tensor("second", np.ones(3 << 20, dtype=np.uint8))
    assert r.sum() == 3 << 20
    assert not c.contains("held")
    assert c.stats()["evicted_objects"] == 1
    c.close()


def test_release_on_garbage_collection(client):
    a = client.put_tensor("gc", np.arange(100, dtype=np.float64))
    assert client.stats()["references"] == 1
    s = a[10:20]
    t = s.reshape(2, 5).T
    mv = memoryview(a)
    del a, s
    gc.collect()
    assert client.stats()["references"] == 1  # t and mv still alive
    np.testing.assert_array_equal(t.T.ravel(), np.arange(10, 20))
    del t
    gc.collect()
    assert client.stats()["references"] == 1  # mv still alive
    del mv
    gc.collect()
    assert client.stats()["references"] == 0


@pytest.mark.parametrize("release_delay", [0, 0.002])
def test_release_from_other_thread_while_busy(daemon, release_delay):
    """Finalizers on other threads while requests are in flight: nothing leaks or hangs."""
    client = daemon.client(release_delay=release_delay)
    errors = []

    def work(k):
        try:
            for i in range(200):
                a = client.put_tensor(f"w{k}-{i}", np.full(8, i))
                b = client.get_tensor(f"w{k}-{i}")
                assert b[0] == i
                del a, b
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    gc.collect()
    assert wait_for(lambda: client.stats()["references"] == 0)
    assert client.stats()["objects"] == 800
    client.close()


def test_deferred_release_reaches_idle_daemon(client, daemon):
    """With the client idle afterwards, the flusher thread sends the queued release."""
    watcher = daemon.client()
    a = client.put_tensor("idle", np.zeros(4))
    del a
    gc.collect()
    assert wait_for(lambda: watcher.stats()["references"] == 0, timeout=2)
    watcher.close()


def test_deferred_release_sent_after_a_waiting_get(daemon):
    """A view dropped while another thread waits in a GET: the flusher never waits for the
    busy connection (its wake-up would sit on the GET's return), but tries again and sends
    the release once the GET is over, with no further request from this client."""
    c = daemon.client(release_delay=0.002)
    watcher = daemon.client()
    a = c.put_tensor("held-during-wait", np.zeros(4))
    got = []

    def wait_for_late():
        got.append(bytes(c.get_buffer("late", timeout=120)))

    th = threading.Thread(target=wait_for_late)
    th.start()
    # The GET is waiting in the daemon, holding the connection (a count, not a guessed sleep);
    # it cannot end before the test puts "late", however slow the machine.
    assert wait_for(lambda: watcher.stats()["waiting_gets"] == 1, timeout=10)
    del a
    gc.collect()
    time.sleep(0.1)
    assert watcher.stats()["references"] == 1  # queued behind the waiting GET
    watcher.put("late", b"now", wait=True)
    th.join(60)
    assert got == [b"now"]
    assert wait_for(lambda: watcher.stats()["references"] == 0, timeout=10)
    c.close()
    watcher.close()


def test_immediate_release_mode(daemon):
    c = daemon.client(release_delay=0)
    watcher = daemon.client()
    a = c.put_tensor("imm", np.zeros(4))
    del a
    gc.collect()
    assert watcher.stats()["references"] == 0
    c.close()
    watcher.close()


def test_explicit_release(client):
    a = client.put_tensor("r", np.arange(4))
    b = client.get_tensor("r")
    assert client.stats()["references"] == 2
    assert client.release(a[1:]) is True
    assert client.release(a) is False  # double release is harmless
    assert client.stats()["references"] == 1
    oid = {e["name"]: e for e in client.list()}["r"]["id"]
    assert client.release(oid) is True
    assert client.release(oid) is False
    assert client.stats()["references"] == 0
    del a, b
    gc.collect()
    assert client.stats()["references"] == 0
    assert client.release(np.zeros(3)) is False


def test_lease_fields_read_late_are_the_objects_own(client):
    """A lease reads its object's id, version and address from the native view only when first
    asked (vovp._lease): whatever happened in between, they are that object's."""
    import torch

    # A pipelined put's result, asked after a sync; a replace's, asked after the next replace.
    first = client.put_tensor("late", np.arange(4))
    second = client.put_tensor("late", np.arange(4) + 1, replace=True)
    client.sync()
    third = client.put_tensor("late", np.arange(4) + 2, replace=True)
    assert [vovp.version_of(x) for x in (third, second, first)] == [3, 2, 1]
    # A created object: the version sealing gave it, recorded before any field was read.
    buf = client.create("late-created", 8)
    buf[:] = 7
    assert client.seal("late-created") == 1
    assert vovp.version_of(buf) == 1
    # A torch result (found by address) and a view of a numpy one: released once, by either.
    t = client.put_tensor("late-torch", torch.arange(4))
    client.sync()
    refs = client.stats()["references"]
    assert client.release(t) is True and client.release(t) is False
    assert client.stats()["references"] == refs - 1
    assert client.release(first[1:]) is True
    with pytest.raises(vovp.InvalidArgument):
        vovp.version_of(first)  # released: no version any more
    # The object id a late lease reads is the store's: a release by id finds it.
    oid = {e["name"]: e for e in client.list()}["late-created"]["id"]
    refs = client.stats()["references"]
    assert client.release(oid) is True and client.release(oid) is False
    assert client.stats()["references"] == refs - 1
    del first, second, third, buf, t
    gc.collect()
    assert client.stats()["references"] == 0


def test_ephemeral(client, daemon):
    a = client.put_tensor("eph", np.arange(5), ephemeral=True)
    other = daemon.client()
    b = other.get_tensor("eph")
    assert {e["name"]: e for e in client.list()}["eph"]["ephemeral"]
    del a
    gc.collect()
    assert client.contains("eph")  # b still holds it
    del b
    gc.collect()
    other.flush()
    assert wait_for(lambda: client.stats()["objects"] == 0)
    # Nothing left but the putter's small lend (64 KiB of its arena for small put_tensors,
    # never taken back): the object's memory went with it.
    assert client.stats()["used_bytes"] in (0, 64 << 10)
    other.close()


def test_delete_while_held(client):
    a = client.put_tensor("del", np.arange(1000))
    client.delete("del")
    assert not client.contains("del")
    st = client.stats()
    assert st["pending_delete"] == 1
    np.testing.assert_array_equal(a, np.arange(1000))  # memory stays valid while held
    client.put_tensor("del", np.zeros(2))  # the name can be reused at once
    del a
    gc.collect()
    assert wait_for(lambda: client.stats()["pending_delete"] == 0)


def test_list_stats_evict(client):
    client.put_tensor("l1", np.zeros((2, 2), dtype=np.float16))
    client.put("l2", b"abc")
    held = client.put_tensor("l3", np.zeros(10))
    entries = {e["name"]: e for e in client.list()}
    assert set(entries) == {"l1", "l2", "l3"}
    e = entries["l1"]
    assert e["dtype"] == "float16" and e["shape"] == (2, 2) and e["size"] == 8
    assert e["device"] == "cpu" and e["sealed"] and not e["ephemeral"]
    assert e["refcount"] == 0 and abs(e["last_access"] - time.time()) < 3600 * 24 * 365
    assert "dtype" not in entries["l2"]
    assert entries["l3"]["refcount"] == 1
    st = client.stats()
    assert set(st) == set(P.STATS_FIELDS)
    assert st["objects"] == 3 and st["sealed"] == 3 and st["connections"] >= 1
    freed = client.evict(1 << 30)
    assert freed >= 64  # l1 and l2 are unreferenced; l3 is held
    assert client.contains("l3") and not client.contains("l1")
    del held


def test_close_and_context_manager(daemon):
    with vovp.init_client(daemon.socket) as c:
        c.put("a", b"1")
    assert c.closed
    with pytest.raises(vovp.ConnectionError) as ei:
        c.put("b", b"2")
    assert isinstance(ei.value, ConnectionError)
    c.close()  # idempotent


def test_close_releases_references(daemon):
    c = daemon.client()
    a = c.put_tensor("cl", np.zeros(8))
    watcher = daemon.client()
    assert watcher.stats()["references"] == 1
    c.close()
    assert wait_for(lambda: watcher.stats()["references"] == 0)
    del a
    watcher.close()


def test_connect_failure(tmp_path):
    with pytest.raises(vovp.ConnectionError):
        vovp.init_client(str(tmp_path / "no.sock"))


def test_daemon_death_is_connection_error(start_daemon):
    d = start_daemon()
    c = d.client()
    d.proc.kill()
    d.proc.wait()
    with pytest.raises(vovp.ConnectionError):
        c.stats()
    assert c.closed


def test_client_outlives_its_last_reference(daemon):
    """Dropping the client object while an array lives must not release the array's ref."""
    a = vovp.init_client(daemon.socket).put_tensor("orphan", np.arange(3))
    gc.collect()
    watcher = daemon.client()
    assert watcher.stats()["references"] == 1
    np.testing.assert_array_equal(a, [0, 1, 2])
    del a
    gc.collect()
    assert wait_for(lambda: watcher.stats()["references"] == 0)
    assert wait_for(lambda: watcher.stats()["connections"] == 1)
    watcher.close()


def test_subscribe(client, daemon):
    sub = client.subscribe()
    client.put("n1", b"x", metadata=b"m")
    client.delete("n1")
    events = [next(sub), next(sub)]
    assert events[0] == ("sealed", "n1", 1, b"m")
    assert events[1][:2] == ("deleted", "n1")
    sub.close()


# --- cross-process ---------------------------------------------------------------------------

READER = textwrap.dedent("""
    import sys, vovp
    c = vovp.init_client(sys.argv[1])
    x = c.get_tensor("shared", timeout=10)
    print(x.flags.writeable, x[:4].tolist(), flush=True)
    sys.stdin.readline()
    print(x[:4].tolist(), flush=True)
""")


def test_other_process_sees_the_same_memory(client, daemon, subprocess_env):
    """A writes through its creator view after sealing; B's read-only view sees the change:
    both map the same physical pages."""
    x = client.create_tensor("shared", (1024,), np.uint32)
    x[:] = 1
    client.seal("shared")
    p = subprocess.Popen([sys.executable, "-c", READER, daemon.socket], env=subprocess_env,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().split(None, 1) == ["False", "[1, 1, 1, 1]\n"]
        x[:] = 2
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline() == "[2, 2, 2, 2]\n"
    finally:
        p.wait(10)
    assert p.returncode == 0


WRITER = textwrap.dedent("""
    import sys, numpy as np, vovp
    c = vovp.init_client(sys.argv[1])
    c.put_tensor("survivor", np.arange(1 << 20, dtype=np.int32))
    c.put_tensor("small-survivor", np.arange(3, dtype=np.int8))
""")


def test_object_survives_putting_process(client, daemon, subprocess_env):
    subprocess.run([sys.executable, "-c", WRITER, daemon.socket], env=subprocess_env,
                   check=True, timeout=60)
    np.testing.assert_array_equal(client.get_tensor("survivor"), np.arange(1 << 20))
    np.testing.assert_array_equal(client.get_tensor("small-survivor"), [0, 1, 2])


def test_fork_child_reconnects(client, daemon):
    a = client.put_tensor("forked", np.arange(4))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 1
        try:
            try:
                client.stats()
            except vovp.ConnectionError:
                c2 = vovp.default_client(daemon.socket)
                g = c2.get_tensor("forked")
                if g.tolist() == [0, 1, 2, 3] and a.tolist() == [0, 1, 2, 3]:
                    code = 0
            del a
            gc.collect()
            os.write(w, bytes([code]))
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"\x00"
    os.waitpid(pid, 0)
    os.close(r)
    # The child's exit did not disturb the parent's connection or reference.
    assert client.stats()["references"] == 1
    np.testing.assert_array_equal(a, [0, 1, 2, 3])


def test_large_list_reply(client):
    """A LIST reply far larger than the client's 64 KiB receive buffer."""
    for i in range(3000):
        client.put_tensor(f"many-{i:05d}-" + "x" * 40, np.zeros(2, dtype=np.int8)).base
    entries = client.list()
    assert len(entries) == 3000
    assert all(e["shape"] == (2,) for e in entries)
    assert client.stats()["objects"] == 3000


def test_lend_puts_put_with_one_message_and_read_back_elsewhere(daemon, subprocess_env):
    # By default puts of 64 KiB..4 MiB are copied into this client's lend and made objects by
    # one PUBLISH (the first also asks for the lend and maps its arena).
    c = vovp.Client(daemon.socket)
    a = np.arange(1 << 17, dtype=np.float32)  # 512 KiB (a 256 MiB store lends up to 1 MiB)
    b = np.arange(1 << 15, dtype=np.int64)  # 256 KiB
    kept_a = c.put_tensor("a", a)  # (kept: a dropped result's release would be a frame too)
    before = c.core.requests_sent()
    kept = c.put_tensor("b", b)
    assert c.core.requests_sent() == before + 1, "one PUBLISH"
    assert np.array_equal(kept, b)
    child = textwrap.dedent("""
        import sys, numpy as np, vovp
        c = vovp.Client(sys.argv[1])
        a, b = c.get_tensor("a"), c.get_tensor("b")
        assert a.dtype == np.float32 and np.array_equal(a, np.arange(1 << 17, dtype=np.float32))
        assert b.dtype == np.int64 and np.array_equal(b, np.arange(1 << 15, dtype=np.int64))
    """)
    subprocess.run([sys.executable, "-c", child, daemon.socket], env=subprocess_env,
                   check=True, timeout=60)
    assert c.stats()["used_bytes"] == 4 << 20, "both in one lend of 4 MiB"
    # A client that opts out asks for no lend: its 512 KiB put is CREATE + copy + SEAL.
    d = vovp.Client(daemon.socket, lend_puts=False)
    kept_c = d.put_tensor("c", a)
    before = d.core.requests_sent()
    kept_d = d.put_tensor("d", a)
    assert d.core.requests_sent() == before + 2
    del kept_a, kept_c, kept_d
    c.close()
    d.close()


PIPELINED_PUTTER = textwrap.dedent("""
    import sys, vovp
    c = vovp.Client(sys.argv[1])
    for i in range(int(sys.argv[2])):
        c.put(f"pp{i}", bytes([i % 256]) * 64)  # returns before the store answered
        print(i, flush=True)  # the name reaches the parent only after put returned
    # (exits without sync: the daemon still carries out every put it was sent)
""")


def test_pipelined_puts_are_found_by_another_process_told_after_put_returned(
        daemon, subprocess_env):
    # A small put returns once its request is written. The store waits for such puts sent
    # before another client's question before it answers "missing", so a process told the
    # name after put returned finds the object with a non-waiting get.
    c = vovp.Client(daemon.socket)
    n = 300
    child = subprocess.Popen([sys.executable, "-c", PIPELINED_PUTTER, daemon.socket, str(n)],
                             env=subprocess_env, stdout=subprocess.PIPE, text=True)
    for i in range(n):
        assert int(child.stdout.readline()) == i
        if i % 2:
            assert c.contains(f"pp{i}"), f"pp{i} missing after its put returned"
        else:
            assert bytes(c.get_buffer(f"pp{i}"))[:1] == bytes([i % 256])
    assert child.wait(timeout=60) == 0
    c.close()


def test_a_pipelined_put_that_fails_is_raised_by_sync(daemon):
    creator = vovp.Client(daemon.socket)
    buf = creator.create("taken", 16)  # unsealed: not in the shared directory
    c = vovp.Client(daemon.socket)
    c.put("taken", b"mine")  # returns; fails in the store
    c.put("fine", b"ok")
    assert c.contains("fine")  # unrelated calls are not failed for it
    with pytest.raises(vovp.ObjectExists):
        c.sync()
    c.sync()  # reported once
    # A name already published fails at once; wait=True raises like any call.
    with pytest.raises(vovp.ObjectExists):
        c.put("fine", b"again")
    with pytest.raises(vovp.ObjectExists):
        c.put("taken", b"mine", wait=True)
    del buf
    creator.close()
    c.close()


def test_pipelined_puts_can_be_turned_off(daemon):
    c = vovp.Client(daemon.socket, pipelined_puts=False)
    assert c.put("w", b"waited") is None
    assert c.core.unread_replies == 0, "waited for the answer"
    d = vovp.Client(daemon.socket)
    d.put("p", b"x")
    assert d.core.unread_replies == 1
    d.sync()
    assert d.core.unread_replies == 0
    c.close()
    d.close()


def test_a_forked_child_dropping_the_client_leaves_the_parents_replies(daemon):
    # Replies owed to pipelined puts belong to the process that sent them: a forked child
    # that drops its copy of the client must not read them from the shared socket.
    c = vovp.Client(daemon.socket)
    for i in range(5):
        c.put(f"f{i}", b"x" * 64)
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        try:
            del c  # the child's copy of the client goes (its native core is dropped)
            gc.collect()
        finally:
            os._exit(0)
    deadline = time.monotonic() + 20
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the child hung dropping its copy of the client (reading the parent's "
                    "replies)")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    c.sync()  # the parent still reads its own replies, in order
    assert c.contains("f4")
    c.put("after-fork", b"y", wait=True)
    c.close()
