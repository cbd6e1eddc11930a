"""CUDA objects from the pure-Python client (vovp/cuda.py).

Two halves:

* Everywhere (the normal CI run, no GPU): CUDA puts raise ``GpuUnavailable`` with a reason and
  create nothing; a CUDA object reaching a client without a driver raises ``GpuUnavailable``
  and its reference is released; the client keeps working for host objects. A missing driver
  is simulated in-process (``cuda._reset_for_tests`` with a library name that does not exist:
  the native core's hook re-probes the gpu crate's loader with it),
  so these also run, and mean the same, under the fake driver or on a GPU machine.
* With ``VOVP_GPU_TESTS=1`` (``scripts/gpu-fake-test.sh``, which loads the FAKE libcuda of
  gpu/fake-cuda through LD_LIBRARY_PATH, or a real NVIDIA machine): a daemon with
  ``--gpu-memory 0:256M``; device memory put by one Python process is read by name by another
  one (same allocation: writes through one mapping are seen through the other), references go
  back to 0, and the Rust test fixture (`vovp-fixture put-cuda` / `get-cuda`) interoperates
  both ways. Source
  buffers are made with ``cuda.mem_alloc`` + a host-to-device copy, as a framework would.

torch-specific tests additionally need torch with CUDA (skipped otherwise).
"""

from __future__ import annotations

import gc
import hashlib
import os
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading

import numpy as np
import pytest

import vovp
from vovp import cuda as C
import _wire as P
from vovp import tensor as T

from _helpers import wait_for
from conftest import FIXTURE

GPU_TESTS = os.environ.get("VOVP_GPU_TESTS") == "1"

needs_gpu = pytest.mark.skipif(
    not GPU_TESTS, reason="set VOVP_GPU_TESTS=1 (scripts/gpu-fake-test.sh, or a GPU machine)")


# --- helpers -----------------------------------------------------------------------------------


@pytest.fixture
def no_driver():
    """This process behaves as if no CUDA driver were installed, for the test's duration."""
    gc.collect()
    # The native core's hook: it re-probes the library under this name, which does not load.
    C._reset_for_tests(("libcuda-that-does-not-exist-vovp-test.so",))
    yield
    C._reset_for_tests()


def refcount(client, name):
    for e in client.list():
        if e["name"] == name:
            return e["refcount"]
    return None


def device_buffer(data) -> int:
    """A cuMemAlloc'ed buffer holding ``data``'s bytes (at least 1 byte: 0 is refused)."""
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    ptr = C.mem_alloc(max(raw.nbytes, 1))
    C.copy_h2d(ptr, raw, 0)
    return ptr


def collected_to(c, name, refs):
    """After a garbage collection, ``name``'s reference count in the store comes down to
    ``refs`` (the views dropped, their releases sent)."""
    gc.collect()
    assert wait_for(lambda: refcount(c, name) == refs)


def put_from_device(c, name, host, *args, **kw):
    """``c.put_cuda(name, buffer, host.nbytes, *args, **kw)`` of a fresh device buffer holding
    ``host``'s bytes, freed after the put (the store keeps its own copy): the put's result."""
    src = device_buffer(host)
    try:
        return c.put_cuda(name, src, host.nbytes, *args, **kw)
    finally:
        C.mem_free(src)


def pattern(n, seed=0):
    return ((np.arange(n, dtype=np.uint32) * 2654435761 >> 24).astype(np.uint8) ^ seed)


def using_fake_driver() -> bool:
    with open("/proc/self/maps") as f:
        return "fake-cuda" in f.read()


def fixture(daemon, *args) -> str:
    """Runs the Rust test fixture binary (the CUDA commands) against ``daemon``."""
    if not FIXTURE.exists():
        pytest.fail(f"{FIXTURE} is missing: run `cargo build --workspace --bins` first")
    out = subprocess.run([str(FIXTURE), "-s", daemon.socket, *args], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


# --- without a driver --------------------------------------------------------------------------


class _FakeCudaInterface:
    """Looks like a device array; never dereferenced (the put fails before any copy)."""

    __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0x1000, False),
                                "version": 3, "strides": None, "stream": None}


