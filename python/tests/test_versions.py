"""Versions of a name (issue "Versions"; PROTOCOL.md, "Versions"): put_tensor(replace=True),
vovp.version_of, get_tensor(newer_than=...), readers keeping what they hold, and a writer
replacing a tensor thousands of times under readers in other processes."""

import multiprocessing as mp
import time

import numpy as np
import pytest

import vovp
from _helpers import wait_for

N = 1 << 17  # uint64 words: 1 MiB


def versioned(v: int) -> np.ndarray:
    """Version ``v``'s tensor: word 0 its number, word 1 the sum of the rest (mod 2**64)."""
    t = np.random.default_rng(v).integers(0, 2**63, N, dtype=np.uint64)
    t[0] = v
    t[1] = np.sum(t[2:], dtype=np.uint64)
    return t


def test_replace_version_of_and_newer_than(daemon):
    w, r = daemon.client(), daemon.client()
    a = w.put_tensor("x", np.arange(10.0))
    assert vovp.version_of(a) == 1
    with pytest.raises(vovp.ObjectExists):
        w.put_tensor("x", np.zeros(3))
    old = r.get_tensor("x")
    assert vovp.version_of(old) == 1
    b = w.put_tensor("x", np.full(1 << 16, 2.0), replace=True)  # a lend put
    c = w.put_tensor("x", np.full(1 << 20, 3.0), replace=True)  # CREATE + SEAL
    assert (vovp.version_of(b), vovp.version_of(c)) == (2, 3)
    now = r.get_tensor("x")
    assert vovp.version_of(now) == 3 and now.shape == (1 << 20,) and now[7] == 3.0
    # The reader's version 1 is untouched, and still held by it.
    assert list(old) == list(np.arange(10.0))
    assert r.get_tensor("x", newer_than=2)[0] == 3.0
    assert vovp.version_of(r.get_buffer("x", newer_than=0)) == 3
    t0 = time.monotonic()
    with pytest.raises(vovp.ObjectNotFound, match="newer than 3"):
        r.get_tensor("x", newer_than=3, timeout=0.2)
    assert time.monotonic() - t0 >= 0.2
    with pytest.raises(vovp.InvalidArgument):
        r.get_tensor("x", newer_than=-1)
    with pytest.raises(vovp.InvalidArgument):
        vovp.version_of(np.zeros(3))
    # create + seal: seal says the version.
    arr = w.create_tensor("x", (4,), np.float32, replace=True)
    arr[:] = 4
    assert w.seal("x") == 4 and vovp.version_of(arr) == 4
    assert {o["name"]: o["version"] for o in r.list()} == {"x": 4}
    del old, a, b, c, now, arr
    wait_for(lambda: r.stats()["pending_delete"] == 0)


def test_torch_replace_and_notifications(daemon):
    torch = pytest.importorskip("torch")
    w, r = daemon.client(), daemon.client()
    sub = r.subscribe()
    w.put_tensor("t", torch.ones(4))
    w.put_tensor("t", torch.full((4,), 2.0), replace=True)
    got = r.get_tensor("t", newer_than=1, timeout=5)
    assert torch.equal(got, torch.full((4,), 2.0)) and vovp.version_of(got) == 2
    kinds = [next(sub)[0] for _ in range(2)]
    assert kinds == ["sealed", "replaced"]
    sub.close()


def _waiter(socket, outq):
    c = vovp.Client(socket)
    t = c.get_tensor("w", newer_than=1, timeout=60)
    outq.put((vovp.version_of(t), float(t[0])))


def test_a_reader_waits_for_the_next_version_across_processes(daemon):
    w = daemon.client()
    w.put_tensor("w", np.zeros(8))
    ctx = mp.get_context("spawn")
    outq = ctx.Queue()
    p = ctx.Process(target=_waiter, args=(daemon.socket, outq))
    p.start()
    # The waiter is in place (its GET counted) before the replace.
    assert wait_for(lambda: w.stats()["waiting_gets"] == 1, timeout=60)
    w.put_tensor("w", np.full(8, 5.0), replace=True)
    assert outq.get(timeout=60) == (2, 5.0)
    p.join(30)
    assert p.exitcode == 0


def _writer(socket, versions, outq):
    c = vovp.Client(socket)
    for v in range(1, versions + 1):
        got = c.put_tensor("weights", versioned(v), replace=True)
        assert vovp.version_of(got) == v, (vovp.version_of(got), v)
        del got
    outq.put(("writer", versions))


