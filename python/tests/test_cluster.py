"""vovp.cluster on a real Ray cluster: three Ray nodes on this machine
(``ray.cluster_utils.Cluster``, each with its own raylet, object store and vovp-engine).

One cluster for the whole module (Ray needs seconds to start); the test that removes a node
adds its own node first. Work on a node runs in Ray tasks pinned there: separate processes
that reach the node's store only through ``vovp.cluster``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import ray
import torch
from ray import cloudpickle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import vovp
import vovp.cluster as vc
from vovp.cluster import _api
from _helpers import local_ray_cluster
from conftest import PYTHON_DIR

# Tasks defined here run in Ray workers, which cannot import this test module: ship them by
# value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

NODE_ARGS = dict(num_cpus=2, object_store_memory=80 << 20, node_ip_address="127.0.0.1")


@pytest.fixture(scope="module")
def cluster():
    with local_ray_cluster(3, NODE_ARGS, "vc-", memory="256M", stall_timeout=10.0,
                           metrics_interval=1.0, spill_dir="{dir}/spill-{node}") as c:
        yield c


def on(node, fn, *args):
    """Run ``fn(*args)`` in a Ray task pinned to ``node``; its result."""
    task = ray.remote(num_cpus=0, max_retries=0, scheduling_strategy=(
        NodeAffinitySchedulingStrategy(node, soft=False)))(fn)
    return task.remote(*args)


def others(cluster):
    me = vc.node_id()
    return [n for n in vc.nodes() if n != me]


def fetch_and_report(name):
    t = vc.fetch(name, timeout=30)
    return type(t).__module__, np.asarray(t).tolist() if np.asarray(t).size < 64 else \
        float(np.asarray(t, dtype=np.float64).sum()), vc.agent_stats()["transfers"]


def plain_get(name):
    """Another process on the node, with a plain client of the node's store."""
    c = vovp.init_client(vc.client().path)
    return float(np.asarray(c.get_tensor(name), dtype=np.float64).sum())


def test_every_node_store_spills_to_a_directory_of_its_own(cluster):
    """``vovp.cluster.init(spill_dir=...)`` reaches every node's daemon, ``{node}`` making one
    directory per store (several nodes share this machine; a directory is one daemon's)."""
    for node in vc.nodes():
        assert os.path.isdir(os.path.join(cluster.vovp_dir, f"spill-{node[:12]}")), node
    assert vc.client().stats()["spill_failures"] == 0


def test_publish_here_fetch_there_then_local_by_name(cluster):
    a = np.arange(1 << 18, dtype=np.float32)  # 1 MiB
    vc.publish("w1", a)
    b = others(cluster)[0]
    before = vc.agent_stats(b)["transfers"]
    module, total, _ = ray.get(on(b, fetch_and_report, "w1"))
    assert module == "numpy" and total == float(a.sum())
    # A second process on b: its store has it, by name, with no second transfer.
    assert ray.get(on(b, plain_get, "w1")) == float(a.sum())
    assert ray.get(on(b, fetch_and_report, "w1"))[1] == float(a.sum())
    assert vc.agent_stats(b)["transfers"] == before + 1
    # The owner's engine served it.
    assert vc.agent_stats()["bytes_sent"] >= a.nbytes


def test_torch_in_torch_out_across_nodes(cluster):
    t = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    vc.publish("t1", t)
    module, values, _ = ray.get(on(others(cluster)[1], fetch_and_report, "t1"))
    assert module.startswith("torch")
    assert values == t.tolist()


def test_concurrent_fetches_on_one_node_make_one_transfer(cluster):
    a = np.random.default_rng(1).random(4 << 20)  # 32 MiB
    vc.publish("big", a)
    b = others(cluster)[0]
    before = vc.agent_stats(b)["transfers"]
    sent = vc.agent_stats()["bytes_sent"]
    results = ray.get([on(b, fetch_and_report, "big") for _ in range(4)])
    assert all(r[1] == pytest.approx(float(a.sum())) for r in results)
    assert vc.agent_stats(b)["transfers"] == before + 1
    assert vc.agent_stats()["bytes_sent"] == sent + a.nbytes  # the owner sent it once