def test_put_cuda_without_driver_raises_with_reason(client, no_driver):
    with pytest.raises(vovp.GpuUnavailable) as e:
        client.put_cuda("g", 0x1000, 16)
    assert e.value.status == 10
    assert e.value.message.strip()
    assert "libcuda" in e.value.message
    with pytest.raises(vovp.GpuUnavailable):
        client.put_tensor("g2", _FakeCudaInterface())
    with pytest.raises(vovp.GpuUnavailable):
        client.put_cuda("g3", _FakeCudaInterface())
    # Nothing reached the daemon, and host objects still work on the same client.
    assert client.list() == []
    a = client.put_tensor("host", np.arange(6, dtype=np.float32).reshape(2, 3))
    np.testing.assert_array_equal(client.get_tensor("host"), a)
    assert not C.available()
    assert C.unavailable_reason() == e.value.message


def test_to_device_without_driver(client, no_driver):
    client.put_tensor("h", np.ones(4))
    with pytest.raises(vovp.GpuUnavailable):
        client.to_device("h", "h-gpu")
    assert not client.contains("h-gpu")
    assert refcount(client, "h") == 0


class ScriptedDaemon:
    """A stand-in daemon on a Unix socket: answers HELLO (one memfd segment holding bytes
    0..7), and GET of "gpu" with a CUDA objref, of "host" with a host uint8 tensor; records
    RELEASEd object ids. Lets the normal (GPU-less) CI see a CUDA object reach the client."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="vovp-", dir="/tmp")
        self.socket = os.path.join(self.dir, "s.sock")
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(self.socket)
        self.srv.listen(1)
        self.fd = os.memfd_create("vovp-test")
        os.ftruncate(self.fd, 4096)
        os.pwrite(self.fd, bytes(range(8)), 0)
        self.released = []
        self.next_oid = 100
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @staticmethod
    def reply(op, rid, body=b""):
        payload = b"\x00" + body
        return struct.pack("<IBBHQ", 12 + len(payload), P.VERSION, op | 0x80, 0, rid) + payload

    def _objref(self, name):
        self.next_oid += 1
        if name == "gpu":
            meta = T.encode_header(T.FLOAT32, (4,), device_type=T.DEVICE_CUDA)
            return (struct.pack("<QQB", self.next_oid, 16, P.LOC_CUDA)
                    + struct.pack("<IIQ64s", 0, 0, 256, b"\x07" * 64)
                    + struct.pack("<I", len(meta)) + meta + struct.pack("<Q", 1))
        meta = T.encode_header(T.UINT8, (8,))
        return (struct.pack("<QQB", self.next_oid, 8, P.LOC_HOST) + struct.pack("<IQ", 0, 0)
                + struct.pack("<I", len(meta)) + meta + struct.pack("<Q", 1))

    def _serve(self):
        conn, _ = self.srv.accept()
        buf = b""
        try:
            while True:
                while len(buf) < 4 or len(buf) < 4 + struct.unpack_from("<I", buf)[0]:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                n = 4 + struct.unpack_from("<I", buf)[0]
                frame, buf = buf[:n], buf[n:]
                _, _, op, _, rid = struct.unpack_from("<IBBHQ", frame)
                body = frame[16:]
                if op == P.HELLO:
                    hello = (struct.pack("<HQII", P.VERSION, 4096, 1 << 20, 1)
                             + struct.pack("<IQ", 0, 4096))
                    socket.send_fds(conn, [self.reply(op, rid, hello)], [self.fd])
                elif op == P.GET:
                    (nlen,) = struct.unpack_from("<H", body, 12)
                    name = body[14:14 + nlen].decode()
                    conn.sendall(self.reply(op, rid, struct.pack("<IB", 1, 1)
                                            + self._objref(name)))
                elif op == P.RELEASE:
                    (count,) = struct.unpack_from("<I", body, 0)
                    self.released += struct.unpack_from(f"<{count}Q", body, 4)
                else:
                    msg = b"not scripted"
                    err = struct.pack("<IBBHQB", 12 + 3 + len(msg), P.VERSION, op | 0x80, 0, rid,
                                      14)
                    conn.sendall(err + struct.pack("<H", len(msg)) + msg)
        except OSError:
            return
        finally:
            conn.close()

    def stop(self):
        self.srv.close()
        os.close(self.fd)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def scripted():
    d = ScriptedDaemon()
    yield d
    d.stop()


def test_get_cuda_object_without_driver(scripted, no_driver):
    c = vovp.Client(scripted.socket)
    with pytest.raises(vovp.GpuUnavailable) as e:
        c.get_tensor("gpu")
    assert "libcuda" in e.value.message
    first = scripted.next_oid
    # The reference the GET granted went back at once (not left for the connection's end).
    assert wait_for(lambda: first in scripted.released)
    # numpy cannot view device memory: refused before mapping anything, reference released.
    with pytest.raises(TypeError):
        c.get_tensor("gpu", framework="numpy")
    second = scripted.next_oid
    assert wait_for(lambda: second in scripted.released)
    # get_buffer of a CUDA object: no host memory to map.
    with pytest.raises(vovp.GpuUnavailable):
        c.get_buffer("gpu")
    # The connection is still fine for host objects.
    a = c.get_tensor("host")
    np.testing.assert_array_equal(a, np.arange(8, dtype=np.uint8))
    with pytest.raises(TypeError):
        c.get_tensor("host", framework="cuda")
    c.close()


def test_plasma_dropin_get_of_a_cuda_object_without_driver(scripted, no_driver):
    # vovp.plasma's get reads the native object's fields itself (not through vovp.Client): a
    # CUDA object has no host bytes to hand out, so it is the same clear error, with the
    # reference given back, and the connection keeps serving host objects.
    from vovp import plasma

    pc = plasma.connect(scripted.socket)
    with pytest.raises(vovp.GpuUnavailable) as e:
        pc.get_buffers(["gpu"], timeout_ms=0)
    assert isinstance(e.value, plasma.ArrowException) and "CUDA object" in e.value.message
    first = scripted.next_oid
    assert wait_for(lambda: first in scripted.released)
    [buf] = pc.get_buffers(["host"], timeout_ms=0)
    assert buf.to_pybytes() == bytes(range(8))
    pc.disconnect()


def test_cuda_tensor_interface_shape():
    # No driver needed: CudaTensor is plain data around an owner.
    owner = C.DeviceBuffer(0x7000, 24, 0, None)
    t = C.CudaTensor(owner, T.FLOAT32, (2, 3), name="x")
    iface = t.__cuda_array_interface__
    assert iface == {"shape": (2, 3), "typestr": "<f4", "data": (0x7000, True), "version": 3,
                     "strides": None, "stream": None}
    assert (t.device, t.dtype, t.shape, t.ptr, t.nbytes) == (0, np.float32, (2, 3), 0x7000, 24)
    w = C.CudaTensor(owner, T.BFLOAT16, (12,), readonly=False)
    assert w.__cuda_array_interface__["data"] == (0x7000, False)
    assert w.__cuda_array_interface__["typestr"] == "<u2"  # raw bits: no bfloat16 typestr
    assert w.dtype_name == "bfloat16"


# --- with a (fake or real) driver --------------------------------------------------------------


@pytest.fixture
def gpu_daemon(start_daemon):
    if not C.available():
        pytest.fail(f"VOVP_GPU_TESTS=1 but this process cannot use CUDA: "
                    f"{C.unavailable_reason()}", pytrace=False)
    return start_daemon(64 << 20, ["--gpu-memory", "0:256M"])


@pytest.fixture
def gpu_client(gpu_daemon):
    """A client of ``gpu_daemon``, closed after the test (as conftest's ``client``)."""
    c = gpu_daemon.client()
    yield c
    c.close()


DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "bfloat16", "float32", "float64", "complex64", "complex128"]
SHAPES = [(), (0,), (7,), (2, 3), (3, 0, 2), (4, 5, 6)]


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_put_get_round_trip(gpu_daemon, dtype):
    c, other = gpu_daemon.client(), gpu_daemon.client()
    for i, shape in enumerate(SHAPES):
        n = int(np.prod(shape, dtype=np.int64))
        np_dt = np.dtype("uint16") if dtype == "bfloat16" else np.dtype(dtype)
        host = (np.arange(n) % 100).astype(np_dt).reshape(shape)
        name = f"{dtype}-{i}"
        put = put_from_device(c, name, host, dtype, shape)
        assert isinstance(put, C.CudaTensor)
        assert put.shape == shape and put.dtype_name == dtype and put.nbytes == host.nbytes
        got = other.get_tensor(name, framework="cuda")
        assert got.ptr == put.ptr  # one process: one mapping of the pool, same address
        assert got.__cuda_array_interface__["data"][1] is True  # sealed: read-only
        back = got.to_numpy()
        assert back.shape == shape
        np.testing.assert_array_equal(back.view(np.uint16) if dtype == "bfloat16" and
                                      back.dtype != np.uint16 else back, host)
        entry = next(e for e in c.list() if e["name"] == name)
        assert (entry["device"], entry["device_id"], entry["dtype"], entry["shape"]) == \
            ("cuda", 0, dtype, shape)
    del put, got
    gc.collect()
    assert wait_for(lambda: all(e["refcount"] == 0 for e in c.list()))
    c.close()
    other.close()


