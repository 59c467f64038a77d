#!/usr/bin/env bash
# A/B of two magpie builds under PyTorch on one GPU, in one run, beside
# PyTorch's own allocator: bench/torch_probe.py (torch.empty's cost, the
# LLM-style server's tokens/s and peak reserved memory) and
# bench/torch_threads.sh (the tensor path at 1-16 threads), in alternating
# rounds.
#
#   bash bench/torch_ab.sh A_DIR B_DIR [ROUNDS]
#
# Each build's folder holds lib/libmagpie.so, python/magpie (the package,
# magpie.h beside it) and bench/ (that commit's torch_probe.py,
# torch_threads.sh and torch_threads.cpp; a build without torch_probe.py
# uses this one's). Lines are prefixed with the folder's name. PROBES
# (default "--empty --server"; empty: none) picks torch_probe.py's
# measurements, MODES torch_threads.sh's.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
rounds=${3:-2}
a=$(cd "$1" && pwd)
b=$(cd "$2" && pwd)
probe() { # DIR ALLOCATOR
  local p=$1/bench/torch_probe.py
  [[ -f $p ]] || p=$here/torch_probe.py
  PYTHONPATH=$1/python MAGPIE_LIB=$1/lib/libmagpie.so MAGPIE_CACHE_DIR=$1/.cache timeout 120 python3 "$p" "$2" \
    ${PROBES:---empty --server} 2>&1 | sed "s|^|$(basename "$1") |"
}
echo "torch $(python3 -c 'import torch; print(torch.__version__)'), $(nvidia-smi -L 2> /dev/null | head -1), $(date -u)"
threads() { # DIR
  mkdir -p "$1/.tmp"
  PYTHONPATH=$1/python MAGPIE_CACHE_DIR=$1/.cache TMPDIR=$1/.tmp timeout 300 \
    bash "$1/bench/torch_threads.sh" "$1/lib/libmagpie.so" 4096 1 2>&1 | sed "s|^|$(basename "$1") |"
}
for ((r = 1; r <= rounds; r++)); do
  echo "## round $r"
  if [[ ${PROBES-x} != "" ]]; then
    probe "$a" magpie
    probe "$b" magpie
    probe "$a" pytorch
  fi
  threads "$a"
  threads "$b"
done
