"""Isolation between clients: every client maps the store read-only, except the arenas that
hold the objects it created itself. A client that writes through a view it got (a bug, a stray
ctypes call) dies with SIGSEGV and the object is unchanged for everyone; it cannot punch holes
either. ``writable=True`` views are private copies-on-write."""

import gc
import signal
import subprocess
import sys
import textwrap

import numpy as np

CHILD = textwrap.dedent("""
    import ctypes, sys
    import vovp
    c = vovp.init_client(sys.argv[1])
    a = c.get_tensor(sys.argv[2])
    addr = a.__array_interface__["data"][0]
    libc = ctypes.CDLL(None, use_errno=True)
    if sys.argv[3] == "punch":
        page = addr - addr % 4096
        MADV_REMOVE = 9
        rc = libc.madvise(ctypes.c_void_p(page), ctypes.c_size_t(4096), MADV_REMOVE)
        print("madvise", rc, ctypes.get_errno(), flush=True)
        sys.exit(0)
    if sys.argv[3] == "private":
        w = c.get_tensor(sys.argv[2], writable=True)
        w[:] = 7
        print("private write ok", int(w[0]), flush=True)
        sys.exit(0)
    print("writing", flush=True)
    ctypes.memmove(addr, b"\\xff" * 8, 8)
    print("wrote", flush=True)
""")


def _run(subprocess_env, socket, name, mode):
    return subprocess.run([sys.executable, "-c", CHILD, socket, name, mode],
                          env=subprocess_env, capture_output=True, text=True, timeout=60)


def test_writing_through_a_got_view_is_sigsegv_and_the_object_is_unchanged(
        daemon, client, subprocess_env):
    small = np.arange(16, dtype=np.int64)  # inline put: the store's own segment
    big = np.arange(1 << 18, dtype=np.int64)  # 2 MiB: created in this client's arena
    client.put_tensor("small", small)
    client.put_tensor("big", big)
    for name in ("small", "big"):
        p = _run(subprocess_env, daemon.socket, name, "write")
        assert p.returncode == -signal.SIGSEGV, (p.returncode, p.stdout, p.stderr)
        assert "writing" in p.stdout and "wrote" not in p.stdout
    other = daemon.client()
    assert np.array_equal(other.get_tensor("small"), small)
    assert np.array_equal(other.get_tensor("big"), big)
    other.close()


def test_a_reader_cannot_punch_holes_and_writable_views_are_private(
        daemon, client, subprocess_env):
    big = np.arange(1 << 18, dtype=np.int64)
    client.put_tensor("big", big)
    p = _run(subprocess_env, daemon.socket, "big", "punch")
    assert p.returncode == 0, p.stderr
    rc, errno_ = map(int, p.stdout.split()[1:3])
    assert rc == -1 and errno_ != 0, p.stdout
    p = _run(subprocess_env, daemon.socket, "big", "private")
    assert p.returncode == 0 and "private write ok 7" in p.stdout, (p.stdout, p.stderr)
    assert np.array_equal(client.get_tensor("big"), big)


def test_the_creator_writes_its_own_objects_in_place(daemon, client):
    buf = client.create("mine", 1 << 20)
    buf[:] = 5
    client.seal("mine")
    assert int(client.get_buffer("mine")[123]) == 5
    # Its arena is its own: nobody else gets it writable.
    other = daemon.client()
    assert bytes(other.get_buffer("mine")[:4]) == b"\x05\x05\x05\x05"
    assert other.get_buffer("mine").readonly
    # ... while the creator's writable view is its own arena's mapping, in place.
    mine = np.frombuffer(client.get_buffer("mine", writable=True), np.uint8)
    assert mine.ctypes.data == buf.ctypes.data
    other.close()


WRITER = textwrap.dedent("""
    import sys
    import torch, vovp
    c = vovp.init_client(sys.argv[1])
    for i in range(int(sys.argv[2])):
        c.put_tensor(f"new{i}", torch.full((16,), i, dtype=torch.int64))
""")


def test_torch_results_show_new_objects_where_this_process_wrote_old_ones(
        daemon, client, subprocess_env):
    """A write into a torch result makes this process a private copy of that page. Once the
    object is gone and another process's object takes its place, a torch get of the new one
    must show the new bytes, not the copy (it did, before private views dropped their copies)."""
    import torch
    n = 64
    for i in range(n):  # small torch puts: the store's segment, packed into a few pages
        client.put_tensor(f"old{i}", torch.zeros(16, dtype=torch.int64))
    mine = [client.get_tensor(f"old{i}") for i in range(n)]
    for t in mine:
        t[:] = -1  # copies of those pages, in this process only
    del mine, t
    for i in range(n):
        client.delete(f"old{i}")
    p = subprocess.run([sys.executable, "-c", WRITER, daemon.socket, str(n)],
                       env=subprocess_env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    for i in range(n):
        got = client.get_tensor(f"new{i}")
        assert isinstance(got, torch.Tensor)
        assert got.tolist() == [i] * 16, (i, got.tolist())


def test_a_torch_result_beside_one_this_process_wrote_shows_its_own_bytes(
        daemon, client, subprocess_env):
    """Two small objects in one page: this process wrote into its torch result of the first
    (a private copy of the page), the second came later. The second's torch result shows its
    bytes, and both keep this process's writes to them private."""
    import torch
    first = client.put_tensor("first", torch.zeros(4, dtype=torch.int64))
    first[:] = 9
    p = subprocess.run([sys.executable, "-c", WRITER, daemon.socket, "8"],
                       env=subprocess_env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    news = [client.get_tensor(f"new{i}") for i in range(8)]
    assert [t.tolist() for t in news] == [[i] * 16 for i in range(8)]
    news[0][:] = 5
    assert first.tolist() == [9] * 4
    other = daemon.client()
    assert other.get_tensor("first").tolist() == [0] * 4
    assert other.get_tensor("new0").tolist() == [0] * 16
    other.close()


def test_a_written_result_given_back_early_never_shows_through_the_next_object(
        daemon, client, subprocess_env):
    """``release(t)`` gives the reference back while ``t`` lives on (unused): its object goes,
    another process's object of the same size takes its place, and this process's torch get
    of the new one shows the new bytes, not the copy ``t`` still views (small and larger)."""
    import torch
    for n in (16, 1024):  # 128 B and 8 KiB
        client.put_tensor("a", torch.zeros(n, dtype=torch.int64))
        other = daemon.client()
        t = other.get_tensor("a")
        t[:] = 7
        other.release(t)
        client.delete("a")
        gc.collect()
        p = subprocess.run([sys.executable, "-c", WRITER_SIZED, daemon.socket, "16", str(n)],
                           env=subprocess_env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        for i in range(16):
            assert other.get_tensor(f"new{i}").tolist() == [i] * n, (n, i)
        other.close()
        for i in range(16):
            client.delete(f"new{i}")


WRITER_SIZED = textwrap.dedent("""
    import sys
    import torch, vovp
    c = vovp.init_client(sys.argv[1])
    for i in range(int(sys.argv[2])):
        c.put_tensor(f"new{i}", torch.full((int(sys.argv[3]),), i, dtype=torch.int64))
""")
