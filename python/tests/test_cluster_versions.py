"""Versioned names across a real Ray cluster (``ray.cluster_utils.Cluster``: a head and two
nodes on this machine, one cluster for the module): ``publish(replace=True)``,
``fetch(newer_than=...)``, the engines' FETCH as the data path, failures, many waiters.

Every version a test writes is tagged and checksummed: element 0 is its tag, the rest is
``tag + arange``, so a torn, mixed or wrong version fails ``check``.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time

import numpy as np
import pytest
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import vovp
import vovp.cluster as vc
from vovp.cluster import _api
from _helpers import CLUSTER_NODE_ARGS, module_cluster, on_node as on, other_nodes as others

cluster = module_cluster("vcv-", memory="256M")


def tagged(tag, n):
    a = np.arange(n, dtype=np.int64) + tag
    a[0] = tag
    return a


def check(a):
    """The tag of a whole version; AssertionError for a torn or mixed one."""
    a = np.asarray(a)
    tag = int(a[0])
    assert np.array_equal(a[1:], np.arange(1, len(a), dtype=np.int64) + tag), "torn version"
    return tag


def follow(name, until_tag, timeout=60):
    """A reader: every version newer than the one it holds, until tag ``until_tag``;
    [(version, tag)] in the order read."""
    v, seen = 0, []
    while True:
        w = vc.fetch(name, newer_than=v, timeout=timeout)
        version = vc.version_of(w)
        assert version > v, (version, v)
        v = version
        tag = check(w)
        seen.append((version, tag))
        if tag >= until_tag:
            return seen


def test_replace_is_the_next_version_everywhere(cluster):
    b, c = others()
    first = vc.publish("w", tagged(1, 1000))
    v1 = vc.version_of(first)
    with pytest.raises(vovp.ObjectExists):  # without replace: as before
        vc.publish("w", tagged(2, 1000))
    got = ray.get(on(b, lambda: (vc.version_of(vc.fetch("w")), check(vc.fetch("w")))))
    assert got == (v1, 1)
    second = vc.publish("w", tagged(2, 1000), replace=True)
    v2 = vc.version_of(second)
    assert v2 == v1 + 1
    # A reader on b holds v1; newer_than gives v2 there and on c; plain vovp.version_of agrees.
    for node in (b, c):
        version, tag = ray.get(on(node, lambda: (lambda t: (vovp.version_of(t), check(t)))(
            vc.fetch("w", newer_than=v1, timeout=30))))
        assert (version, tag) == (v2, 2)
    # A replace from another node: the versions go on from there.
    v3 = ray.get(on(c, lambda: vc.version_of(vc.publish("w", tagged(3, 1000),
                                                          replace=True))))
    assert v3 == v2 + 1
    assert check(vc.fetch("w", newer_than=v2, timeout=30)) == 3
    assert vc.unpublish("w")


def test_publish_of_an_object_already_stored_here_keeps_its_version(cluster):
    b = others()[0]
    obj = vc.client().put_tensor("stored", tagged(4, 100))
    v = vovp.version_of(obj)
    assert vc.publish("stored") is None
    assert ray.get(on(b, lambda: (lambda t: (vovp.version_of(t), check(t)))(
        vc.fetch("stored")))) == (v, 4)
    with pytest.raises(vovp.ObjectExists):
        vc.publish("stored")
    vc.unpublish("stored")


def test_fetch_newer_than_waits_for_the_publish_and_times_out(cluster):
    b = others()[0]
    v = vc.version_of(vc.publish("wait", tagged(1, 100)))
    ref = on(b, lambda: check(vc.fetch("wait", newer_than=v, timeout=30)))
    time.sleep(1.0)
    ready, _ = ray.wait([ref], timeout=0)
    assert not ready  # waiting in the directory, not answered with the version it has
    vc.publish("wait", tagged(2, 100), replace=True)
    assert ray.get(ref) == 2
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        vc.fetch("wait", newer_than=v + 1, timeout=1.0)
    assert time.monotonic() - t0 < 10
    with pytest.raises(vovp.ObjectNotFound):
        vc.fetch("wait", newer_than=v + 1)  # no timeout: no wait


def test_racing_replaces_get_distinct_versions_and_the_newest_stays(cluster):
    nodes = vc.nodes()
    per_writer = 10

    def write(k):
        return [vc.version_of(vc.publish("race", tagged(k * 100 + i, 64), replace=True))
                for i in range(per_writer)]

    results = ray.get([on(n, write, k) for k, n in enumerate(nodes)])
    versions = [v for r in results for v in r]
    assert len(set(versions)) == len(versions)  # nobody's version was lost or reused
    for r in results:
        assert r == sorted(r)
    newest = max(versions)
    for node in nodes:  # the newest committed version is what everyone fetches now
        assert ray.get(on(node, lambda: vc.version_of(
            vc.fetch("race", newer_than=newest - 1, timeout=30)))) == newest
    vc.unpublish("race")


def test_readers_never_see_torn_mixed_or_older_versions(cluster):
    b, c = others()
    n = 512 << 10  # 4 MiB of int64
    steps = 30
    vc.publish("stream", tagged(0, n), replace=True)
    readers = [on(node, follow, "stream", steps) for node in (b, c)]
    for step in range(1, steps + 1):
        vc.publish("stream", tagged(step, n), replace=True)
        time.sleep(0.01)
    for seen in ray.get(readers):
        versions = [v for v, _ in seen]
        tags = [t for _, t in seen]
        assert versions == sorted(set(versions)) and tags == sorted(set(tags))
        assert tags[-1] == steps
    vc.unpublish("stream")


def _hold_and_measure(name, v):
    """A reader that keeps the version it holds; this node's used bytes."""
    w = vc.fetch(name, newer_than=v - 1, timeout=30)
    check(w)
    return vc.client().stats()["used_bytes"]


