#!/usr/bin/env bash
# tools/memory_viz_png.py draws a PyTorch-format snapshot (what
# torch.cuda.memory._dump_snapshot writes, here made up with a known
# answer): the picture is a PNG of reasonable size, and the printed peak of
# active bytes and the segments' totals are the trace's and segments'.
set -euo pipefail
tool=$1
out=${TEST_TMPDIR:-/tmp}
py=python3
/usr/bin/python3 -c 'import matplotlib' 2>/dev/null && py=/usr/bin/python3
# The trace: a block alive before it (freed at its start), then blocks of
# 1, 2 and 3 MiB allocated and freed so that the active peak is 1 + 2 + 3 +
# the block alive before = 6 MiB + 4 KiB, then one more of 5 MiB alone.
"$py" - "$out/snap.pickle" <<'PY'
import pickle, sys
MiB = 1 << 20
ev = lambda action, addr, size: {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": 0,
                                 "frames": []}
base = 1 << 32
trace = [ev("alloc", base, MiB), ev("alloc", base + MiB, 2 * MiB), ev("alloc", base + 3 * MiB, 3 * MiB),
         ev("free_requested", 0x1000, 4096), ev("free_completed", 0x1000, 4096),
         ev("free_completed", base + MiB, 2 * MiB), ev("free_completed", base, MiB),
         ev("free_completed", base + 3 * MiB, 3 * MiB), ev("alloc", base + 6 * MiB, 5 * MiB)]
segments = [
    {"device": 0, "address": base, "total_size": 12 * MiB, "stream": 0, "segment_type": "large",
     "allocated_size": 5 * MiB, "active_size": 5 * MiB,
     "blocks": [{"size": 6 * MiB, "state": "inactive"}, {"size": 5 * MiB, "state": "active_allocated"},
                {"size": MiB, "state": "inactive"}]},
    {"device": 0, "address": base + (1 << 30), "total_size": 2 * MiB, "stream": 0, "segment_type": "small",
     "allocated_size": 0, "active_size": 0, "blocks": [{"size": 2 * MiB, "state": "inactive"}]},
]
own = [{"stats": {"in_use_bytes": 5 * MiB, "thread_cached_bytes": MiB, "depot_bytes": 0,
                  "epoch_pending_bytes": 0, "large_free_bytes": 8 * MiB}}]
pickle.dump({"segments": segments, "device_traces": [trace], "magpie": own}, open(sys.argv[1], "wb"))
PY
"$py" "$tool" "$out/snap.pickle" "$out/snap.png" > "$out/totals.txt"
cat "$out/totals.txt"
head -c 8 "$out/snap.png" | od -An -tx1 | tr -d ' \n' | grep -q '^89504e470d0a1a0a$' || {
  echo "not a PNG"; exit 1; }
size=$(stat -c %s "$out/snap.png")
[ "$size" -gt 20000 ] || { echo "PNG too small ($size bytes)"; exit 1; }
for want in "trace: 9 events, 5 bands, peak active $((6 * 1048576 + 4096)) bytes" \
  "segments: 2, reserved $((14 * 1048576)) bytes, allocated $((5 * 1048576)) bytes" \
  "magpie: in use 5.0, thread magazines 1.0, depot 0.0, waiting on streams 0.0, free large 8.0 MiB"; do
  grep -qF "$want" "$out/totals.txt" || { echo "missing: $want"; exit 1; }
done
echo "[  PASSED  ] 1 test(s)."
