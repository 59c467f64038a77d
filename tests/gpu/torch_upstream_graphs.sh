#!/usr/bin/env bash
# PyTorch's own CUDA graph tests (test/test_cuda.py of the installed PyTorch's
# version, which the torch wheel does not ship) under PyTorch's caching
# allocator and under magpie, and the tests that pass under the first but
# not under the second.
#
#   tests/gpu/torch_upstream_graphs.sh [path/to/test_cuda.py [OUTDIR]]
#
# The test file defaults to .gpu_extra/test_cuda.py of the repository (a
# git-ignored folder: PyTorch's code is not part of this repository).
#
# Each allocator runs in processes of its own (torch_upstream_run.py drive):
# magpie through magpie.torch.use() before test_cuda.py is imported. OUTDIR
# (default: a new temporary folder) receives MODE.jsonl (one line per test
# event) and MODE.log (the tests' output, tracebacks, stacks of a timed-out
# test). Settings, from the environment:
#   MODES             allocators, reference first (default "pytorch magpie";
#                     "async" is PyTorch's cudaMallocAsync backend)
#   PER_TEST_TIMEOUT  seconds per test (default 90)
#   BUDGET            seconds per allocator (default 300)
#   PATTERN           regular expression on "Class.test_name" (default: the
#                     graph tests, see torch_upstream_run.py)
# The graph selection of test_cuda.py runs in a few minutes on an H100.
# Exit status: 0 when the runs completed (the comparison is printed, not
# judged), 2 on a usage error.
set -u

HERE=$(cd "$(dirname "$0")" && pwd)
TEST_ARG=${1:-$HERE/../../.gpu_extra/test_cuda.py}
if [ ! -f "$TEST_ARG" ]; then
  echo "usage: $0 [path/to/test_cuda.py [OUTDIR]] ($TEST_ARG: no such file)" >&2
  exit 2
fi
TEST_FILE=$(cd "$(dirname "$TEST_ARG")" && pwd)/$(basename "$TEST_ARG")
OUT=${2:-$(mktemp -d "${TMPDIR:-/tmp}/torch_upstream_graphs.XXXXXX")}
mkdir -p "$OUT"
RUN="$HERE/torch_upstream_run.py"
PY=${PYTHON:-python3}
MODES=${MODES:-pytorch magpie}

extra=()
if [ -n "${PATTERN:-}" ]; then
  extra=(--pattern "$PATTERN")
fi

results=()
for mode in $MODES; do
  "$PY" "$RUN" drive --mode "$mode" --test-file "$TEST_FILE" --out "$OUT/$mode.jsonl" \
    --log "$OUT/$mode.log" --timeout "${PER_TEST_TIMEOUT:-90}" --budget "${BUDGET:-300}" ${extra[@]+"${extra[@]}"}
  results+=("$OUT/$mode.jsonl")
done

echo
"$PY" "$RUN" compare "${results[@]}"
echo
echo "results and logs: $OUT"