def test_old_versions_go_with_their_last_holder(cluster):
    """Many replaces with readers following on two other nodes leave at most two versions'
    memory per node (the one held, the newest)."""
    b, c = others()
    n = 128 << 10  # 1 MiB
    size = n * 8
    base = {node: vc.stats(per_node=True)[node]["used_bytes"] for node in vc.nodes()}
    steps = 100
    readers = [on(node, follow, "mem", steps) for node in (b, c)]
    held = None
    for step in range(steps + 1):
        held = vc.publish("mem", tagged(step, n), replace=True)  # the writer holds its newest
    for seen in ray.get(readers):
        assert seen[-1][1] == steps
    v = vc.version_of(held)
    # A reader on each node holds the newest while the old ones are gone.
    used = dict(zip((b, c), ray.get([on(node, _hold_and_measure, "mem", v)
                                     for node in (b, c)])))
    per = vc.stats(per_node=True)
    for node in vc.nodes():
        now = used.get(node, per[node]["used_bytes"])
        assert now - base[node] <= 2 * size + (1 << 20), (node, now - base[node])
    vc.unpublish("mem")


def test_broadcast_pushes_the_newest_version(cluster):
    vc.publish("bcv", tagged(1, 1000))
    vc.broadcast("bcv")
    v2 = vc.version_of(vc.publish("bcv", tagged(2, 1000), replace=True))
    assert sorted(vc.broadcast("bcv")) == sorted(others())
    for node in others():
        # Already in the node's store: a plain local get of the name gives the new version.
        version, tag = ray.get(on(node, lambda: (lambda t: (vovp.version_of(t), check(t)))(
            vc.client().get_tensor("bcv"))))
        assert (version, tag) == (v2, 2)
    vc.unpublish("bcv")


