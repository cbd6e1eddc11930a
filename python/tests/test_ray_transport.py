"""vovp as Ray's tensor transport (``@ray.method(tensor_transport="vovp")``) on a two-node Ray
cluster on this machine (``ray.cluster_utils.Cluster``: each node its own raylet, object store
and vovp-engine).

One cluster for the whole module. Senders and receivers are actors pinned to a node; what a
receiver got is reported back as plain numbers (sums, shapes, dtypes, whether it is a view of
its node's store), not as tensors.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import pytest
import ray
import torch
from ray import cloudpickle
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import vovp.cluster as vc
from conftest import ENGINE
from vovp.cluster._ray_transport import INLINE_BYTES

# Actors defined here run in Ray workers, which cannot import this test module: ship them by
# value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

NODE_ARGS = dict(num_cpus=2, object_store_memory=100 << 20, node_ip_address="127.0.0.1")

# Registered before the actor classes below: @ray.method checks the transport's name.
vc.register_transport()


@pytest.fixture(scope="module")
def cluster():
    if not ENGINE.is_file():
        pytest.fail(f"vovp-engine binary not found at {ENGINE}", pytrace=False)
    c = Cluster(initialize_head=True, connect=False, head_node_args=dict(
        NODE_ARGS, include_dashboard=False, _system_config={"health_check_period_ms": 500,
                                   "health_check_failure_threshold": 4}))
    c.add_node(**NODE_ARGS)
    port = c.address.rsplit(":", 1)[1]
    sock_dir = tempfile.mkdtemp(prefix="vrt-", dir="/tmp")
    try:
        ray.init(address=f"127.0.0.1:{port}")
        c.wait_for_nodes()
        vc.init(socket=os.path.join(sock_dir, "{node}.sock"), memory="256M",
                engine=str(ENGINE), stall_timeout=10.0)
        yield c
    finally:
        try:
            vc.shutdown()
        finally:
            ray.shutdown()
            c.shutdown()
            shutil.rmtree(sock_dir, ignore_errors=True)


def pinned(cls, node):
    return cls.options(num_cpus=0, max_restarts=0, scheduling_strategy=(
        NodeAffinitySchedulingStrategy(node, soft=False)))


@ray.remote
class Sender:
    @ray.method(tensor_transport="vovp")
    def make(self, shape, dtype, start=0):
        return pattern(shape, dtype, start)

    @ray.method(tensor_transport="vovp")
    def make_many(self, specs):
        """A list of tensors in a dict: Ray finds the tensors anywhere in the result."""
        return {"tensors": [pattern(*spec) for spec in specs], "label": "batch"}

    def held(self) -> int:
        from ray.experimental.rdt.util import get_tensor_transport_manager

        return get_tensor_transport_manager("VOVP").held_objects()

    def pid(self) -> int:
        return os.getpid()


# A receiver needs Ray's transfer thread (the "_ray_system" concurrency group), which Ray 2.60
# gives only actors with enable_tensor_transport=True or a tensor_transport method: without it
# a transfer queues behind the task waiting for it (ray-project/ray#66264).
@ray.remote(enable_tensor_transport=True)
class Receiver:
    def describe(self, value):
        """What arrived: per tensor (dtype, shape, sum as float64, from this node's store)."""
        tensors = value["tensors"] if isinstance(value, dict) else \
            value if isinstance(value, list) else [value]
        store = vc.client()
        out = []
        for t in tensors:
            out.append((str(t.dtype), tuple(t.shape), float(t.double().sum()),
                        vovp_lease(store, t)))
        return out

    def total(self, t):
        return float(t.double().sum())


def vovp_lease(store, t) -> bool:
    """Whether ``t`` is a view of the node's store (a reference this process holds)."""
    from vovp.client import find_lease

    return t.numel() == 0 or find_lease(t) is not None


def pattern(shape, dtype, start=0):
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float64) % 251 + start).to(dtype).reshape(shape)