def _reader(socket, shared_reads, stop, outq):
    c = vovp.Client(socket, shared_reads=shared_reads)
    last, reads, seen = 0, 0, set()
    while not stop.is_set():
        t = c.get_tensor("weights", timeout=10)
        v = vovp.version_of(t)
        # One whole version: its own number, its own checksum; never older than the last.
        assert int(t[0]) == v, (int(t[0]), v)
        assert int(np.sum(t[2:], dtype=np.uint64)) == int(t[1]), v
        assert v >= last, (v, last)
        last, reads = v, reads + 1
        seen.add(v)
        c.release(t)
        del t
    outq.put(("reader", shared_reads, reads, len(seen), last))


def test_a_writer_replaces_under_readers_of_both_read_paths(start_daemon):
    """A writer replaces a 1 MiB tensor 2,000 times while four readers in other processes get
    it in a loop, two through the shared directory and two over the socket: every read is one
    whole version, versions never go back for a reader, and at the end nothing is held and
    the store holds the last version alone."""
    d = start_daemon(memory=256 << 20)
    ctx = mp.get_context("spawn")
    stop, outq = ctx.Event(), ctx.Queue()
    # The readers wait for the name; the writer's first put (a replace of a free name) is
    # version 1, its v-th is version v, tagged v.
    readers = [ctx.Process(target=_reader, args=(d.socket, shared, stop, outq))
               for shared in (True, True, False, False)]
    for p in readers:
        p.start()
    versions = 2000
    writer = ctx.Process(target=_writer, args=(d.socket, versions, outq))
    writer.start()
    writer.join(600)
    stop.set()
    for p in readers:
        p.join(60)
    results = [outq.get(timeout=10) for _ in range(5)]
    assert writer.exitcode == 0 and all(p.exitcode == 0 for p in readers), results
    assert ("writer", versions) in results
    reads = [r for r in results if r[0] == "reader"]
    for _, shared, n, distinct, last in reads:
        assert n > 0 and 1 <= last <= versions, reads
    # Both read paths saw replaces happen under them.
    assert all(distinct > 1 for *_, distinct, _ in reads), reads
    w = d.client()
    last = w.get_tensor("weights")
    assert int(last[0]) == versions and vovp.version_of(last) == versions
    del last
    # Holds and references back to zero; memory back to the last version's alone.

    def settled():
        s = w.stats()
        return (s["references"], s["pending_delete"], s["objects"]) == (0, 0, 1) and \
            s["used_bytes"] <= (1 << 20) + 4096

    assert wait_for(settled, timeout=60), w.stats()


def test_a_held_version_never_changes_while_the_writer_reuses_blocks(start_daemon):
    """A writer replaces a 6 MiB tensor (put through CREATE, the parallel copy and SEAL, into
    blocks the store frees and hands out again, fresh or warm) five times while two readers, one through the shared
    directory and one over the socket, hold version 1: version 1's bytes never change, each
    new version is whole, the store charges exactly the held version and the newest, and once
    the readers let go, the newest alone. Then 20 more replaces with nobody holding: the memory
    stays at one version."""
    d = start_daemon(memory=64 << 20)
    w = d.client()
    shared, socket = d.client(), vovp.Client(d.socket, shared_reads=False)
    n = 6 << 17  # uint64 words: 6 MiB, past the largest lend

    def tensor(v):
        t = np.random.default_rng(v).integers(0, 2**63, n, dtype=np.uint64)
        t[0] = v
        t[1] = np.sum(t[2:], dtype=np.uint64)
        return t

    def whole(t, v):
        return int(t[0]) == v and int(np.sum(t[2:], dtype=np.uint64)) == int(t[1])

    w.put_tensor("state", tensor(1))
    one = w.stats()["used_bytes"]
    held = [shared.get_tensor("state"), socket.get_tensor("state")]
    assert all(vovp.version_of(h) == 1 for h in held)
    first = [bytes(h[:64].tobytes()) + bytes(h[-64:].tobytes()) for h in held]
    for v in range(2, 7):
        got = w.put_tensor("state", tensor(v), replace=True)
        assert vovp.version_of(got) == v and whole(got, v)
        del got
        for h, f in zip(held, first):
            assert whole(h, 1) and bytes(h[:64].tobytes()) + bytes(h[-64:].tobytes()) == f, v
        newest = shared.get_tensor("state")
        assert vovp.version_of(newest) == v and whole(newest, v)
        del newest
    assert wait_for(lambda: w.stats()["used_bytes"] == 2 * one, timeout=30), (w.stats(), one)
    del held, h  # (the loop's last one too)
    assert wait_for(lambda: w.stats()["used_bytes"] == one, timeout=30), (w.stats(), one)
    for v in range(7, 27):
        got = w.put_tensor("state", tensor(v), replace=True)
        assert whole(got, v)
        del got
    assert wait_for(lambda: w.stats()["used_bytes"] == one, timeout=30), (w.stats(), one)
    last = socket.get_tensor("state")
    assert vovp.version_of(last) == 26 and whole(last, 26)