def test_a_late_holder_of_an_unpublished_name_is_told_to_delete_its_copy(cluster):
    """A fetch that completes after an unpublish tells the directory (not awaited) that its
    node holds the version; the directory has that node's agent delete the copy."""
    b = others()[0]
    v = vc.version_of(vc.publish("late", tagged(1, 100)))
    vc.unpublish("late")
    # What a fetch racing the unpublish leaves on b: the version in b's store, then add_holder.
    ray.get(on(b, lambda: _api.put_version(vc.client(), "late", tagged(1, 100), v, False)
               and None))
    assert ray.get(on(b, lambda: vc.client().contains("late")))
    assert _api.call(_api.directory_actor().add_holder.remote("late", b, v), 30) == "gone"
    deadline = time.monotonic() + 10
    while ray.get(on(b, lambda: vc.client().contains("late"))):
        assert time.monotonic() < deadline
        time.sleep(0.1)


@ray.remote(num_cpus=0)
class Reader:
    """A process on one node that keeps its location cache between fetches."""

    def fetch_and_drop(self, name, newer_than):
        """(version, tag, the store's refcount of ``name`` once the result is dropped), with
        the cyclic garbage collector off: only plain reference counting frees the result."""
        gc.disable()
        try:
            w = vc.fetch(name, newer_than=newer_than, timeout=30)
            version, tag = vc.version_of(w), check(w)
            del w
            held = {o["name"]: o["refcount"] for o in vc.client().list()}
            return version, tag, held.get(name)
        finally:
            gc.enable()


def test_a_fetch_past_a_failed_holder_keeps_no_reference(cluster):
    """After an unpublish and a new publish of the name, a reader's location cache still
    names the old version: its FETCH fails, the walk goes on to the new one. The failure it
    keeps (for its error) must not keep the fetched tensor alive after the caller drops it
    (a traceback's frame holding it in a cycle, freed only by the cyclic GC): readers of a
    weight-sync loop that unpublishes ran their node out of memory."""
    b = others()[0]
    reader = Reader.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        b, soft=False)).remote()
    failed = vc.agent_stats(b)["transfers_failed"]
    v1 = vc.version_of(vc.publish("refetch", tagged(1, 1000)))
    assert ray.get(reader.fetch_and_drop.remote("refetch", 0)) == (v1, 1, 0)
    vc.unpublish("refetch")
    # The reader asks before the next publish: its cached holder has nothing then.
    fetched = reader.fetch_and_drop.remote("refetch", 0)
    time.sleep(1.0)
    v2 = vc.version_of(vc.publish("refetch", tagged(2, 1000)))
    assert ray.get(fetched) == (v2, 2, 0)
    assert vc.agent_stats(b)["transfers_failed"] > failed  # the path this test is about
    vc.unpublish("refetch")
    ray.kill(reader)


def _publish(name, tag):
    vc.publish(name, tagged(tag, 1000))


def _reserve_put_and_die(name, tag):
    """A writer that dies between its put and its commit."""
    v = _api.reserve(name, True)
    _api.put_version(vc.client(), name, tagged(tag, 1000), v, True)
    os.kill(os.getpid(), signal.SIGKILL)


def test_writer_dying_mid_replace_and_holder_node_dying(cluster):
    """A writer dying between reserve and commit leaves the previous version current on every
    node; its node dying too changes nothing for the others. A holder node that dies is
    skipped (the next holder serves) and, with no holder left, the fetch is ObjectLost naming
    it."""
    b, c = others()
    extra = cluster.add_node(**CLUSTER_NODE_ARGS)
    cluster.wait_for_nodes()
    e = extra.node_id
    ray.get(on(e, _publish, "crash", 1))
    v1 = ray.get(on(b, lambda: vc.version_of(vc.fetch("crash"))))  # b holds v1 too
    with pytest.raises(ray.exceptions.RayError):
        ray.get(on(e, _reserve_put_and_die, "crash", 2))
    for node in (b, c):  # the half-made version is nowhere else, and nobody waits forever
        assert ray.get(on(node, lambda: check(vc.fetch("crash")))) == 1
        with pytest.raises(TimeoutError):
            ray.get(on(node, lambda: vc.fetch("crash", newer_than=v1, timeout=1.0)))
    ray.get(on(e, _publish, "only-e", 7))
    cluster.remove_node(extra)
    # c has no copy: it fetches v1 from b (e is dead: skipped, dropped from the directory).
    t0 = time.monotonic()
    assert ray.get(on(c, lambda: check(vc.fetch("crash", timeout=30)))) == 1
    assert time.monotonic() - t0 < 20
    with pytest.raises(vovp.ObjectLost, match=e):
        vc.fetch("only-e", timeout=30)
    # The next replace goes on after the dead writer's reserved number.
    v3 = vc.version_of(vc.publish("crash", tagged(3, 1000), replace=True))
    assert v3 == v1 + 2
    assert ray.get(on(c, lambda: check(vc.fetch("crash", newer_than=v1, timeout=30)))) == 3
    vc.unpublish("crash")