def expected(shape, dtype, start=0, in_store=None):
    """What ``describe`` reports for ``pattern(shape, dtype, start)``; ``in_store``: whether
    it came through the store (default: when it is above the inline size by itself)."""
    t = pattern(shape, dtype, start)
    if in_store is None:
        in_store = t.numel() * t.element_size() > INLINE_BYTES
    return (str(t.dtype), tuple(t.shape), float(t.double().sum()), in_store or t.numel() == 0)


def nodes_of(cluster):
    head = vc.node_id()
    other = [n for n in vc.nodes() if n != head]
    return head, other[0]


def wait_store_empty(what="objects", timeout=20.0):
    """Every node's store back to zero ``what`` (objects, or used_bytes)."""
    deadline = time.monotonic() + timeout
    while True:
        per = {n: s[what] for n, s in vc.stats(per_node=True).items()}
        if all(v == 0 for v in per.values()):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"stores still hold {what}: {per}")
        time.sleep(0.2)


# Small ones travel inline (in Ray's metadata), the others through the stores.
SPECS = [((1000,), torch.float32), ((3, 5, 7), torch.int64), ((64, 64), torch.float16),
         ((17,), torch.bfloat16), ((2, 3), torch.uint8), ((4,), torch.bool), ((), torch.float64),
         ((0, 3), torch.float32), ((512, 1024), torch.float32), ((300, 301), torch.float64),
         ((1 << 17,), torch.bfloat16), ((3, 1 << 15), torch.int32), ((70000,), torch.uint8),
         ((9, 10000), torch.bool), ((200, 200), torch.float16)]


@pytest.mark.parametrize("where", ["same-node", "cross-node"])
def test_tensors_of_every_dtype_and_shape_arrive_from_the_store(cluster, where):
    head, other = nodes_of(cluster)
    sender = pinned(Sender, head).remote()
    receiver = pinned(Receiver, head if where == "same-node" else other).remote()
    for i, (shape, dtype) in enumerate(SPECS):
        ref = sender.make.remote(shape, dtype, i)
        assert ray.get(receiver.describe.remote(ref)) == [expected(shape, dtype, i)], \
            (shape, dtype)
    del ref
    assert wait_held(sender, 0)
    wait_store_empty("objects")


