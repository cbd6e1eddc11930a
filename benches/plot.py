#!/usr/bin/env python3
"""Plots put throughput against object size from vovp-bench's results.json.

    plot.py target/bench/results.json target/bench/throughput.png [target/bench/peers.png]

Lines: vovp and Plasma driven from Python (the same driver), the Rust client and the embedded
engine, and the parallel memcpy bandwidth into a warm shared mapping (the machine's limit).
When the run has the peers pass, its plot too (third argument, default peers.png beside the
first plot): one panel per workload, one bar per store, the table "vovp against every peer".
"""

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # no display on CI machines
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

MIB = 1 << 20


def series(rows, prefix, field):
    """(sizes, values) of the GB/s rows under `prefix`, for objects of 1 MiB and more (below
    that a put is a round trip, not a copy)."""
    pts = sorted((r["size"], r[field]) for r in rows
                 if r["key"].startswith(prefix) and r.get("unit") == "GB/s"
                 and (r.get("size") or 0) >= MIB and r.get(field) is not None)
    return [p[0] for p in pts], [p[1] for p in pts]


def size_label(n):
    return f"{n >> 30} GiB" if n >= 1 << 30 else f"{n >> 20} MiB"


COLORS = {"vovp": "C0", "vovp_torch": "#5fa2dd", "vovp_raw": "#9cc7ee", "plasma": "C3",
          "ray": "C1", "vineyard": "C2", "vineyard_blob": "#8fd18f", "shm": "C4",
          "torch_mp": "C5"}


def short(v):
    """12.3k, 456, 7.89, 0.123."""
    if v >= 1e4:
        return f"{v / 1e3:.0f}k"
    if v >= 1e3:
        return f"{v / 1e3:.1f}k"
    return f"{v:.3g}"


def plot_peers(res, dst):
    """One panel per workload of the peers pass: horizontal bars, one per store (log scale:
    the stores differ by orders of magnitude), vovp's typed calls on top."""
    peers = res.get("peers")
    if not peers or not peers.get("rows"):
        return False
    stores = peers["stores"]
    rows = peers["rows"]
    ncol = 4
    nrow = (len(rows) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 0.35 * len(stores) * nrow + 1.5),
                             dpi=110, squeeze=False)
    for ax, row in zip(axes.flat, rows):
        med = row.get("medians", {})
        labels, values, colors = [], [], []
        for st in stores:
            v = med.get(st["id"])
            labels.append(st["label"].replace(" put_tensor/get_tensor", " typed"))
            values.append(v if v else 0)
            colors.append(COLORS.get(st["id"], "0.5"))
        y = list(range(len(labels)))[::-1]
        ax.barh(y, values, color=colors)
        ax.set_yticks(y, labels, fontsize=7)
        if row["unit"] != "GB/s":  # op/s and µs span orders of magnitude between stores
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        arrow = "higher is better" if row["higher_is_better"] else "lower is better"
        ax.set_title(f"{row['name']}\n{row['unit']}, {arrow}", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(True, axis="x", which="both", alpha=0.3)
        for yi, v in zip(y, values):
            if v:
                ax.text(v, yi, f" {short(v)}", va="center", fontsize=6)
    for ax in list(axes.flat)[len(rows):]:
        ax.axis("off")
    machine = res.get("run", {}).get("machine", {}).get("summary", "")
    mode = res.get("run", {}).get("mode", "")
    fig.suptitle(f"vovp against every peer, one run ({mode}; medians)\n{machine}", fontsize=9)
    fig.tight_layout()
    fig.savefig(dst)
    return True


def main():
    src, dst = sys.argv[1], sys.argv[2]
    peers_dst = sys.argv[3] if len(sys.argv) > 3 else os.path.join(os.path.dirname(dst),
                                                                  "peers.png")
    with open(src) as f:
        res = json.load(f)
    plot_peers(res, peers_dst)
    rows = res["rows"]
    limits = [dict(l, vovp_median=l["median"]) for l in res["limits"]]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    lines = [
        (rows, "py.put.", "vovp_median", "vovp (Python client)", "C0", "o", "-"),
        (rows, "py.put.", "base_median", "Plasma (Python client)", "C3", "s", "-"),
        (rows, "rust.client.put.", "vovp_median", "vovp (Rust client)", "C0", "^", "--"),
        (rows, "rust.engine.put.", "vovp_median", "vovp (embedded Engine)", "C2", "v", "--"),
        (limits, "limit.memcpy.", "vovp_median", "vovp::parallel_copy (no store)", "0.5", "",
         ":"),
        (limits, "limit.memcpy_split.", "vovp_median", "memcpy, one part per CPU (no store)",
         "k", "", ":"),
    ]
    sizes = set()
    for data, prefix, field, label, color, marker, style in lines:
        x, y = series(data, prefix, field)
        if x:
            sizes.update(x)
            ax.plot(x, y, marker=marker or None, linestyle=style, color=color, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(sizes), [size_label(s) for s in sorted(sizes)])
    ax.minorticks_off()
    ax.set_xlabel("object size")
    ax.set_ylabel("put throughput (GB/s, median)")
    machine = res.get("run", {}).get("machine", {}).get("summary", "")
    mode = res.get("run", {}).get("mode", "")
    ax.set_title(f"put throughput vs size ({mode} run)\n{machine}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst)


if __name__ == "__main__":
    main()
