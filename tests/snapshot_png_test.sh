#!/usr/bin/env bash
# A snapshot of a mixed workload on the simulated device, drawn by
# tools/snapshot_png.py: the JSON parses, the picture is a PNG of
# reasonable size, and the printed totals match the snapshot's statistics.
# The same run checks what MAGPIE_CONF=verbose=1 prints at exit (with
# slow_call_ms on: the slowest device call of each kind).
set -euo pipefail
example=$1
tool=$2
out=${TEST_TMPDIR:-/tmp}
MAGPIE_BACKEND=sim MAGPIE_CONF=verbose=1,slow_call_ms=1000000 "$example" "$out/snap.json" 2> "$out/verbose.txt"
# verbose=1: statistics by layer, the ladder and per-class hits at exit.
for want in "cached by layer: thread magazines" "out-of-memory ladder: reclaim" "size class: hits / misses" \
  "slowest device call of each kind (ms): " " map "; do
  grep -q "$want" "$out/verbose.txt" || { echo "verbose=1 output lacks '$want':"; cat "$out/verbose.txt"; exit 1; }
done
py=python3
/usr/bin/python3 -c 'import matplotlib' 2>/dev/null && py=/usr/bin/python3
"$py" "$tool" "$out/snap.json" "$out/snap.png" > "$out/totals.txt"
head -c 8 "$out/snap.png" | od -An -tx1 | tr -d ' \n' | grep -q '^89504e470d0a1a0a$' || {
  echo "not a PNG"; exit 1; }
size=$(stat -c %s "$out/snap.png")
[ "$size" -gt 20000 ] || { echo "PNG too small ($size bytes)"; exit 1; }
"$py" - "$out/snap.json" "$out/totals.txt" <<'PY'
import json, sys
snap = json.load(open(sys.argv[1]))
st = snap["stats"]
text = open(sys.argv[2]).read()
assert "reserved:" in text and "waiting on streams:" in text, text
kinds = {s["kind"] for s in snap["segments"]}
assert kinds == {"slab", "large_segment"}, kinds
states = set()
for s in snap["segments"]:
    if s["kind"] == "slab":
        states |= {r[0] for r in s["runs"]}
    else:
        states |= {b["state"] for b in s["blocks"]}
for want in ("in_use", "thread", "free"):
    assert want in states, (want, states)
assert st["reserved_bytes"] == st["in_use_bytes"] + st["cached_bytes"]
print("ok:", sorted(states), st["reserved_bytes"], "bytes reserved")
PY
