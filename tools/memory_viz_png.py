#!/usr/bin/env python3
"""Draw a PyTorch memory snapshot (torch.cuda.memory._dump_snapshot's
pickle) as a PNG: the picture memory_viz's page draws in a browser.

    tools/memory_viz_png.py SNAPSHOT.pickle OUT.png [--device N] [--title T]

Top: the active memory timeline of the device's trace, as memory_viz's
"Active Memory Timeline" stacks it: each allocation is a band whose height
is its size, laid on the stack when it is allocated and removed when its
free completes (the bands above it move down). Blocks live before the
trace began form the grey bands at the bottom. Bottom: the segments, one
bar each in address order, their blocks coloured by state; their title
names magpie's own layers when the snapshot carries them (magpie.torch's
"magpie").

Prints the trace's peak of active bytes and the segments' totals.
Needs matplotlib (Debian: python3-matplotlib).
"""
import argparse
import pickle
import sys

FREE_ACTIONS = ("free_completed",)
STATE_COLOURS = {"active_allocated": "#d62728", "active_pending_free": "#ff7f0e", "inactive": "#dddddd"}


def timeline(trace, live_at_end):
    """(bands, peak, events): bands are (size, [(event index, offset)],
    pre) for each allocation, the offset its band's bottom has from that
    event on (None: freed there); pre marks blocks alive before the trace
    (freed in it before any alloc of theirs, or live at the end without
    one), stacked at the bottom from the start. peak is the largest total."""
    live, pre = set(), {}
    for e in trace:
        if e["action"] == "alloc":
            live.add(e["addr"])
        elif e["action"] in FREE_ACTIONS:
            if e["addr"] in live:
                live.discard(e["addr"])
            else:
                pre.setdefault(e["addr"], e["size"])
    for addr, size in live_at_end.items():
        if addr not in live:
            pre.setdefault(addr, size)
    stack, bands, total = [], [], 0  # stack: [addr, size, band], bottom first
    for addr, size in pre.items():
        stack.append([addr, size, len(bands)])
        bands.append((size, [(0, total)], True))
        total += size
    peak, n = total, 0
    for e in trace:
        if e["action"] == "alloc":
            n += 1
            stack.append([e["addr"], e["size"], len(bands)])
            bands.append((e["size"], [(n, total)], False))
            total += e["size"]
            peak = max(peak, total)
        elif e["action"] in FREE_ACTIONS:
            idx = next((i for i in range(len(stack) - 1, -1, -1) if stack[i][0] == e["addr"]), None)
            if idx is None:
                continue
            n += 1
            _, size, band = stack.pop(idx)
            bands[band][1].append((n, None))
            for s in stack[idx:]:
                bands[s[2]][1].append((n, bands[s[2]][1][-1][1] - size))
            total -= size
    return bands, peak, n


def band_polygon(size, steps, end):
    """The outline of one band: its bottom follows steps (event index,
    offset) until an offset of None (its free) or end."""
    xs, lo = [], []
    for i, (x, off) in enumerate(steps):
        if off is None:
            xs.append(x)
            lo.append(lo[-1] if lo else 0)
            break
        if xs:
            xs.append(x)
            lo.append(lo[-1])
        xs.append(x)
        lo.append(off)
        if i == len(steps) - 1:
            xs.append(end)
            lo.append(off)
    return [(x, y) for x, y in zip(xs, lo)] + [(x, y + size) for x, y in reversed(list(zip(xs, lo)))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("snapshot")
    ap.add_argument("out")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    with open(a.snapshot, "rb") as f:
        snap = pickle.load(f)
    traces = snap.get("device_traces") or []
    trace = traces[a.device] if a.device < len(traces) else []
    segs = sorted((s for s in snap.get("segments", []) if s.get("device", 0) == a.device), key=lambda s: s["address"])
    live = {}
    for s in segs:
        addr = s["address"]
        for b in s["blocks"]:
            if b["state"] == "active_allocated":
                live[addr] = b["size"]
            addr += b["size"]
    bands, peak, events = timeline(trace, live)
    reserved = sum(s["total_size"] for s in segs)
    allocated = sum(s.get("allocated_size", 0) for s in segs)
    print(f"trace: {len(trace)} events, {len(bands)} bands, peak active {peak} bytes ({peak / 2**20:.1f} MiB)")
    print(f"segments: {len(segs)}, reserved {reserved} bytes, allocated {allocated} bytes")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch, Rectangle

    fig, (ax, bx) = plt.subplots(2, 1, figsize=(12, 8), gridspec_kw={"height_ratios": [3, 2]})
    mib = 2**20
    polys, colours = [], []
    cmap = plt.get_cmap("tab20")
    for i, (size, steps, pre) in enumerate(bands):
        pts = band_polygon(size / mib, [(x, None if o is None else o / mib) for x, o in steps], max(events, 1))
        polys.append(pts)
        colours.append("#bbbbbb" if pre else cmap(i % 20))
    ax.add_collection(PolyCollection(polys, facecolors=colours, edgecolors="none"))
    ax.set_xlim(0, max(events, 1))
    ax.set_ylim(0, max(peak / mib * 1.05, 1))
    ax.set_xlabel("allocation / free event")
    ax.set_ylabel("active MiB")
    ax.set_title(a.title or f"Active memory timeline, device {a.device} (peak {peak / mib:.1f} MiB)")

    # One row per segment, each drawn across the full width (segments range
    # from 2 MiB slabs to segments of hundreds of MiB), its size at the left.
    for y, s in enumerate(segs):
        x, total = 0, max(s["total_size"], 1)
        for b in s["blocks"]:
            bx.add_patch(Rectangle((x / total, y), b["size"] / total, 0.8,
                                   color=STATE_COLOURS.get(b["state"], "#1f77b4"), linewidth=0))
            x += b["size"]
        bx.add_patch(Rectangle((0, y), 1, 0.8, fill=False, linewidth=0.5, edgecolor="black"))
        size = s["total_size"]
        label = f"{size / mib:.1f} MiB" if size >= mib else f"{size / 1024:.0f} KiB"
        bx.text(-0.01, y + 0.4, label, ha="right", va="center", fontsize=7)
    bx.set_xlim(0, 1)
    bx.set_ylim(0, max(len(segs), 1))
    bx.set_yticks([])
    bx.set_xlabel("fraction of the segment (address order)")
    bx.legend(handles=[Patch(color=c, label=k) for k, c in STATE_COLOURS.items()], loc="upper right", fontsize=7)
    # magpie.torch's snapshot carries magpie's own of every device.
    own = snap.get("magpie")
    own = own[a.device] if isinstance(own, list) and a.device < len(own) else None
    note = ""
    if isinstance(own, dict) and isinstance(own.get("stats"), dict):
        st = own["stats"]
        layers = (("in use", "in_use_bytes"), ("thread magazines", "thread_cached_bytes"), ("depot", "depot_bytes"),
                  ("waiting on streams", "epoch_pending_bytes"), ("free large", "large_free_bytes"))
        note = "magpie: " + ", ".join(f"{label} {st[k] / mib:.1f}" for label, k in layers if k in st) + " MiB"
        print(note)
    bx.set_title(f"{len(segs)} segments, {reserved / mib:.1f} MiB reserved, {allocated / mib:.1f} MiB allocated"
                 f"{chr(10) + note if note else ''}", fontsize=9)
    fig.tight_layout()
    fig.savefig(a.out, dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