@needs_gpu
def test_a_cuda_replace_keeps_the_held_version(gpu_daemon):
    """Versions of a CUDA object (README "Versions"): a replace moves the name to new device
    memory, a reader's mapping of the old version keeps its bytes, and the old block goes
    with its last holder."""
    c, other = gpu_daemon.client(), gpu_daemon.client()
    for v in (1, 2, 3):
        put = put_from_device(c, "dev", np.full(8, v, dtype=np.int32), np.int32, replace=True)
        assert vovp.version_of(put) == v
        if v == 1:
            held = other.get_tensor("dev", framework="cuda")
        del put
    now = other.get_tensor("dev", framework="cuda", newer_than=2, timeout=5)
    assert vovp.version_of(now) == 3 and list(now.to_numpy()) == [3] * 8
    assert vovp.version_of(held) == 1 and list(held.to_numpy()) == [1] * 8
    assert c.stats()["pending_delete"] >= 1
    del held, now
    gc.collect()
    assert wait_for(lambda: c.stats()["pending_delete"] == 0 and c.stats()["references"] == 0)
    c.close()
    other.close()


@needs_gpu
def test_replaced_cuda_versions_free_device_memory_with_last_reader(gpu_daemon, gpu_client,
                                                                   subprocess_env):
    """Weight sync on one GPU (issue 44 item 6; sglang and miles users report this leak): a
    reader in another process holds version 1 while the writer replaces the name five times.
    Every version the reader does not hold is freed as the next one lands -- six 80 MiB
    versions would not fit the 256 MiB device pool, so a leak is OutOfMemory here -- and
    version 1's device memory and the reader's IPC mapping go when the reader lets go."""
    n = 80 << 20  # the held, the current and the next version fit the pool; a fourth not
    child = Child(gpu_daemon, subprocess_env)
    try:
        put = put_from_device(gpu_client, "policy", pattern(n, 1), replace=True)
        del put
        first = hashlib.sha256(pattern(n, 1).tobytes()).hexdigest()
        assert child.ask("get policy") == f"uint8 {n} {first}"
        for v in range(2, 7):
            put = put_from_device(gpu_client, "policy", pattern(n, v), replace=True)
            assert vovp.version_of(put) == v
            del put
            gc.collect()
        assert child.ask("read") == first  # the held version kept its bytes throughout
        assert gpu_client.stats()["pending_delete"] == 1  # only version 1, for its reader
        assert child.ask("drop") == "dropped pools=0"  # the reader closed its IPC mapping
        assert wait_for(lambda: gpu_client.stats()["pending_delete"] == 0)
        # Version 1's block is back in the pool: two more objects fit beside the current
        # version (they would not beside a version 1 still allocated).
        kept = [put_from_device(gpu_client, f"after-{i}", pattern(n, 9)) for i in range(2)]
        got = gpu_client.get_tensor("policy", framework="cuda")
        assert vovp.version_of(got) == 6 and (got.to_numpy() == pattern(n, 6)).all()
        del kept, got
    finally:
        child.close()
    gc.collect()
    assert wait_for(lambda: gpu_client.stats()["references"] == 0)


