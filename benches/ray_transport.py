"""vovp as Ray's tensor transport against Ray's own ways, side by side in one run (issue 47).

An actor returns a torch tensor to another actor: ``@ray.method`` results sent with
``tensor_transport="vovp"``, with Ray's default (the object store) and with Ray's "gloo"
transport (a torch_gloo collective group per sender/receiver pair). Same node (both actors on
the head) and across nodes (the receiver on the second node of a local
``ray.cluster_utils.Cluster``: its own raylet, Ray object store and vovp-engine).

Each figure is the median wall time, seen from the driver, of ``ray.get(consumer.take.remote(
producer.make.remote(n)))``: the producer returns a tensor it made once (so no allocation is
timed), the consumer has it in hand (reads its last element) and returns. The modes take
turns rep by rep, so a slow moment of the machine hits all of them alike. 64 MiB and 256 MiB
as throughput (GB/s); 64 B as latency (ms). Prints a Markdown table; writes
target/bench/ray_transport.json.

    python benches/ray_transport.py --engine target/release/vovp-engine [--reps N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray on loopback

import ray  # noqa: E402
import torch  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))
import vovp.cluster as vc  # noqa: E402

MiB = 1 << 20
SIZES = [64, 64 * MiB, 256 * MiB]
MODES = ["vovp", "default", "gloo"]

vc.register_transport()  # before the actors: Ray registers it on each as it is created


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class Producer:
    def __init__(self, sizes):
        self.tensors = {n: torch.ones(n // 4, dtype=torch.float32) for n in sizes}

    def make(self, nbytes):
        return self.tensors[nbytes]


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class Consumer:
    def take(self, t):
        return float(t[-1])  # in hand: its bytes are readable here

    def ready(self):
        return True


def pinned(cls, node, *args):
    return cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                       ).remote(*args)


def once(producer, consumer, mode, nbytes) -> float:
    make = producer.make if mode == "default" else \
        producer.make.options(tensor_transport=mode)
    t0 = time.perf_counter()
    ref = make.remote(nbytes)
    assert ray.get(consumer.take.remote(ref)) == 1.0
    elapsed = time.perf_counter() - t0
    del ref
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default=str(REPO / "target" / "release" / "vovp-engine"))
    parser.add_argument("--reps", type=int, default=7, help="reps of 64/256 MiB (64 B: 5x)")
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    modes = args.modes.split(",")

    node_args = dict(num_cpus=2, object_store_memory=900 * MiB, node_ip_address="127.0.0.1")
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args=dict(node_args, include_dashboard=False))
    cluster.add_node(**node_args)
    sock_dir = tempfile.mkdtemp(prefix="vrtb-", dir="/tmp")
    results: dict[str, dict[str, list[float]]] = {}
    try:
        ray.init(address="127.0.0.1:" + cluster.address.rsplit(":", 1)[1])
        cluster.wait_for_nodes()
        vc.init(socket=os.path.join(sock_dir, "{node}.sock"), memory="1400M",
                engine=args.engine)
        head = vc.node_id()
        other = next(n for n in vc.nodes() if n != head)
        pairs = {}
        for where, node in (("same node", head), ("across nodes", other)):
            producer, consumer = pinned(Producer, head, SIZES), pinned(Consumer, node)
            ray.get(consumer.ready.remote())
            if "gloo" in modes:
                from ray.experimental.collective import create_collective_group

                create_collective_group([producer, consumer], backend="torch_gloo")
            pairs[where] = (producer, consumer)
        for where, (producer, consumer) in pairs.items():
            for nbytes in SIZES:
                reps = args.reps * 5 if nbytes < MiB else args.reps
                for mode in modes:  # warm-up: connections, first pages, gloo's buffers
                    once(producer, consumer, mode, nbytes)
                for _ in range(reps):
                    for mode in modes:
                        key = f"{where} {nbytes}"
                        results.setdefault(key, {}).setdefault(mode, []).append(
                            once(producer, consumer, mode, nbytes))
    finally:
        try:
            vc.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()

    rows = []
    print(f"| workload | {' | '.join(modes)} | vovp / default | vovp / gloo |")
    print("|---|" + "---|" * (len(modes) + 2))
    for key, by_mode in results.items():
        where, nbytes = key.rsplit(" ", 1)
        nbytes = int(nbytes)
        med = {m: statistics.median(v) for m, v in by_mode.items()}
        if nbytes < MiB:
            shown = {m: f"{med[m] * 1e3:.2f} ms" for m in med}
            ratio = {m: med[m] / med["vovp"] for m in med}  # > 1: vovp is faster
            label = f"{nbytes} B, {where}, latency"
        else:
            shown = {m: f"{nbytes / med[m] / 1e9:.2f} GB/s" for m in med}
            ratio = {m: med[m] / med["vovp"] for m in med}
            label = f"{nbytes // MiB} MiB, {where}, throughput"
        cells = " | ".join(shown.get(m, "-") for m in modes)
        vs = " | ".join(f"{ratio[m]:.2f}x" if m in ratio else "-" for m in ("default", "gloo"))
        print(f"| {label} | {cells} | {vs} |")
        rows.append({"workload": label, "median_s": med, "samples": by_mode})
    out = REPO / "target" / "bench" / "ray_transport.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"ray": ray.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