@ray.remote(num_cpus=0, max_concurrency=200)
class Waiter:
    def wait(self, name, v):
        w = vc.fetch(name, newer_than=v, timeout=120)
        return vc.version_of(w), check(w)

    def ready(self):
        vc.client()
        return vc.node_id()


def test_a_thousand_waits_from_many_processes_then_one_publish(cluster):
    """1,000 newer_than waits (10 processes x 100 threads, on every node) hold nothing but a
    suspended coroutine each in the directory: an unrelated fetch answers in milliseconds
    meanwhile, and one publish releases them all."""
    nodes = vc.nodes()
    v = vc.version_of(vc.publish("many", tagged(1, 64)))
    procs = 10
    waiters = [Waiter.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        nodes[k % len(nodes)], soft=False)).remote() for k in range(procs)]
    ray.get([w.ready.remote() for w in waiters])
    refs = [w.wait.remote("many", v) for w in waiters for _ in range(100)]
    time.sleep(3.0)  # every wait reaches the directory
    ready, _ = ray.wait(refs, timeout=0)
    assert not ready
    b = others()[0]
    vc.publish("unrelated", tagged(5, 64))
    times = ray.get(on(b, _timed_fetches, "unrelated"))
    assert min(times) < 0.05, times  # a control message and a transfer, not a queue
    vc.publish("many", tagged(2, 64), replace=True)
    got = ray.get(refs, timeout=120)
    assert len(got) == 1000 and set(got) == {(v + 1, 2)}
    for w in waiters:
        ray.kill(w)
    vc.unpublish("many")
    vc.unpublish("unrelated")


def _timed_fetches(name):
    times = []
    for i in range(3):
        t0 = time.perf_counter()
        if i == 0:
            vc.fetch(name, timeout=10)
        else:
            vc.client().get_tensor(name)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    vc.names()
    times.append(time.perf_counter() - t0)  # a directory round trip
    return times[:1] + times[3:]


def test_a_daemon_without_transfer_is_an_error_naming_the_flag(tmp_path):
    """``init(start=False)`` with a daemon the user runs without ``--transfer``."""
    from vovp.cluster._agent import Agent

    with vovp.start_store("32M", socket=str(tmp_path / "s.sock")):
        config = {"socket": str(tmp_path / "s.sock"), "start": False}
        with pytest.raises(vovp.VovpError, match="--transfer"):
            Agent("n" * 56, config)


def test_version_of_is_vovp_version_of():
    assert vc.version_of is vovp.version_of


def test_a_gone_directory_is_a_clear_error_not_a_hang(cluster):
    """The directory's actor dies (as it does with the head node; removing a
    ``ray.cluster_utils`` head takes Ray's GCS and this driver with it, so the actor is
    killed instead): a fetch that waits, and one that does not, fail at once with a VovpError
    naming the directory. Last in the module: nothing after it has a directory."""
    ray.kill(_api.directory_actor())
    for kwargs in ({"newer_than": 0, "timeout": 30.0}, {}):
        t0 = time.monotonic()
        with pytest.raises(vovp.VovpError, match="vovp directory"):
            vc.fetch("nowhere", **kwargs)
        assert time.monotonic() - t0 < 10
