"""Helpers shared by the tests, importable by spawned worker processes."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import shutil
import tempfile
import time

import numpy as np


def wait_for(predicate, timeout=10.0, interval=0.02):
    """Poll ``predicate`` until it is true or ``timeout`` passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        v = predicate()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(interval)


def spawn_queue_worker(target):
    """``target(inq, outq)`` in a process of the spawn context, started: (process, inq,
    outq)."""
    ctx = mp.get_context("spawn")
    inq, outq = ctx.Queue(), ctx.Queue()
    w = ctx.Process(target=target, args=(inq, outq))
    w.start()
    return w, inq, outq


def requests_after_first_get(client, name) -> int:
    """``client``'s requests so far, once it got ``name`` and dropped it (the first get from a
    putter's arena maps it: one SEGMENT request, then the arena stays mapped) and its release
    went out."""
    first = client.get_tensor(name)
    del first
    gc.collect()
    client.flush()
    return client.core.requests_sent()


def store_backed(arr) -> bool:
    """Whether ``arr`` is a view of store memory held by a vovp client of this process."""
    from vovp.client import find_lease

    return find_lease(arr) is not None


def queue_worker(inq, outq):
    """Receive arrays until None; report (pid, sum, shape, store-backed, writeable) for each."""
    while True:
        arr = inq.get()
        if arr is None:
            break
        outq.put((os.getpid(), float(np.sum(arr, dtype=np.float64)), arr.shape,
                  store_backed(arr), bool(arr.flags.writeable)))
        del arr
        gc.collect()
    outq.put(("done", os.getpid()))


def args_worker(arr, outq):
    """Process(args=(arr,)) target: report what arrived."""
    outq.put((float(np.sum(arr, dtype=np.float64)), store_backed(arr)))


def result_worker(n, outq):
    """Send a large array back and return at once (the process then exits).

    A spawned child starts without vovp's reducers: it registers them itself, finding the
    socket through $VOVP_SOCKET, which the parent's init_reduction exported.
    """
    import vovp

    vovp.init_reduction()
    outq.put(np.full(n, 7, dtype=np.int32))


def torch_queue_worker(inq, outq):
    """Receive torch tensors until None; report (sum, dtype, shape, store-backed) for each."""
    while True:
        t = inq.get()
        if t is None:
            break
        outq.put((float(t.double().sum()), str(t.dtype), tuple(t.shape), store_backed(t)))
        del t
        gc.collect()
    outq.put("done")


# --- torch helpers (imported lazily: these functions run only where torch is installed) -----


def tensor_digest(t) -> str:
    """dtype, shape and a hash of a CPU tensor's values (bfloat16 by its int16 bits)."""
    import hashlib

    import torch

    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return f"{t.dtype}|{tuple(t.shape)}|{hashlib.sha1(t.numpy().tobytes()).hexdigest()}"


def torch_child(inq, outq, send_back):
    """Receive lists of tensors until None: report, per tensor, (type name, digest,
    store-backed). With ``send_back``, also send one tensor of its own to the parent (a
    spawned/forkserver child registers the reducers itself, like any sending process)."""
    import torch

    import vovp

    # A forked child must not use the OpenMP pool its parent already started (libgomp hangs):
    # one thread, as torch's own DataLoader workers do.
    torch.set_num_threads(1)
    if send_back:
        vovp.init_reduction()
    while True:
        ts = inq.get()
        if ts is None:
            break
        outq.put([(type(t).__name__, tensor_digest(t), store_backed(t)) for t in ts])
        del ts
        gc.collect()
    if send_back:
        outq.put(torch.arange(1 << 16, dtype=torch.float64))
    outq.put(("done", os.getpid()))


class ItemDataset:
    """Map-style dataset: item i is a float32 tensor of ``numel`` elements, all equal to i.
    Items from ``slow_from`` on take ``delay`` seconds each (batches still being made when
    the loader is deleted)."""

    def __init__(self, n, numel, slow_from=None, delay=0.05):
        self.n = n
        self.numel = numel
        self.slow_from = slow_from
        self.delay = delay

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import time

        import torch

        if self.slow_from is not None and i >= self.slow_from:
            time.sleep(self.delay)
        return torch.full((self.numel,), float(i), dtype=torch.float32)