def test_concurrent_fetches_on_one_node_share_one_transfer_in_the_engine(cluster):
    """Callers that overlap for sure: four ensure calls sent to one agent before the name is
    published all wait in the directory, then each sends FETCH to the node's engine, which
    makes one transfer of them."""
    b = others(cluster)[1]
    agent = _api.agent_actor(b)
    refs = [agent.ensure.remote("coalesce", 30) for _ in range(4)]
    time.sleep(0.5)  # they wait in the directory (wait_newer) until the publish
    sent = vc.agent_stats()["bytes_sent"]
    transfers = vc.agent_stats(b)["transfers"]
    a = np.arange(1 << 20, dtype=np.float64)
    vc.publish("coalesce", a)
    results = _api.call(refs, 60)
    assert all(r["transferred"] and r["version"] == results[0]["version"] for r in results)
    assert vc.agent_stats(b)["transfers"] == transfers + 1
    assert vc.agent_stats()["bytes_sent"] == sent + a.nbytes


def test_fetch_waits_for_publish_and_times_out(cluster):
    b = others(cluster)[0]
    ref = on(b, fetch_and_report, "late")
    time.sleep(0.5)
    vc.publish("late", np.ones(10))
    assert ray.get(ref)[1] == [1.0] * 10
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        vc.fetch("never", timeout=1.0)
    assert time.monotonic() - t0 < 10
    with pytest.raises(vovp.ObjectNotFound):
        vc.fetch("never")


def test_publish_twice_is_object_exists_and_unpublish_removes_everywhere(cluster):
    vc.publish("u1", np.zeros(4))
    b, c = others(cluster)
    ray.get(on(b, fetch_and_report, "u1"))
    # From a node without a copy: the directory, not its store, refuses; nothing stays there.
    with pytest.raises(vovp.ObjectExists):
        ray.get(on(c, vc.publish, "u1", np.ones(4)))
    assert not ray.get(on(c, lambda: vc.client().contains("u1")))
    assert vc.unpublish("u1")
    assert "u1" not in vc.names()
    assert not ray.get(on(b, lambda: vc.client().contains("u1")))
    assert not vc.client().contains("u1")
    vc.publish("u1", np.ones(4))  # the name is free again
    assert ray.get(on(b, fetch_and_report, "u1"))[1] == [1.0] * 4


def test_broadcast_reaches_every_node_without_the_owner_sending_each(cluster):
    a = np.arange(1 << 20, dtype=np.float32)
    vc.publish("bc", a)
    before = {n: vc.agent_stats(n) for n in vc.nodes()}
    got = vc.broadcast("bc")
    assert sorted(got) == sorted(others(cluster))
    for n in vc.nodes():
        assert ray.get(on(n, lambda: vc.client().contains("bc")))
        after = vc.agent_stats(n)
        if n != vc.node_id():
            assert after["transfers"] == before[n]["transfers"] + 1
    assert vc.broadcast("bc") == []  # nothing left to send


def test_broadcast_tree_relays_through_nodes_that_received_it(cluster):
    a = np.arange(1 << 16, dtype=np.float64)
    vc.publish("bc-tree", a)
    first, second = others(cluster)
    before = {n: vc.agent_stats(n)["bytes_sent"] for n in vc.nodes()}
    # fanout=1: the owner sends to one node, which sends on to the next.
    assert vc.broadcast("bc-tree", nodes=[first, second], fanout=1) == [first, second]
    after = {n: vc.agent_stats(n)["bytes_sent"] for n in vc.nodes()}
    assert after[vc.node_id()] == before[vc.node_id()] + a.nbytes
    assert after[first] == before[first] + a.nbytes
    assert ray.get(on(second, fetch_and_report, "bc-tree"))[1] == float(np.arange(1 << 16).sum())