@needs_gpu
def test_writable_and_release(gpu_client):
    put_from_device(gpu_client, "w", np.arange(16, dtype=np.int32), np.int32)
    t = gpu_client.get_tensor("w", framework="cuda", writable=True)
    assert t.__cuda_array_interface__["data"] == (t.ptr, False)
    assert refcount(gpu_client, "w") == 1
    from vovp.client import find_lease
    assert find_lease(t) is not None
    assert t.release() is True
    assert t.release() is False and gpu_client.release(t) is False  # double release is a no-op
    assert refcount(gpu_client, "w") == 0


@needs_gpu
def test_pool_mapped_once_and_closed_with_last_view(gpu_client):
    gc.collect()
    assert C.open_pools() == 0
    bufs = []
    for i in range(3):
        bufs.append(put_from_device(gpu_client, f"p{i}", np.full(1000, i, dtype=np.uint8)))
    assert C.open_pools() == 1  # three objects, one pool, one IPC mapping
    ptrs = {b.ptr for b in bufs}
    assert len(ptrs) == 3
    view = bufs[1].__cuda_array_interface__  # a dict holds no reference: only bufs count
    old_ptr = bufs[0].ptr
    del bufs
    gc.collect()
    assert wait_for(lambda: C.open_pools() == 0)
    assert wait_for(lambda: all(e["refcount"] == 0 for e in gpu_client.list()))
    if using_fake_driver():
        # The driver really unmapped it (cuIpcCloseMemHandle): the old address is gone. Only
        # probed with the fake, which checks pointers; a real GPU is not poked at freed memory.
        with pytest.raises(vovp.GpuError):
            C.copy_d2h(np.empty(1, np.uint8), old_ptr, 0)
    # Mapping it again works (fresh cuIpcOpenMemHandle) and reads the same bytes.
    again = gpu_client.get_tensor("p2", framework="cuda")
    assert (again.to_numpy() == 2).all() and C.open_pools() == 1
    assert view["shape"] == (1000,)