class RawConnection:
    """A connection to the daemon that speaks raw frames (_wire.py), for tests of what
    the daemon does with frames no client would send. Does the HELLO handshake (closing the
    segment fds it receives)."""

    def __init__(self, path):
        import socket

        import _wire as P

        self.P = P
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.sock.sendall(P.frame(P.HELLO, 1, P.hello_payload(os.getpid())))
        data, fds = self._read(with_fds=True)
        for fd in fds:
            os.close(fd)
        P.check_reply(data, P.HELLO, 1)

    def _read(self, with_fds=False):
        import socket

        data, fds = bytearray(), []
        while len(data) < 4 or len(data) < 4 + self.P.U32.unpack_from(data, 0)[0]:
            if with_fds:
                chunk, cfds, _, _ = socket.recv_fds(self.sock, 1 << 16, 1024)
                fds.extend(cfds)
            else:
                chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("the daemon closed the connection")
            data += chunk
        return data, fds

    def roundtrip(self, frame, opcode, request_id):
        """Sends ``frame``, reads the reply; raises its error (vovp.errors), else returns the
        reply frame and the position of its body."""
        self.sock.sendall(frame)
        data, _ = self._read()
        return data, self.P.check_reply(data, opcode, request_id)

    def contains(self, name: str, request_id=1000) -> bool:
        P = self.P
        data, pos = self.roundtrip(P.frame(P.CONTAINS, request_id, P.enc_str(name.encode())),
                                   P.CONTAINS, request_id)
        return bool(data[pos])

    def close(self):
        self.sock.close()


# One node of the multi-node test clusters: two CPUs, a small Ray object store, loopback.
CLUSTER_NODE_ARGS = dict(num_cpus=2, object_store_memory=80 << 20, node_ip_address="127.0.0.1")


def module_cluster(prefix: str, memory: str):
    """A module-scoped ``cluster`` fixture for a test module: ``local_ray_cluster`` of three
    ``CLUSTER_NODE_ARGS`` nodes (``memory`` per store, 10 s stall timeout). It also has the
    module's functions pickled by value, since the Ray workers that run them cannot import a
    test module."""
    import pytest
    from ray import cloudpickle

    @pytest.fixture(scope="module", name="cluster")
    def cluster(request):
        cloudpickle.register_pickle_by_value(request.module)
        with local_ray_cluster(3, CLUSTER_NODE_ARGS, prefix, memory=memory,
                               stall_timeout=10.0) as c:
            yield c

    return cluster


@contextlib.contextmanager
def local_ray_cluster(nodes: int, node_args: dict, prefix: str, **init_args):
    """A Ray cluster of a head and ``nodes - 1`` more nodes on this machine
    (``ray.cluster_utils.Cluster``, fast health checks so that a removed node is noticed in
    about 2 s), joined by this process and given vovp stores by ``vovp.cluster.init`` (sockets
    in a fresh directory, ``cluster.vovp_dir``; ``init_args`` passed on, ``"{dir}"`` in a
    string replaced by that directory). Everything stops when the block ends."""
    import ray
    from ray.cluster_utils import Cluster

    import vovp.cluster as vc
    from conftest import ENGINE

    import pytest

    if not ENGINE.is_file():
        pytest.fail(f"vovp-engine binary not found at {ENGINE}", pytrace=False)
    c = Cluster(initialize_head=True, connect=False, head_node_args=dict(
        node_args, include_dashboard=False, _system_config={"health_check_period_ms": 500,
                                   "health_check_failure_threshold": 4}))
    for _ in range(nodes - 1):
        c.add_node(**node_args)
    port = c.address.rsplit(":", 1)[1]
    sock_dir = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    try:
        ray.init(address=f"127.0.0.1:{port}")
        c.wait_for_nodes()
        args = {k: v.replace("{dir}", sock_dir) if isinstance(v, str) else v
                for k, v in init_args.items()}
        vc.init(socket=os.path.join(sock_dir, "{node}.sock"), engine=str(ENGINE), **args)
        c.vovp_dir = sock_dir
        yield c
    finally:
        try:
            vc.shutdown()
        finally:
            ray.shutdown()
            c.shutdown()
            shutil.rmtree(sock_dir, ignore_errors=True)


def on_node(node, fn, *args):
    """Run ``fn(*args)`` in a Ray task pinned to ``node`` (a process there that reaches the
    node's store only through ``vovp.cluster``); its ObjectRef."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0, scheduling_strategy=(
        NodeAffinitySchedulingStrategy(node, soft=False)))(fn)
    return task.remote(*args)


def other_nodes():
    """Every alive Ray node but this process's."""
    import vovp.cluster as vc

    me = vc.node_id()
    return [n for n in vc.nodes() if n != me]
