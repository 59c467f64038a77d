#!/usr/bin/env python3
"""Plots of the benchmark suite's CSV (magpie_bench --csv, or run_gpu.sh's
results.csv): thread scaling, latency per size, pipeline throughput,
cross-thread frees and fragmentation.

    python3 bench/plot.py RESULTS.csv OUTDIR

Needs matplotlib (Debian: python3-matplotlib). Writes OUTDIR/*.png.
"""
import csv
import os
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ORDER = ["magpie", "cudaMallocAsync", "pytorch", "cudaMalloc", "noop"]
COLORS = {"magpie": "#d62728", "cudaMallocAsync": "#1f77b4", "pytorch": "#ff7f0e",
          "cudaMalloc": "#7f7f7f", "noop": "#2ca02c"}
LABELS = {"noop": "no-op reference"}


def load(path):
    rows = defaultdict(dict)  # (workload, metric) -> {allocator: {x: value}}
    with open(path) as f:
        for r in csv.DictReader(f):
            rows[(r["workload"], r["metric"])].setdefault(r["allocator"], {})[r["x"]] = float(r["value"])
    return rows


def allocators(d):
    return [a for a in ORDER if a in d]


def size_label(b):
    b = int(b)
    for unit, n in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= n and b % n == 0:
            return f"{b // n} {unit}"
    return f"{b} B"


def bar_labels(ax, bars, fmt):
    for b in bars:
        h = b.get_height()
        ax.annotate(fmt.format(h), (b.get_x() + b.get_width() / 2, h), ha="center", va="bottom", fontsize=8)


def latency(rows, out, title):
    d = rows.get(("latency", "mean_ns"))
    if not d:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for a in allocators(d):
        xs = sorted(d[a], key=int)
        ax.plot([int(x) for x in xs], [d[a][x] for x in xs], marker="o", color=COLORS[a], label=LABELS.get(a, a))
        p99 = rows.get(("latency", "p99_ns"), {}).get(a)
        if p99 and a != "noop":
            ax.plot([int(x) for x in xs], [max(p99[x], 1) for x in xs], ls=":", color=COLORS[a], alpha=0.7)
    gid = d.get("cuStreamGetId")
    if gid:  # the driver call inside each magpie allocation, timed alone
        xs = sorted(gid, key=int)
        ax.plot([int(x) for x in xs], [gid[x] for x in xs], marker=".", ls="--", color="#8c564b",
                label="cuStreamGetId alone (one per magpie alloc)")
    ax.axhline(25, color="#d62728", lw=0.8, ls="--")
    ax.text(300, 27, "target: magpie 25 ns up to 1 MiB", color="#d62728", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    xs = sorted({int(x) for a in d for x in d[a]})
    ax.set_xticks(xs)
    ax.set_xticklabels([size_label(x) for x in xs], rotation=45, ha="right")
    ax.set_xlabel("block size")
    ax.set_ylabel("ns per alloc+free pair (solid: mean, dotted: p99)")
    ax.set_title(f"1. Latency of one alloc+free pair, one thread, warm\n{title}")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = os.path.join(out, "latency.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def scaling(rows, out, title):
    d = rows.get(("scaling", "ops_per_s"))
    if not d:
        return None
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 5))
    for a in allocators(d):
        xs = sorted(d[a], key=int)
        ax.plot([int(x) for x in xs], [d[a][x] / 1e6 for x in xs], marker="o", color=COLORS[a],
                label=LABELS.get(a, a))
    ax.axhline(300, color="#d62728", lw=0.8, ls="--")
    ax.text(1, 330, "target: 300 M ops/s at 16 threads", color="#d62728", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    xs = sorted({int(x) for a in d for x in d[a]})
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.set_xlabel("threads (each on its own stream)")
    ax.set_ylabel("M operations / s (allocs + frees, all threads)")
    ax.set_title("2. Thread scaling: throughput")
    ax.grid(True, alpha=0.3)
    ax.legend()
    res = rows.get(("scaling", "peak_reserved_bytes"), {})
    live = rows.get(("scaling", "sum_peak_live_bytes"), {})
    for a in allocators(res):
        xs = sorted(res[a], key=int)
        ax2.plot([int(x) for x in xs], [res[a][x] / live[a][x] for x in xs], marker="o", color=COLORS[a],
                 label=LABELS.get(a, a))
    ax2.axhline(1.3, color="#d62728", lw=0.8, ls="--")
    ax2.text(1, 1.38, "target: 1.3", color="#d62728", fontsize=8)
    ax2.set_xscale("log", base=2)
    xs = sorted({int(x) for a in res for x in res[a]})
    ax2.set_xticks(xs)
    ax2.set_xticklabels([str(x) for x in xs])
    ax2.set_ylim(bottom=0)
    ax2.set_xlabel("threads")
    ax2.set_ylabel("peak reserved / sum of per-thread peak live bytes")
    ax2.set_title("2. Thread scaling: memory")
    ax2.grid(True, alpha=0.3)
    ax2.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = os.path.join(out, "scaling.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bars(rows, out, title, workload, metric, scale, ylabel, name, heading, target=None, fmt="{:.1f}"):
    d = rows.get((workload, metric))
    if not d:
        return None
    names = allocators(d)
    fig, ax = plt.subplots(figsize=(8, 5))
    b = ax.bar([LABELS.get(a, a) for a in names], [d[a][""] / scale for a in names],
               color=[COLORS[a] for a in names])
    bar_labels(ax, b, fmt)
    if target:
        ax.axhline(target[0], color="#d62728", lw=0.8, ls="--")
        ax.text(1.0, 1.0, target[1], color="#d62728", fontsize=8, ha="right", va="bottom", transform=ax.transAxes)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{heading}\n{title}")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path = os.path.join(out, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    rows = load(sys.argv[1])
    out = sys.argv[2]
    os.makedirs(out, exist_ok=True)
    title = os.path.basename(os.path.normpath(out))
    made = [latency(rows, out, title), scaling(rows, out, title)]
    noop = rows.get(("pipeline", "steps_per_s"), {}).get("noop", {}).get("")
    made.append(bars(rows, out, title, "pipeline", "steps_per_s", 1e3, "k steps / s (all threads; median of rounds)",
                     "pipeline.png", "3. Many-stream pipeline: 8 threads, 32 streams, kernels and hand-offs",
                     (0.97 * noop / 1e3, "target: magpie 97% of the no-op reference") if noop else None))
    made.append(bars(rows, out, title, "crossfree", "pairs_per_s", 1e6, "M pairs / s (all pairs)", "crossfree.png",
                     "4. Cross-thread frees: 4 producer/consumer pairs", (20, "target: 20 M pairs/s"), "{:.2f}"))
    made.append(bars(rows, out, title, "trace", "reserved_over_live", 1, "peak reserved / peak live bytes",
                     "fragmentation.png", "5. Fragmentation: inference-like trace replay",
                     (1.15, "target: magpie 1.15"), "{:.2f}"))
    for p in made:
        if p:
            print(p)


if __name__ == "__main__":
    main()