CHILD = r"""
import gc, hashlib, sys
import vovp
from vovp import cuda as C

client = vovp.Client(sys.argv[1])
t = None
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "get":
        t = client.get_tensor(args[0], framework="cuda")
        out = f"{t.dtype_name} {t.nbytes} {hashlib.sha256(t.to_numpy().tobytes()).hexdigest()}"
    elif cmd == "read":
        out = hashlib.sha256(t.to_numpy().tobytes()).hexdigest()
    elif cmd == "drop":
        del t
        t = None
        gc.collect()
        client.flush()
        out = f"dropped pools={C.open_pools()}"
    elif cmd == "put":  # put NAME NBYTES FILL: a device buffer put through put_cuda
        n, fill = int(args[1]), int(args[2])
        src = C.mem_alloc(n)
        C.copy_h2d(src, bytes([fill]) * n, 0)
        t = client.put_cuda(args[0], src, n)
        C.mem_free(src)
        out = "put"
    else:
        break
    print(out, flush=True)
"""


class Child:
    """A second Python process driven line by line (see CHILD)."""

    def __init__(self, daemon, env):
        self.p = subprocess.Popen([sys.executable, "-c", CHILD, daemon.socket],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, env=env)
        self.buf = b""

    def ask(self, line, timeout=30.0) -> str:
        self.p.stdin.write((line + "\n").encode())
        self.p.stdin.flush()
        fd = self.p.stdout.fileno()
        while b"\n" not in self.buf:
            ready, _, _ = select.select([fd], [], [], timeout)
            chunk = os.read(fd, 65536) if ready else b""
            if not chunk:
                self.p.kill()
                raise AssertionError(f"child gave no answer to {line!r}: "
                                     f"{self.p.stderr.read().decode(errors='replace')}")
            self.buf += chunk
        out, self.buf = self.buf.split(b"\n", 1)
        return out.decode()

    def close(self):
        try:
            self.p.stdin.close()
            self.p.wait(10)
        finally:
            if self.p.poll() is None:
                self.p.kill()