def test_stats_sum_the_nodes_and_agents_report_them_to_ray_metrics(cluster):
    here, b = vc.node_id(), others(cluster)[0]
    before = vc.stats(per_node=True)
    vc.publish("metered", np.ones(1 << 16, np.uint8))
    assert ray.get(on(b, fetch_and_report, "metered"))[2] == before[b]["transfers"] + 1
    per = vc.stats(per_node=True)
    total = vc.stats()
    assert total["nodes"] == len(per) == len(vc.nodes())
    for field in ("capacity", "transfers", "bytes_received", "bytes_sent", "creates"):
        assert total[field] == sum(p[field] for p in per.values()), field
    assert total["capacity"] == len(per) * (256 << 20)
    assert per[b]["transfers"] == before[b]["transfers"] + 1
    assert per[b]["bytes_received"] == before[b]["bytes_received"] + (1 << 16)
    assert per[b]["objects"] >= 1 and per[here]["objects"] >= 1
    assert per[here]["bytes_sent"] == before[here]["bytes_sent"] + (1 << 16)
    # Each agent reports the same numbers through ray.util.metrics on its timer (1 s here).
    agent = _api.agent_actor(b)

    def reported():
        r = ray.get(agent.reported.remote())
        return r.get("transfers") == per[b]["transfers"] and "used_bytes" in r

    deadline = time.monotonic() + 30
    while not reported():
        assert time.monotonic() < deadline, ray.get(agent.reported.remote())
        time.sleep(0.2)
    vc.unpublish("metered")


def test_dist_tensor_pull_push_across_partitions(cluster):
    n, d = 1000, 4
    ref = np.zeros((n, d), np.float32)
    for partition in ("range", np.random.default_rng(2).integers(0, 3, n)):
        name = f"feat-{type(partition).__name__}"
        t = vc.DistTensor(name, (n, d), np.float32, partition=partition)
        ids = np.random.default_rng(3).permutation(n)
        rows = np.random.default_rng(4).random((n, d), dtype=np.float32)
        t.push(ids, rows)
        expect = ref.copy()
        expect[ids] = rows
        q = np.random.default_rng(5).integers(0, n, 300)
        assert np.array_equal(t.pull(q), expect[q])
        # add with repeated ids, from another node's process
        add_ids = np.array([0, 0, n - 1, 500, 500, 500])
        ray.get(on(others(cluster)[0], _push_add, name, add_ids))
        np.add.at(expect, add_ids, np.ones((len(add_ids), d), np.float32))
        assert np.array_equal(t[np.arange(n)], expect)
        # a handler, DistDGL-style
        t.push([7, 8], np.full((2, d), 2, np.float32), op=_times)
        expect[[7, 8]] *= 2
        assert np.array_equal(t.pull([8, 7]), expect[[8, 7]])
        # each node's trainers read their rows zero-copy from their own store
        for node in vc.nodes():
            local_ids, local = ray.get(on(node, _local_rows, name))
            assert np.array_equal(local, expect[local_ids])
        t.delete()


def _push_add(name, ids):
    t = vc.DistTensor(name)
    t.push(ids, np.ones((len(ids), t.shape[1]), t.dtype), op="add")


def _times(target, name, ids, rows):
    target[name][ids] *= rows


def _local_rows(name):
    t = vc.DistTensor(name)
    return t.local_ids(), np.array(t.local_partition())


def test_dist_tensor_torch_and_bad_ids(cluster):
    t = vc.DistTensor("ft", (10, 2), torch.float32)
    t[torch.tensor([1, 9])] = torch.ones(2, 2)
    out = t[torch.tensor([9, 0])]
    assert isinstance(out, torch.Tensor) and out.tolist() == [[1, 1], [0, 0]]
    with pytest.raises(IndexError):
        t.pull([10])
    with pytest.raises(vovp.InvalidArgument):
        t.push([1], np.ones((2, 2)))
    t.delete()


