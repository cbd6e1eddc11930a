"""Isolation between clients: every client maps the store read-only, except the arenas that
hold the objects it created itself. A client that writes through a view it got (a bug, a stray
ctypes call) dies with SIGSEGV and the object is unchanged for everyone; it cannot punch holes
either. ``writable=True`` views are private copies-on-write."""

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