@needs_gpu
def test_cross_process_same_allocation(gpu_daemon, gpu_client, subprocess_env):
    n = 1 << 20
    first = pattern(n, 1)
    mine = put_from_device(gpu_client, "shared", first)
    child = Child(gpu_daemon, subprocess_env)
    try:
        # Another process gets it by name and reads (device-to-host) the same bytes.
        assert child.ask("get shared") == f"uint8 {n} {hashlib.sha256(first).hexdigest()}"
        assert refcount(gpu_client, "shared") == 2
        # Same allocation, not a copy: write through this process's mapping of the store
        # memory (sealed objects are read-only by convention; this is the test's probe) ...
        second = pattern(n, 2)
        C.copy_h2d(mine.ptr, second, 0)
        # ... and the other process sees the new bytes through its own mapping.
        assert child.ask("read") == hashlib.sha256(second).hexdigest()
        # References go back to 0 when both drop their views; the child unmapped its pool.
        assert child.ask("drop") == "dropped pools=0"
        assert wait_for(lambda: refcount(gpu_client, "shared") == 1)
        del mine
        collected_to(gpu_client, "shared", 0)
        assert wait_for(lambda: C.open_pools() == 0)
        # The other direction: the child puts, this process gets.
        assert child.ask(f"put fromchild {n} 9") == "put"
        got = gpu_client.get_tensor("fromchild", framework="cuda")
        assert (got.to_numpy() == 9).all()
    finally:
        child.close()
    # The child exited holding its put result: the daemon released that reference.
    del got
    collected_to(gpu_client, "fromchild", 0)


@needs_gpu
def test_rust_cli_put_python_get(gpu_daemon, gpu_client):
    n = 300_000
    fixture(gpu_daemon, "put-cuda", "from-rust", "--bytes", str(n), "--fill", "7")
    t = gpu_client.get_tensor("from-rust", framework="cuda")
    assert (t.dtype_name, t.shape, t.device) == ("uint8", (n,), 0)
    host = t.to_numpy()
    assert host.shape == (n,) and (host == 7).all()
    if not C.torch_cuda_usable():
        assert isinstance(gpu_client.get_tensor("from-rust"), C.CudaTensor)  # framework=None
    del t
    collected_to(gpu_client, "from-rust", 0)


@needs_gpu
def test_python_put_rust_get(gpu_daemon, gpu_client):
    n = 123_457
    data = pattern(n, 3)
    put_from_device(gpu_client, "from-python", data)
    out = fixture(gpu_daemon, "get-cuda", "from-python")
    assert out == f"len={n} first={data[0]} last={data[-1]} sum={int(data.sum(dtype=np.uint64))}"


@needs_gpu
def test_to_device_copies_host_tensor(gpu_client):
    a = np.arange(12, dtype=np.float64).reshape(3, 4) * 1.5
    gpu_client.put_tensor("h", a)
    t = gpu_client.to_device("h", "h-cuda", 0, framework="cuda")
    assert (t.dtype_name, t.shape, t.device) == ("float64", (3, 4), 0)
    np.testing.assert_array_equal(t.to_numpy(), a)
    entries = {e["name"]: e for e in gpu_client.list()}
    assert entries["h-cuda"]["device"] == "cuda" and entries["h-cuda"]["shape"] == (3, 4)
    assert entries["h"]["refcount"] == 0  # the source's reference was released
    # CUDA -> CUDA works too (device-to-device).
    t2 = gpu_client.to_device("h-cuda", "h-cuda-2", 0, framework="cuda")
    np.testing.assert_array_equal(t2.to_numpy(), a)
    del t, t2
    gc.collect()
    assert wait_for(lambda: all(e["refcount"] == 0 for e in gpu_client.list()))


@needs_gpu
def test_put_from_cuda_array_interface(gpu_client):
    put_from_device(gpu_client, "iface-src", np.arange(10, dtype=np.int16), np.int16)
    t = gpu_client.get_tensor("iface-src", framework="cuda")
    # Anything with __cuda_array_interface__ (a CudaTensor here) goes through put_cuda.
    copy = gpu_client.put_tensor("iface-copy", t)
    assert isinstance(copy, C.CudaTensor) and copy.ptr != t.ptr
    assert copy.dtype == np.int16 and copy.shape == (10,)
    np.testing.assert_array_equal(copy.to_numpy(), np.arange(10, dtype=np.int16))

    class Strided:
        __cuda_array_interface__ = {"shape": (5,), "typestr": "<i2", "data": (t.ptr, False),
                                    "version": 3, "strides": (4,), "stream": None}

    with pytest.raises(ValueError):
        gpu_client.put_cuda("strided", Strided())
    assert not gpu_client.contains("strided")


