#!/usr/bin/env python3
"""Draw a magpie snapshot (magpie_snapshot_json) as a PNG.

    tools/snapshot_png.py SNAPSHOT.json OUT.png [--cells-per-row N]

Each cell is one granule (2 MiB on an H200) of device address space that
magpie holds: class slabs and large segments, in address order. A cell is
split into bands by what its bytes are doing: in use, cached in a thread's
magazine, in the depot, waiting on a stream's epoch, limbo, free in a large
segment, lent by a large segment to the small classes' slabs (which have
cells of their own), overhead, or not mapped (virtual space of a large segment that
holds no memory). Past ~16k granules, cells stand for several granules.
Under the grid: a legend and the totals from the snapshot's statistics.
Prints the same totals on stdout.

Needs matplotlib (Debian: python3-matplotlib).
"""
import argparse
import json
import sys

STATES = [
    ("in_use", "in use", "#d62728"),
    ("thread", "thread magazines", "#ff7f0e"),
    ("depot", "depot (ready)", "#2ca02c"),
    ("pending", "waiting on a stream", "#9467bd"),
    ("limbo", "limbo (stream gone)", "#8c564b"),
    ("free", "free in large segment", "#17becf"),
    ("span", "lent to small classes' slabs (drawn apart)", "#bcbd22"),
    ("unused", "overhead", "#7f7f7f"),
    ("unmapped", "not mapped", "#eeeeee"),
]
ORDER = {name: i for i, (name, _, _) in enumerate(STATES)}


def granule_states(snap):
    """[(address, {state: bytes})] for every granule of every segment."""
    gran = snap["granule"] or (2 << 20)
    cells = []
    for seg in sorted(snap["segments"], key=lambda s: s["base"]):
        base, size = seg["base"], seg["size"]
        n = max(1, -(-size // gran))
        acc = [dict() for _ in range(n)]

        def add(start, length, state):
            # Spread [start, start+length) over the granules it touches.
            end = start + length
            while start < end:
                g = (start - base) // gran
                stop = min(end, base + (g + 1) * gran)
                acc[g][state] = acc[g].get(state, 0) + (stop - start)
                start = stop

        if seg["kind"] == "slab":
            bs = seg["block_size"]
            pos = base
            for run in seg["runs"]:
                add(pos, run[1] * bs, run[0])
                pos += run[1] * bs
            if base + size > pos:
                add(pos, base + size - pos, "unused")  # slab tail
        else:
            mapped = [False] * n
            for first, count in seg["mapped"]:
                for g in range(first, first + count):
                    mapped[g] = True
            for b in seg["blocks"]:
                state = b["state"]
                add(b["base"], b["size"], state)
            # Bytes of unmapped granules are address space only.
            for g in range(n):
                if not mapped[g]:
                    acc[g] = {"unmapped": gran}
        for g in range(n):
            cells.append((base + g * gran, acc[g]))
    return cells


def merge_cells(cells, factor):
    out = []
    for i in range(0, len(cells), factor):
        merged = {}
        for _, d in cells[i : i + factor]:
            for k, v in d.items():
                merged[k] = merged.get(k, 0) + v
        out.append((cells[i][0], merged))
    return out


def fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024.0
    return str(n)


def totals(snap):
    st = snap["stats"]
    keys = [
        ("reserved", "reserved_bytes"),
        ("in use", "in_use_bytes"),
        ("cached", "cached_bytes"),
        ("thread magazines", "thread_cached_bytes"),
        ("depot", "depot_bytes"),
        ("waiting on streams", "epoch_pending_bytes"),
        ("free large", "large_free_bytes"),
        ("overhead", "overhead_bytes"),
        ("peak reserved", "peak_reserved_bytes"),
        ("peak in use", "peak_in_use_bytes"),
    ]
    lines = [f"{label}: {fmt_bytes(st[key])}" for label, key in keys]
    if st.get("limit_bytes"):
        lines.append(f"limit: {fmt_bytes(st['limit_bytes'])}")
    return lines


def draw(snap, out_png, per_row):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    cells = granule_states(snap)
    # Virtual space of large segments that holds no memory is not drawn.
    hidden = sum(1 for _, d in cells if set(d) == {"unmapped"})
    cells = [c for c in cells if set(c[1]) != {"unmapped"}]
    factor = 1
    while len(cells) / factor > 16384:
        factor *= 2
    if factor > 1:
        cells = merge_cells(cells, factor)
    rows = max(1, -(-len(cells) // per_row))
    fig_w = 12.0
    cell_in = (fig_w - 1.0) / per_row
    grid_h = min(30.0, rows * cell_in)
    top, bottom = 0.6, 1.9  # inches: title; legend and totals
    fig_h = top + grid_h + bottom
    fig = plt.figure(figsize=(fig_w, fig_h), dpi=110)
    ax = fig.add_axes([0.5 / fig_w, bottom / fig_h, (fig_w - 1.0) / fig_w, grid_h / fig_h])
    for i, (_, d) in enumerate(cells):
        r, c = divmod(i, per_row)
        total = sum(d.values()) or 1
        x = c
        # Bands left to right in legend order, widths by bytes.
        for name in sorted(d, key=lambda k: ORDER.get(k, 99)):
            w = d[name] / total * 0.92
            ax.add_patch(Rectangle((x, rows - 1 - r), w, 0.92, color=STATES[ORDER[name]][2], lw=0))
            x += w
    ax.set_xlim(0, per_row)
    ax.set_ylim(0, rows)
    ax.axis("off")
    gran = (snap["granule"] or (2 << 20)) * factor
    title = (
        f"magpie device {snap['device']}: {len(cells)} cells of {fmt_bytes(gran)}, "
        f"slabs and large segments in address order"
    )
    if hidden:
        title += f"\n({fmt_bytes(hidden * (snap['granule'] or (2 << 20)))} of unmapped virtual space not drawn)"
    fig.text(0.5, 1 - 0.08 / fig_h, title, ha="center", va="top", fontsize=10)
    handles = [Patch(color=color, label=label) for _, label, color in STATES[:-1]]
    fig.legend(handles=handles, loc="lower left", ncol=3, fontsize=9, frameon=False,
               bbox_to_anchor=(0.02, 0.1 / fig_h))
    fig.text(0.98, 0.1 / fig_h, "\n".join(totals(snap)), ha="right", va="bottom", fontsize=8, family="monospace")
    fig.savefig(out_png)
    plt.close(fig)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("snapshot", help="JSON from magpie_snapshot_json ('-' for stdin)")
    ap.add_argument("png", help="picture to write")
    ap.add_argument("--cells-per-row", type=int, default=64)
    args = ap.parse_args(argv)
    with (sys.stdin if args.snapshot == "-" else open(args.snapshot)) as f:
        snap = json.load(f)
    if snap.get("magpie_snapshot") != 1:
        sys.exit("not a magpie snapshot (version 1)")
    draw(snap, args.png, args.cells_per_row)
    print("\n".join(totals(snap)))


if __name__ == "__main__":
    main(sys.argv[1:])