def test_node_removed_is_object_lost_promptly(cluster):
    extra = cluster.add_node(**NODE_ARGS)
    cluster.wait_for_nodes()
    node = extra.node_id
    ray.get(on(node, vc.publish, "doomed", np.arange(100)))
    ray.get(on(node, vc.publish, "kept", np.arange(5)))
    vc.fetch("kept")  # a copy on the head
    rows = vc.DistTensor("split", (10, 2), np.float32, nodes=[vc.node_id(), node])
    rows[[0, 9]] = np.ones((2, 2), np.float32)
    cluster.remove_node(extra)
    t0 = time.monotonic()
    with pytest.raises(vovp.ObjectLost, match=node):
        vc.fetch("doomed", timeout=30)
    assert time.monotonic() - t0 < 15
    # The rows on the dead node are lost, by name of the node; the head's are not.
    with pytest.raises(vovp.ObjectLost, match=node):
        rows.pull([0, 9])
    assert rows.pull([0]).tolist() == [[1.0, 1.0]]
    assert np.array_equal(vc.fetch("kept"), np.arange(5))
    # A node that (re)joins gets a new agent and an empty store.
    again = cluster.add_node(**NODE_ARGS)
    cluster.wait_for_nodes()
    assert ray.get(on(again.node_id, lambda: vc.client().list())) == []
    assert ray.get(on(again.node_id, fetch_and_report, "kept"))[1] == list(range(5))


def test_owner_dying_mid_transfer_is_object_lost_and_leaves_nothing(cluster):
    """The holder's engine on node D is frozen (SIGSTOP), the head's engine is asked to fetch
    from it (the holder's kernel accepts the connection; no byte comes), D is removed and its
    engine killed: the transfer breaks, the fetch fails with ObjectLost naming D, and the
    head's store has no trace of the object."""
    extra = cluster.add_node(**NODE_ARGS)
    cluster.wait_for_nodes()
    d = extra.node_id
    # Made on d: an argument that large would not fit the nodes' small Ray object stores.
    ray.get(on(d, _publish_ones, "inflight", 96 << 20))
    here = vc.client()
    engine = ray.get(_api.agent_actor(d).info.remote())["engine_pid"]
    os.kill(engine, signal.SIGSTOP)
    try:
        ref = _api.agent_actor(vc.node_id()).ensure.remote("inflight", 60)
        time.sleep(0.5)  # the FETCH is waiting for the frozen holder
        cluster.remove_node(extra)
    finally:
        try:
            os.kill(engine, signal.SIGKILL)  # what its node's end does to it
        except ProcessLookupError:
            pass
    with pytest.raises(vovp.ObjectLost, match=d):
        _api.call(ref, 30)
    assert not any(e["name"] == "inflight" for e in here.list())
    with pytest.raises(vovp.ObjectLost):
        vc.fetch("inflight", timeout=10)


def _publish_ones(name, n):
    vc.publish(name, np.ones(n, np.uint8))


@pytest.mark.parametrize("example", ["cluster_weights.py", "dist_features.py"])
def test_examples_run_on_the_cluster(cluster, example):
    """The README's examples, as a user runs them, joined to this module's cluster."""
    port = cluster.address.rsplit(":", 1)[1]
    env = dict(os.environ, PYTHONPATH=str(PYTHON_DIR), RAY_ADDRESS=f"127.0.0.1:{port}")
    p = subprocess.run([sys.executable, str(PYTHON_DIR.parent / "examples" / example)],
                       capture_output=True, text=True, env=env, timeout=180, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip()


def test_import_without_ray_says_how_to_install():
    code = "import sys; sys.modules['ray'] = None; import vovp.cluster"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(PYTHON_DIR)))
    assert p.returncode != 0
    assert 'pip install "vovp[cluster]"' in p.stderr