@needs_gpu
def test_failed_copy_aborts_and_bad_device(gpu_client):
    with pytest.raises(vovp.GpuError):
        # 0x10 is no device memory: the copy fails after CREATE; the object must be aborted.
        gpu_client.put_cuda("bad", 0x10, 64, device=0)
    assert not gpu_client.contains("bad")
    assert [e for e in gpu_client.list() if e["name"] == "bad"] == []
    with pytest.raises(vovp.GpuError):
        # Device unknown: asked from the driver, which refuses.
        gpu_client.put_cuda("bad2", 0x10, 64)
    with pytest.raises(vovp.GpuUnavailable) as e:
        gpu_client.put_cuda("bad3", 0x10, 64, device=7)
    assert "cuda:7" in e.value.message
    # Still usable.
    put_from_device(gpu_client, "good", np.ones(8, dtype=np.uint8))
    assert gpu_client.contains("good")


@needs_gpu
def test_ephemeral_cuda_object_goes_with_last_reference(gpu_client):
    t = put_from_device(gpu_client, "eph", np.ones(100, dtype=np.uint8), ephemeral=True)
    assert gpu_client.contains("eph")
    del t
    gc.collect()
    assert wait_for(lambda: not gpu_client.contains("eph"))


@needs_gpu
def test_get_cuda_object_in_client_without_driver(gpu_daemon, no_driver, gpu_client):
    # The daemon has the (fake or real) driver; this process pretends it has none.
    fixture(gpu_daemon, "put-cuda", "dev", "--bytes", "1000", "--fill", "3")
    with pytest.raises(vovp.GpuUnavailable) as e:
        gpu_client.get_tensor("dev")
    assert e.value.message.strip()
    assert wait_for(lambda: refcount(gpu_client, "dev") == 0)  # the GET's reference was released
    a = gpu_client.put_tensor("host-ok", np.arange(3))
    np.testing.assert_array_equal(gpu_client.get_tensor("host-ok"), a)


NO_DEVICE_CHILD = r"""
import vovp
from vovp import cuda as C
try:
    C.mem_alloc(16)
except vovp.GpuUnavailable as e:
    print("unavailable:", e.message)
else:
    print("available")
"""


@needs_gpu
@pytest.mark.parametrize("env,expect", [({"FAKE_CUDA_INIT_ERROR": "100"}, "cuInit"),
                                        ({"FAKE_CUDA_DEVICES": "0"}, "no device")])
def test_driver_without_usable_device(subprocess_env, env, expect):
    if not using_fake_driver():
        pytest.skip("needs the fake driver (its FAKE_CUDA_* switches)")
    out = subprocess.run([sys.executable, "-c", NO_DEVICE_CHILD], capture_output=True,
                         text=True, timeout=60, env={**subprocess_env, **env})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("unavailable:") and expect in out.stdout, out.stdout


# --- torch -------------------------------------------------------------------------------------


def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


@needs_gpu
def test_torch_put_get_zero_copy(gpu_daemon):
    torch = _torch_cuda()
    c, other = gpu_daemon.client(), gpu_daemon.client()
    x = (torch.arange(1000, dtype=torch.float32, device="cuda:0") * 2).reshape(10, 100)
    r = c.put_tensor("t", x)
    assert isinstance(r, torch.Tensor) and r.is_cuda and r.device == x.device
    assert r.data_ptr() != x.data_ptr() and torch.equal(r, x)
    g = other.get_tensor("t")  # framework=None: torch, as torch sees CUDA
    assert isinstance(g, torch.Tensor) and g.is_cuda and torch.equal(g, x)
    assert g.data_ptr() == r.data_ptr()  # one process: one mapping of the pool
    g[0, 0] = -1.0  # same memory (never do this to a sealed object outside a test)
    torch.cuda.synchronize()
    assert r[0, 0].item() == -1.0
    assert refcount(c, "t") == 2
    view = g[1:3]  # views keep the reference (torch holds the source object)
    del r, g
    collected_to(c, "t", 1)
    del view
    collected_to(c, "t", 0)
    c.close()
    other.close()


