"""The 3x-memory workload of issue 45, vovp against Ray's object store, side by side in one run
(run by ``vovp-bench --spill`` with the test venv's python; also by hand:
``python benches/spill.py MEMORY OBJECT DIR OUT.json``).

Each store gets the same memory (vovp ``-m``, Ray ``object_store_memory``) and spills to the
same disk (a directory under DIR: vovp ``--spill-dir``, Ray's filesystem spilling, which is on
by default; only its directory is set). The workload puts numpy arrays of OBJECT bytes, three
times the memory in all, dropping each reference at once, then gets every one back in the
order they were put (the oldest first: every get is a miss that restores) and checks its
bytes at a spread of positions. Reported: total time of each, and how many objects came back
intact (nothing may be lost in either).
"""

import json
import os
import sys
import time

import numpy as np


def arrays(memory: int, obj: int):
    n = 3 * memory // obj
    return n, obj // 8


def check(a, i: int, count: int) -> bool:
    idx = np.linspace(0, count - 1, 64, dtype=np.int64)
    return a.shape == (count,) and bool(np.all(a[idx] == i * 1_000_003 + idx))


def make(i: int, count: int):
    return np.arange(count, dtype=np.int64) + i * 1_000_003


def run_vovp(memory: int, obj: int, root: str) -> dict:
    import vovp

    n, count = arrays(memory, obj)
    with vovp.start_store(memory=memory, spill_dir=os.path.join(root, "vovp")) as store:
        c = vovp.Client(store.socket)
        t = time.perf_counter()
        for i in range(n):
            c.put_tensor(f"a{i}", make(i, count))
        c.sync()
        put_s = time.perf_counter() - t
        ok = 0
        t = time.perf_counter()
        for i in range(n):
            a = c.get_tensor(f"a{i}")
            ok += check(a, i, count)
            del a
        get_s = time.perf_counter() - t
        stats = c.stats()
    return {"objects": n, "intact": ok, "put_s": put_s, "get_s": get_s,
            "total_s": put_s + get_s, "spills": stats["spills"],
            "restores": stats["restores"], "evicted": stats["evicted_objects"]}


def run_ray(memory: int, obj: int, root: str) -> dict:
    import ray

    n, count = arrays(memory, obj)
    spill = os.path.join(root, "ray")
    os.makedirs(spill, exist_ok=True)
    ray.init(address="local", num_cpus=1, object_store_memory=memory,
             include_dashboard=False, log_to_driver=False,
             _system_config={"object_spilling_config": json.dumps(
                 {"type": "filesystem", "params": {"directory_path": spill}})})
    try:
        t = time.perf_counter()
        refs = [ray.put(make(i, count)) for i in range(n)]
        put_s = time.perf_counter() - t
        ok = 0
        t = time.perf_counter()
        for i, r in enumerate(refs):
            a = ray.get(r)
            ok += check(a, i, count)
            del a
        get_s = time.perf_counter() - t
    finally:
        ray.shutdown()
    return {"objects": n, "intact": ok, "put_s": put_s, "get_s": get_s,
            "total_s": put_s + get_s, "version": ray.__version__}


def main() -> None:
    memory, obj, root, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    result = {"memory": memory, "object": obj}
    for name, fn in (("vovp", run_vovp), ("ray", run_ray)):
        try:
            result[name] = fn(memory, obj, root)
        except Exception as e:  # noqa: BLE001 (reported: the other store still runs)
            result[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        print(name, result[name], flush=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
