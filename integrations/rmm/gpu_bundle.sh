#!/usr/bin/env bash
# Everything a GPU machine without network or compilers for RMM needs to
# prove magpie's RMM resource, in one folder to carry there:
#
#   integrations/rmm/gpu_bundle.sh DIR      (here: fetches and builds; RMM_SRC
#                                           and RMM_REF as for fetch_rmm.sh)
#   bash DIR/run.sh [all|tests|bench|python]  (there)
#
# DIR/bin      build.sh's output: RMM's tests on magpie, RMM's
#              random_allocations benchmark with magpie beside RMM's
#              resources, and the libraries they load
# DIR/wheels   magpie's wheel (tools/wheel.sh) and, for the GPU machine's
#              Python (PY_VERSION, default 3.12), RMM's three wheels and what
#              rmm-cu13 needs beyond numpy (cuda-bindings, cuda-pathfinder),
#              plus Cython, which magpie.rmm builds its resource with
# DIR/python   tests/gpu/rmm_test.py and bench/rmm_python_bench.py
#
# run.sh installs the wheels into a folder it puts first on PYTHONPATH
# (the machine's own packages, CuPy and numpy, stay visible), then runs RMM's tests on magpie and
# on RMM's own resources, the benchmark, the Python test and the Python
# benchmark, each printing its own summary.
set -euo pipefail
[[ $# -eq 1 ]] || {
  echo "usage: $0 DIR" >&2
  exit 2
}
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
mkdir -p "$1"
DIR="$(cd "$1" && pwd)"
PY_VERSION="${PY_VERSION:-3.12}"
PLATFORM="${PLATFORM:-manylinux_2_28_x86_64}"

"$HERE/fetch_rmm.sh"
"$HERE/build.sh" "$DIR/bin"

cp "$HERE/run_tests.sh" "$DIR/bin/"
mkdir -p "$DIR/wheels" "$DIR/python"
rm -f "$DIR"/wheels/*.whl
cp "${RMM_DIR:-$ROOT/.rmm}"/wheels/*.whl "$DIR/wheels/"
"${PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" --platform "$PLATFORM" \
  --dest "$DIR/wheels" "cuda-bindings>=13.0.1,<14" cuda-pathfinder cython
(cd "$ROOT" && rm -rf .whl && tools/wheel.sh >/dev/null)
cp "$ROOT"/.whl/*.whl "$DIR/wheels/"
cp "$ROOT/tests/gpu/rmm_test.py" "$ROOT/tests/gpu/cupy_checks.py" "$ROOT/bench/rmm_python_bench.py" "$DIR/python/"
echo "bundle commit: $(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD -- || echo ' (with uncommitted changes)')" \
  > "$DIR/COMMIT"

cat > "$DIR/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs magpie's RMM proof on a GPU machine (integrations/rmm/gpu_bundle.sh).
set -uo pipefail
DIR="$(cd "$(dirname "$0")" && pwd)"
what="${1:-all}"
cat "$DIR/COMMIT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# The wheels go into a folder of their own put first on PYTHONPATH, beside
# the machine's packages (CuPy, numpy), wherever pip put those.
site="${SITE:-/tmp/magpie-rmm-site}"
if [[ ! -d "$site/rmm" ]]; then
  python3 -m pip install --quiet --no-index --no-deps --target "$site" "$DIR"/wheels/*.whl
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export MAGPIE_CACHE_DIR="${MAGPIE_CACHE_DIR:-/tmp/magpie-cache}"
status=0
if [[ $what == all || $what == tests ]]; then
  echo "=== RMM's tests on magpie's resource"
  bash "$DIR/bin/run_tests.sh" "$DIR/bin" || status=1
  echo "=== the same tests on RMM's own resources (MAGPIE_RMM_BASELINE=1)"
  MAGPIE_RMM_BASELINE=1 bash "$DIR/bin/run_tests.sh" "$DIR/bin" || true
fi
if [[ $what == all || $what == python ]]; then
  echo "=== tests/gpu/rmm_test.py"
  python3 "$DIR/python/rmm_test.py" || status=1
fi
if [[ $what == all || $what == bench ]]; then
  echo "=== RMM's random_allocations benchmark"
  "$DIR/bin/rmm_random_allocations" ${BENCH_ARGS:-} || status=1
  echo "=== bench/rmm_python_bench.py"
  python3 "$DIR/python/rmm_python_bench.py" || status=1
fi
exit $status
RUN
chmod +x "$DIR/run.sh"
du -sh "$DIR"