@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int64", "bool", "complex64"])
def test_torch_dtypes_and_non_contiguous(gpu_client, dtype):
    torch = _torch_cuda()
    dt = getattr(torch, dtype)
    base = torch.arange(24, device="cuda:0").reshape(4, 6)
    x = (base % 2 == 0) if dtype == "bool" else base.to(dt)
    x = x.t()  # non-contiguous: stored C-contiguous
    r = gpu_client.put_tensor("nc", x)
    assert r.dtype == dt and r.shape == x.shape and r.is_contiguous() and torch.equal(r, x)
    g = gpu_client.get_tensor("nc", framework="torch")
    assert torch.equal(g, x)
    ct = gpu_client.get_tensor("nc", framework="cuda")
    assert ct.dtype_name == dtype and ct.shape == tuple(x.shape)


@needs_gpu
def test_torch_tensor_from_cuda_tensor_interface(gpu_client):
    torch = _torch_cuda()
    gpu_client.put_tensor("i", torch.ones(5, device="cuda:0"))
    # Writable: torch refuses read-only arrays.
    ct = gpu_client.get_tensor("i", framework="cuda", writable=True)
    t = torch.as_tensor(ct, device="cuda:0")
    assert t.data_ptr() == ct.ptr and torch.equal(t, torch.ones(5, device="cuda:0"))
    del ct
    gc.collect()
    assert refcount(gpu_client, "i") == 1  # torch keeps the CudaTensor (and its reference) alive
    del t
    collected_to(gpu_client, "i", 0)


# --- DLPack --------------------------------------------------------------------------------------


@needs_gpu
def test_cuda_tensor_dlpack_capsule(gpu_client):
    """CudaTensor.__dlpack__: a capsule over the store's device memory (CUDA device, dtype,
    shape), read-only flagged for DLPack 1 consumers, and the store reference held until the
    consumer calls the deleter (as torch/CuPy do when their tensor dies)."""
    import ctypes

    from vovp import dlpack as D

    host = np.arange(6, dtype=np.float32).reshape(2, 3)
    put_from_device(gpu_client, "dl", host, "float32", (2, 3))
    ct = gpu_client.get_tensor("dl", framework="cuda")
    assert ct.__dlpack_device__() == (D.KDL_CUDA, 0)
    api = ctypes.PyDLL(None)
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
    for max_version, name, struct in ((None, b"dltensor", D.DLManagedTensor),
                                      ((1, 0), b"dltensor_versioned",
                                       D.DLManagedTensorVersioned)):
        cap = ct.__dlpack__(stream=None, max_version=max_version)
        # What a consumer does: take the pointer, rename the capsule, call the deleter later.
        ptr = api.PyCapsule_GetPointer(cap, name)
        managed = struct.from_address(ptr)
        dl = managed.dl_tensor
        assert (dl.data, dl.device.device_type, dl.device.device_id) == (ct.ptr, 2, 0)
        assert (dl.ndim, dl.shape[0], dl.shape[1]) == (2, 2, 3)
        assert (dl.dtype.code, dl.dtype.bits, dl.dtype.lanes) == (2, 32, 1)  # kDLFloat
        if max_version:
            assert managed.flags & D.FLAG_READ_ONLY
        api.PyCapsule_SetName(cap, b"used_" + name)
        del cap  # consumed: the capsule no longer frees it
        assert D.pending_exports() == 1
        del ct
        gc.collect()
        assert refcount(gpu_client, "dl") == 1  # the consumer still has it
        managed.deleter(ptr)
        collected_to(gpu_client, "dl", 0)
        assert D.pending_exports() == 0
        ct = gpu_client.get_tensor("dl", framework="cuda")
    with pytest.raises(BufferError, match="copy"):
        ct.__dlpack__(copy=True)


@needs_gpu
def test_forked_child_gets_gpu_unavailable():
    # The parent initialised the driver; CUDA does not survive fork, so the child must get a
    # clear GpuUnavailable (from the gpu crate's fork check), not a hang or a crash.
    assert C.available()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, exit without running pytest's atexit
        code = 1
        try:
            try:
                C.mem_alloc(16)
                msg = "available"
            except vovp.GpuUnavailable as e:
                msg = "unavailable: " + e.message
                code = 0
            os.write(w, msg.encode())
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out
    assert out.startswith("unavailable:") and "fork" in out, out
    # The parent is unaffected.
    ptr = C.mem_alloc(16)
    C.mem_free(ptr)
