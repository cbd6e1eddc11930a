"""Spilling from Python (issue 45): ``vovp.start_store(spill_dir=...)`` keeps every object of
a store three times over full, readable bit-exact from other processes in any order;
``list()`` and ``stats()`` show what is on disk; a damaged spill file raises
``vovp.SpillDamaged`` naming the object, never wrong bytes."""

import multiprocessing as mp
import os
import random

import numpy as np
import pytest

import vovp

MIB = 1 << 20


def _array(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 1 << 30, size=(2 * MIB) // 4, dtype=np.int32)


def _read_all(socket: str, order: list, out) -> None:
    client = vovp.Client(socket)
    bad = [i for i in order if not np.array_equal(client.get_tensor(f"a{i}"), _array(i))]
    out.put(bad)


def test_a_store_three_times_over_full_gives_everything_back(tmp_path):
    spill = tmp_path / "spill"
    with vovp.start_store(memory="32M", spill_dir=str(spill)) as store:
        client = vovp.Client(store.socket)
        n = 48  # 96 MiB in a 32 MiB store
        for i in range(n):
            client.put_tensor(f"a{i}", _array(i))
        client.sync()
        listed = client.list()
        assert len(listed) == n
        assert sum(e["spilled"] for e in listed) > n // 2
        stats = client.stats()
        assert stats["spilled_objects"] > n // 2 and stats["spill_failures"] == 0
        assert stats["evicted_objects"] == 0
        assert len(os.listdir(spill)) >= stats["spilled_objects"]
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        orders = [random.Random(p).sample(range(n), n) for p in range(2)]
        procs = [ctx.Process(target=_read_all, args=(store.socket, o, out)) for o in orders]
        for p in procs:
            p.start()
        assert [out.get(timeout=120) for _ in procs] == [[], []]
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        stats = client.stats()
        assert stats["restores"] > 0 and stats["restore_failures"] == 0
    assert not any(f.endswith(".spill") for f in os.listdir(spill))


def test_a_damaged_spill_file_raises_spill_damaged(tmp_path):
    spill = tmp_path / "spill"
    with vovp.start_store(memory="16M", spill_dir=str(spill), spill_max="64M") as store:
        client = vovp.Client(store.socket)
        for i in range(12):
            client.put_tensor(f"a{i}", _array(i))
        client.sync()
        files = sorted(f for f in os.listdir(spill) if f.endswith(".spill"))
        assert files
        # The oldest object's file (ids grow with each put): a data byte flipped.
        path = spill / files[0]
        raw = bytearray(path.read_bytes())
        raw[4096 + 10] ^= 1
        path.write_bytes(bytes(raw))
        with pytest.raises(vovp.SpillDamaged, match="a0"):
            client.get_tensor("a0")
        assert isinstance(vovp.SpillDamaged("x"), vovp.ObjectLost)
        with pytest.raises(vovp.ObjectNotFound):
            client.get_tensor("a0", timeout=0.1)
        assert client.stats()["restore_failures"] == 1


def test_spill_max_needs_a_directory():
    with pytest.raises(vovp.InvalidArgument):
        vovp.start_store(memory="16M", spill_max="1G")
