#!/usr/bin/env bash
# Workload 2 of two or more builds in adjacent runs, round after round, and
# each build's ratio to the first in the same round. A GPU host's speed
# drifts by tens of percent from one second to the next (the no-op floor's
# one thread moved 54-98 M ops/s within one visit), so two builds are
# compared by the median of their per-round ratios, not by their ranges.
#
#   bash bench/w2_rounds.sh [-r ROUNDS] [-t THREADS] [-m MIX] REF_DIR DIR...
#
# Each DIR holds a magpie_bench; REF_DIR's is the reference and also runs
# the no-op floor at one thread at the start of each round. The builds run
# in the order given in odd rounds and in reverse in even ones, so that a
# host that slows or speeds within a round favours neither. Prints one line
# a run (build, round, threads, M ops/s, reserved / sum of per-thread
# peaks, sum of peaks in MiB, and on a GPU the M ops/s less the
# allocations' cuStreamGetId calls where the build reports them), then per
# thread count and build the figures by round, their median and the median
# of the ratios to REF_DIR.
set -euo pipefail
rounds=10 threads=1,2 mix=256,2m
while getopts r:t:m: o; do
  case $o in
  r) rounds=$OPTARG ;;
  t) threads=$OPTARG ;;
  m) mix=$OPTARG ;;
  *) exit 2 ;;
  esac
done
shift $((OPTIND - 1))
if [ $# -lt 2 ]; then
  echo "usage: w2_rounds.sh [-r ROUNDS] [-t THREADS] [-m MIX] REF_DIR DIR..." >&2
  exit 2
fi
log=$(mktemp)
for r in $(seq 1 "$rounds"); do
  "$1/magpie_bench" -w 2 --mix "$mix" --allocs noop --threads 1 2>&1 |
    awk -v r="$r" '/^ +[0-9]+ noop/ {printf "noop r%s %s %s - -\n", r, $1, $3}'
  order=("$@")
  if ((r % 2 == 0)); then
    order=()
    for ((i = $#; i >= 1; i--)); do order+=("${!i}"); done
  fi
  for d in "${order[@]}"; do
    "$d/magpie_bench" -w 2 --mix "$mix" --allocs magpie --threads "$threads" 2>&1 |
      awk -v v="$(basename "$d")" -v r="$r" '/^ +[0-9]+ magpie/ {printf "%s r%s %s %s %s %s %s\n", v, r, $1, $3, $5, $6, $7}'
  done
done | tee "$log"
python3 - "$log" "$(basename "$1")" << 'PY'
import statistics, sys
runs, ref = {}, sys.argv[2]
less = {}
for line in open(sys.argv[1]):
    p = line.split()  # build, round, threads, M ops/s, reserved / peaks[, peaks MiB[, less id]]
    build, rnd, t = p[0], p[1], int(p[2])
    runs[(build, rnd, t)] = (float(p[3]), p[4])
    if len(p) > 6:
        less[(build, rnd, t)] = float(p[6])
rounds = sorted({k[1] for k in runs}, key=lambda s: int(s[1:]))
builds = list(dict.fromkeys(k[0] for k in runs if k[0] != 'noop'))
print('no-op floor, one thread, by round:', ' '.join('%.1f' % runs[('noop', r, 1)][0] for r in rounds if ('noop', r, 1) in runs))
for t in sorted({k[2] for k in runs if k[0] != 'noop'}):
    for b in builds:
        got = [r for r in rounds if (b, r, t) in runs]
        if not got:
            continue
        mops = [runs[(b, r, t)][0] for r in got]
        ratio = [runs[(b, r, t)][0] / runs[(ref, r, t)][0] for r in got if (ref, r, t) in runs]
        print('%2d threads %-8s M ops/s %s | median %.1f | x %s, median of the rounds\' ratios %.3f | reserved/peaks %s' % (
            t, b, ' '.join('%.1f' % m for m in mops), statistics.median(mops), ref, statistics.median(ratio),
            ' '.join(runs[(b, r, t)][1] for r in got)))
        if all((b, r, t) in less for r in got):
            ls = [less[(b, r, t)] for r in got]
            print('%2d threads %-8s less id %s | median %.1f' % (t, b, ' '.join('%.1f' % m for m in ls), statistics.median(ls)))
PY
rm -f "$log"
