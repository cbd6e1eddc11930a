"""State dicts across nodes (``vc.publish_state`` / ``vc.fetch_state``, ``_state``) and
DistTensor's pull over GATHER (``_dist``), on a real Ray cluster: a head and two nodes on
this machine, one cluster for the module. Work on a node runs in Ray tasks pinned there."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest
import ray
import torch

import vovp
import vovp.cluster as vc
from vovp import _native as N
from vovp.cluster import _state
from _helpers import module_cluster, on_node as on, other_nodes as others

cluster = module_cluster("vs-", memory="512M")


def digest(t) -> tuple[str, str, tuple[int, ...], str]:
    """(framework, dtype, shape, sha256 of the bytes) of a tensor."""
    if isinstance(t, torch.Tensor):
        flat = t.contiguous().reshape(-1)
        raw = flat.view(torch.uint8) if t.dtype != torch.bool else flat.to(torch.uint8)
        return "torch", str(t.dtype), tuple(t.shape), hashlib.sha256(
            raw.numpy().tobytes()).hexdigest()
    a = np.asarray(t)
    return "numpy", a.dtype.str, a.shape, hashlib.sha256(
        np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes()).hexdigest()


def fetched_digests(name, newer_than=None, timeout=30.0):
    s = vc.fetch_state(name, newer_than=newer_than, timeout=timeout)
    return s.version, [(k, *digest(v)) for k, v in s.items()]


def transfer_counters():
    return vc.client().transfer_info()[1]


def test_the_content_hash_is_the_copy_s():
    """The native copy hashes what it copies; the hash of a copy and of the bytes agree."""
    for n in (0, 1, 1000, (3 << 20) + 5):
        src = np.random.default_rng(n).integers(0, 255, n, dtype=np.uint8)
        dst = np.empty_like(src)
        h = N.copy_hashed(dst, src)
        assert np.array_equal(dst, src) and h == N.content_hash(src)
    a = np.zeros(4 << 20, np.uint8)
    b = a.copy()
    b[-1] = 1
    assert N.content_hash(a) != N.content_hash(b)
    # Many at once: each as alone; overlapping or out-of-range items are refused.
    srcs = [np.arange(n, dtype=np.float32) for n in (0, 3, 1 << 20, 100)]
    dst = np.zeros(8 << 20, np.uint8)
    offsets = [0, 64, 128, (4 << 20) + 128 + 64]
    hashes = N.copy_hashed_many(dst, offsets, srcs)
    for o, src, h in zip(offsets, srcs, hashes):
        assert h == N.content_hash(src) and dst[o:o + src.nbytes].tobytes() == src.tobytes()
    with pytest.raises(ValueError, match="overlap"):
        N.copy_hashed_many(dst, [0, 8], [srcs[2], srcs[1]])
    with pytest.raises(ValueError, match="past"):
        N.copy_hashed_many(dst, [(8 << 20) - 4], [srcs[1]])


def test_layout_round_trips_and_finds_unchanged_ranges():
    sd = {"a": np.arange(10, dtype=np.float32), "b": np.ones((3, 5)), "c": np.zeros(0)}
    planned, layout = _state._plan(sd)
    assert [e.offset % 64 for e in layout.entries] == [0, 0, 0]
    filled = layout._replace(version=3, entries=[e._replace(hash=i + 1)
                                                 for i, e in enumerate(layout.entries)])
    again = _state.layout_of_description(_state.describe(filled))
    assert again == filled
    changed = filled._replace(entries=[filled.entries[0]._replace(hash=99),
                                       *filled.entries[1:]])
    b = filled.entries[1]
    assert _state.unchanged_ranges(filled, changed) == [(b.offset, 128)]


def test_round_trip_numpy_and_torch_across_nodes(cluster):
    sd = {"emb": np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32),
          "w": torch.arange(12, dtype=torch.float64).reshape(3, 4),
          "bf": torch.randn(5, 7).to(torch.bfloat16),
          "mask": np.array([True, False, True]),
          "scalar": np.float64(2.5),
          "big_endian": np.arange(6, dtype=">i4"),
          "strided": np.arange(40, dtype=np.int16).reshape(5, 8)[:, ::2]}
    published = vc.publish_state("st-round", sd)
    assert published.version >= 1 and list(published) == list(sd)
    here = vc.fetch_state("st-round")
    assert isinstance(here["w"], torch.Tensor) and isinstance(here["emb"], np.ndarray)
    want = [(k, *digest(v)) for k, v in sd.items()]
    # Big-endian input is stored (and read back) little-endian: the same values.
    want = [(k, f, "<i4" if k == "big_endian" else d, s, h) for k, f, d, s, h in want]
    for node in others():
        version, got = ray.get(on(node, fetched_digests, "st-round"))
        assert version == published.version and got == want
    # zero-copy views of one object, kept alive by the views alone
    assert here["emb"].base is not None and not here["emb"].flags.writeable


def test_three_hundred_tensors_of_mixed_dtypes(cluster):
    rng = np.random.default_rng(5)
    dtypes = [np.float32, np.float16, np.int64, np.uint8, np.float64, np.int8, np.bool_]
    sd = {}
    for i in range(300):
        shape = tuple(int(d) for d in rng.integers(0, 40, size=i % 4))
        if i % 7 == 3:
            sd[f"layers.{i}.bf16"] = torch.randn(shape).to(torch.bfloat16)
        else:
            dt = dtypes[i % len(dtypes)]
            sd[f"layers.{i}.w"] = (rng.standard_normal(shape) * 50).astype(dt)
    v = vc.publish_state("st-300", sd).version
    want = [(k, *digest(t)) for k, t in sd.items()]
    for node in others():
        version, got = ray.get(on(node, fetched_digests, "st-300"))
        assert version == v and got == want


def fetch_and_count(name, newer_than):
    before = transfer_counters()
    s = vc.fetch_state(name, newer_than=newer_than, timeout=30)
    after = transfer_counters()
    return (s.version, {k: float(np.asarray(v, dtype=np.float64).sum()) for k, v in s.items()},
            after["bytes_received"] - before["bytes_received"],
            after["bytes_copied_from_base"] - before["bytes_copied_from_base"])


def test_a_new_version_sends_only_the_tensors_that_changed(cluster):
    rng = np.random.default_rng(7)
    sd = {f"t{i}": rng.standard_normal(64 << 10).astype(np.float32) for i in range(20)}
    v1 = vc.publish_state("st-delta", sd).version
    reader = others()[0]
    version, _, received, _ = ray.get(on(reader, fetch_and_count, "st-delta", None))
    assert version == v1 and received >= 20 * (256 << 10)
    sd["t3"] = sd["t3"] + 1
    sd["t17"] = sd["t17"] * 2
    v2 = vc.publish_state("st-delta", sd).version
    assert v2 > v1
    version, sums, received, from_base = ray.get(on(reader, fetch_and_count, "st-delta", v1))
    assert version == v2
    assert sums == {k: float(v.astype(np.float64).sum()) for k, v in sd.items()}
    changed = 2 * (256 << 10)
    table = len(_state.describe(_state.layout_of_object(
        np.asarray(vc.fetch("st-delta")))))
    assert changed <= received <= changed + table + 4096, (received, from_base)
    assert from_base == 18 * (256 << 10)


def follow(name, last, versions):
    """Fetch ``versions`` new versions of ``name``; every tensor of one must carry its tag."""
    seen = []
    while len(seen) < versions:
        s = vc.fetch_state(name, newer_than=last, timeout=60)
        tags = {float(np.asarray(t, dtype=np.float64).ravel()[0]) for t in s.values()}
        sums = {float(np.asarray(t, dtype=np.float64).mean()) for t in s.values()}
        assert len(tags) == 1 and sums == tags, (s.version, tags, sums)
        tag = tags.pop()
        assert s.version > last and tag == s.version, (s.version, tag)
        seen.append(s.version)
        last = s.version
        del s
    return seen


def write_versions(name, count, pause):
    versions = []
    for _ in range(count):
        # The tag is the version this publish will get: the directory numbers them, and only
        # this writer publishes the name.
        tag = float(versions[-1] + 1) if versions else float(vc.fetch_state(name).version + 1)
        sd = {f"p{i}": np.full(4096 * (i + 1), tag, np.float32) for i in range(8)}
        sd["t"] = torch.full((300,), tag, dtype=torch.float64)
        versions.append(vc.publish_state(name, sd).version)
        assert versions[-1] == tag
        time.sleep(pause)
    return versions


def test_readers_never_see_a_mixed_version(cluster):
    name = "st-tagged"
    sd = {f"p{i}": np.full(4096 * (i + 1), 1.0, np.float32) for i in range(8)}
    sd["t"] = torch.full((300,), 1.0, dtype=torch.float64)
    v0 = vc.publish_state(name, sd).version
    assert v0 == 1
    a, b = others()
    readers = [on(n, follow, name, v0, 5) for n in (a, b)]
    time.sleep(1.0)
    written = ray.get(on(a, write_versions, name, 12, 0.05))
    for seen in ray.get(readers):
        assert seen == sorted(seen) and all(v in written for v in seen)


def wait_newer(name, version):
    t0 = time.monotonic()
    s = vc.fetch_state(name, newer_than=version, timeout=30)
    return s.version, time.monotonic() - t0


def test_newer_than_waits_for_a_publish(cluster):
    v = vc.publish_state("st-wait", {"x": np.zeros(10)}).version
    pending = on(others()[0], wait_newer, "st-wait", v)
    time.sleep(1.5)
    ready, _ = ray.wait([pending], timeout=0)
    assert not ready
    v2 = vc.publish_state("st-wait", {"x": np.ones(10)}).version
    version, waited = ray.get(pending)
    assert version == v2 and waited >= 1.0


def test_publish_state_without_replace_refuses_a_published_name(cluster):
    vc.publish_state("st-once", {"x": np.zeros(3)}, replace=False)
    with pytest.raises(vovp.ObjectExists):
        vc.publish_state("st-once", {"x": np.ones(3)}, replace=False)


def pull_and_count(name, ids):
    t = vc.DistTensor(name)
    before = transfer_counters()["gathers"]
    rows = t.pull(ids)
    return rows, transfer_counters()["gathers"] - before


def test_dist_pull_gathers_rows_engine_to_engine(cluster):
    nodes = sorted(vc.nodes())
    t = vc.DistTensor("st-dist", (3000, 8), np.float32, nodes=nodes)
    full = np.arange(3000 * 8, dtype=np.float32).reshape(3000, 8)
    t.push(np.arange(3000), full)
    ids = np.random.default_rng(1).integers(0, 3000, 2000)
    ids[:4] = [2999, 0, 2999, 1500]  # repeats, every partition
    before = transfer_counters()["gathers"]
    rows = t.pull(ids)
    assert np.array_equal(rows, full[ids])
    me = vc.node_id()
    remote_parts = len({k for k in t.locate(ids)[0].tolist() if nodes[k] != me})
    assert transfer_counters()["gathers"] - before == remote_parts
    # From another node: same rows, through its engine's GATHERs.
    got, gathers = ray.get(on(others()[0], pull_and_count, "st-dist", ids))
    assert np.array_equal(got, full[ids]) and gathers == 2
    # No scratch object stays behind.
    assert not [o for o in vc.client().list() if "gather" in o["name"]]
    t.delete()