def test_lists_of_tensors_and_many_calls_in_flight(cluster):
    head, other = nodes_of(cluster)
    senders = [pinned(Sender, head).remote(), pinned(Sender, other).remote()]
    receivers = [pinned(Receiver, head).remote(), pinned(Receiver, other).remote()]
    specs = [((100, 10), torch.float32, 1), ((33,), torch.int32, 2), ((8, 8), torch.float64, 3),
             ((300, 100), torch.float32, 4)]  # 120 KiB in all: through the stores
    pending = []
    for i in range(40):  # every pairing, same node and across, all in flight at once
        ref = senders[i % 2].make_many.remote([(s, d, start + i) for s, d, start in specs])
        pending.append((i, receivers[(i // 2) % 2].describe.remote(ref)))
    del ref
    for i, result in pending:
        assert ray.get(result) == [expected(s, d, start + i, True) for s, d, start in specs], i
    for s in senders:
        assert wait_held(s, 0)
    wait_store_empty("objects")


def test_one_ref_to_two_receivers_on_a_node_moves_once_per_receiver_store(cluster):
    """Two receivers of one object on the other node: each gets it whole (the second shares
    the first's copy when it is still there, or pulls its own)."""
    head, other = nodes_of(cluster)
    sender = pinned(Sender, head).remote()
    receivers = [pinned(Receiver, other).remote() for _ in range(2)]
    ref = sender.make.remote((1 << 20,), torch.float32, 5)  # 4 MiB
    want = float(pattern((1 << 20,), torch.float32, 5).double().sum())
    assert ray.get([r.total.remote(ref) for r in receivers]) == [want, want]
    del ref
    assert wait_held(sender, 0)
    wait_store_empty("objects")


def test_driver_gets_a_result_with_ray_get(cluster):
    head, other = nodes_of(cluster)
    sender = pinned(Sender, other).remote()
    ref = sender.make.remote((256, 256), torch.float32, 7)
    t = ray.get(ref)
    assert torch.equal(t, pattern((256, 256), torch.float32, 7))
    del t, ref
    assert wait_held(sender, 0)
    wait_store_empty("objects")


def test_freed_when_ray_frees_the_ref_while_the_receiver_keeps_its_tensor(cluster):
    """Ray's free releases the sender's reference; a tensor a receiver still holds stays
    whole (the store keeps an object while anyone holds it), and goes with it."""
    head, _ = nodes_of(cluster)
    sender = pinned(Sender, head).remote()
    keeper = pinned(Keeper, head).remote()
    ref = sender.make.remote((1 << 18,), torch.float32, 9)
    ray.get(keeper.keep.remote(ref))
    del ref
    assert wait_held(sender, 0)
    assert ray.get(keeper.total.remote()) == float(
        pattern((1 << 18,), torch.float32, 9).double().sum())
    assert vc.stats()["objects"] == 1
    ray.get(keeper.drop.remote())
    wait_store_empty("objects")


@ray.remote(enable_tensor_transport=True)
class Keeper:
    def keep(self, t):
        self.t = t

    def total(self):
        return float(self.t.double().sum())

    def drop(self):
        del self.t
        vc.client().flush()


@pytest.mark.parametrize("where", ["same-node", "cross-node"])
def test_a_killed_sender_is_a_clear_error_and_its_objects_go_with_it(cluster, where):
    head, other = nodes_of(cluster)
    sender = pinned(Sender, head).remote()
    receiver = pinned(Receiver, head if where == "same-node" else other).remote()
    refs = [sender.make.remote((1 << 16,), torch.float32, i) for i in range(3)]
    ray.wait(refs, num_returns=len(refs), fetch_local=False)
    assert vc.stats()["objects"] == 3  # each result is in the sender's node store
    ray.kill(sender)
    wait_store_empty("objects")  # the store released what the dead process held
    start = time.monotonic()
    with pytest.raises(Exception) as caught:
        ray.get(receiver.describe.remote(refs[0]), timeout=60)
    assert time.monotonic() - start < 30, "a dead sender must fail fast, not hang"
    text = str(caught.value)
    assert "ObjectLost" in text or "died" in text, text
    # The receiver is fine afterwards.
    sender2 = pinned(Sender, head).remote()
    ref = sender2.make.remote((10,), torch.int64, 1)
    assert ray.get(receiver.describe.remote(ref)) == [expected((10,), torch.int64, 1)]
    del ref
    assert wait_held(sender2, 0)
    wait_store_empty("objects")


def test_a_sender_killed_during_a_large_cross_node_transfer(cluster):
    """Killed while the bytes stream: the receiver gets the tensor whole (the holder's agent
    holds what it offered) or a clear error, never a torn tensor; nothing stays behind."""
    head, other = nodes_of(cluster)
    sender = pinned(Sender, head).remote()
    receiver = pinned(Receiver, other).remote()
    shape = (16 << 20,)  # 64 MiB of float32
    ref = sender.make.remote(shape, torch.float32, 3)
    ray.wait([ref], fetch_local=False)
    result = receiver.total.remote(ref)
    time.sleep(0.05)
    ray.kill(sender)
    try:
        assert ray.get(result, timeout=60) == float(pattern(shape, torch.float32, 3)
                                                   .double().sum())
    except ray.exceptions.GetTimeoutError:
        pytest.fail("the receiver hung after its sender was killed")
    except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
        assert "ObjectLost" in str(e) or "died" in str(e), e
    del ref
    wait_store_empty("objects")


def test_every_store_back_to_zero_bytes_once_the_actors_are_gone(cluster):
    """Objects go with their last reference (above); what a client's puts were lent goes with
    the client: once the actors above are gone (their handles went out of scope), every store
    is empty, bytes included."""
    import gc

    gc.collect()
    vc.client().flush()
    wait_store_empty("objects")
    wait_store_empty("used_bytes", timeout=30.0)


def wait_held(sender, n, timeout=20.0) -> bool:
    deadline = time.monotonic() + timeout
    while ray.get(sender.held.remote()) != n:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
