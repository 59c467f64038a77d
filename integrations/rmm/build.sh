#!/usr/bin/env bash
# Builds RMM's memory-resource tests and its random_allocations benchmark
# against magpie's RMM resource (include/magpie_rmm.hpp), into OUTDIR:
#
#   rmm_mr_tests               RMM's parameterized suites (mr_ref_test,
#                              mr_ref_allocation_test, mr_ref_test_mt) on the
#                              "Magpie" resource (mr_ref_magpie_tests.cpp)
#   rmm_mr_tests_ptds          the same with the per-thread default stream
#   rmm_<file>                 one binary per RMM test file of cpp/tests/mr
#                              about adaptors, resource refs and allocators,
#                              and of RMM's containers (the lists below), as
#                              RMM's CMake builds them
#   rmm_multi_stream_allocations  RMM's multi_stream_allocations benchmark
#                              (nvcc), with the same "magpie" resource
#   rmm_random_allocations     RMM's random_allocations benchmark, with a
#                              "magpie" resource beside RMM's
#   librmm.so librapids_logger.so libmagpie.so (and libbenchmark's shared
#                              library where no static one is installed):
#                              the binaries find them through RPATH $ORIGIN
#
# The test binaries share a main (magpie_test_main.cpp) that makes magpie
# RMM's current device resource; MAGPIE_RMM_BASELINE=1 keeps RMM's own.
# run_tests.sh OUTDIR runs them all.
#
# Usage: integrations/rmm/build.sh OUTDIR
#   RMM_DIR     what fetch_rmm.sh fetched (default <repo>/.rmm); the build's
#               patched sources and objects go to RMM_DIR/build
#   MAGPIE_LIB  libmagpie.so to use (default: bazel build -c opt //:libmagpie.so)
#   CUDA_HOME   CUDA toolkit (default /usr/local/cuda); CXX (default g++);
#   JOBS        parallel compilations (default: the number of CPUs)
#
# The tests are host C++ compiled by CXX: RMM's tests that need nvcc (.cu
# files) are left out (README.md says which). The multi-stream benchmark is
# CUDA source, compiled by CUDA_HOME's nvcc.
set -euo pipefail

usage() {
  echo "usage: $0 OUTDIR" >&2
  exit 2
}
[[ $# -eq 1 ]] || usage

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
RMM_DIR="${RMM_DIR:-$ROOT/.rmm}"
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
CXX="${CXX:-g++}"
JOBS="${JOBS:-$(nproc)}"
WHL="$RMM_DIR/whl"
SRC="$RMM_DIR/src"
WORK="$RMM_DIR/build"
mkdir -p "$1"
OUT="$(cd "$1" && pwd)"

for f in "$WHL/librmm/include/rmm/resource_ref.hpp" "$WHL/librmm/lib64/librmm.so" \
  "$WHL/rapids_logger/lib64/librapids_logger.so" "$SRC/COMMIT" "$SRC/cpp/tests/mr/mr_ref_test.hpp"; do
  [[ -e "$f" ]] || {
    echo "build: $f is missing; run integrations/rmm/fetch_rmm.sh first" >&2
    exit 1
  }
done
[[ -e "$CUDA_HOME/include/cuda_runtime_api.h" && -e "$CUDA_HOME/lib64/libcudart.so" ]] || {
  echo "build: no CUDA toolkit at $CUDA_HOME (set CUDA_HOME)" >&2
  exit 1
}
RMM_COMMIT="$(cat "$SRC/COMMIT")"
echo "build: RMM tests and benchmark from RMM commit $RMM_COMMIT (version $(cat "$SRC/VERSION")), against" \
  "librmm $(tr -d '[:space:]' < "$WHL/librmm/VERSION") (commit $(tr -d '[:space:]' < "$WHL/librmm/GIT_COMMIT"))"

# --- libraries into OUTDIR ---------------------------------------------------------

if [[ -z "${MAGPIE_LIB:-}" ]]; then
  (cd "$ROOT" && bazel build -c opt //:libmagpie.so)
  MAGPIE_LIB="$ROOT/bazel-bin/libmagpie.so"
fi
# Copies rather than links: OUTDIR is meant to be carried to a GPU machine.
# bazel's outputs are read-only; the copies need to be writable to strip them.
install -m 755 "$MAGPIE_LIB" "$OUT/libmagpie.so"
strip --strip-debug "$OUT/libmagpie.so"
install -m 755 "$WHL/librmm/lib64/librmm.so" "$WHL/rapids_logger/lib64/librapids_logger.so" "$OUT/"

# Google Benchmark: the static library where one is installed, so that the
# benchmark runs where Google Benchmark is not; else its shared library,
# copied beside the benchmark.
BENCH_LIB=()
for d in /usr/local/lib /usr/local/lib64 /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib; do
  if [[ -e "$d/libbenchmark.a" ]]; then
    BENCH_LIB=("$d/libbenchmark.a")
    break
  fi
done
if [[ ${#BENCH_LIB[@]} -eq 0 ]]; then
  for d in /usr/local/lib /usr/local/lib64 /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib; do
    if [[ -e "$d/libbenchmark.so" ]]; then
      soname="$(objdump -p "$d/libbenchmark.so" | awk '$1 == "SONAME" { print $2 }')"
      install -m 755 "$(readlink -f "$d/libbenchmark.so")" "$OUT/$soname"
      BENCH_LIB=("-L$d" -lbenchmark)
      break
    fi
  done
fi
[[ ${#BENCH_LIB[@]} -gt 0 ]] || {
  echo "build: Google Benchmark (libbenchmark) is not installed" >&2
  exit 1
}
GTEST_LIBS=()
for lib in gmock gtest; do
  a="$(compgen -G "/usr/lib/x86_64-linux-gnu/lib$lib.a" || compgen -G "/usr/local/lib/lib$lib.a" ||
    compgen -G "/usr/lib64/lib$lib.a" || true)"
  [[ -n "$a" ]] || {
    echo "build: lib$lib.a (Google Test) is not installed" >&2
    exit 1
  }
  GTEST_LIBS+=("$a")
done

# --- RMM sources, patched ----------------------------------------------------------

# RMM's sources are never changed where fetch_rmm.sh left them: each build
# patches a fresh copy. Every patched line carries "magpie-rmm", and each
# patch checks that it applied, so that an RMM whose code moved stops the
# build here rather than building tests without magpie in them.
rm -rf "$WORK"
mkdir -p "$WORK/obj"
cp -r "$SRC/cpp" "$WORK/cpp"
T="$WORK/cpp/tests/mr"

expect_marks() { # FILE COUNT: the patch left COUNT "magpie-rmm" lines in FILE
  local n
  n="$(grep -c 'magpie-rmm' "$1" || true)"
  [[ "$n" == "$2" ]] || {
    echo "build: patching $1 left $n marked lines, not $2: RMM's code there changed; update build.sh" >&2
    exit 1
  }
}

# 1. mr_ref_test.hpp: a "Magpie" entry in mr_factory_dispatch, which picks the
#    resource of the parameterized suites by name.
sed -i \
  -e 's|^#include <rmm/resource_ref.hpp>$|&\n#include <magpie_rmm.hpp>  // magpie-rmm: the "Magpie" resource below|' \
  -e '/^struct mr_factory_base {/i\
// magpie-rmm: magpie'"'"'s resource (include/magpie_rmm.hpp), added by integrations/rmm/build.sh\
inline auto make_magpie() { return std::make_shared<magpie::rmm_memory_resource>(); }\
' \
  -e 's|^  if (name == "CUDA") {$|  if (name == "Magpie") {  // magpie-rmm: added by integrations/rmm/build.sh\
    return std::make_shared<mr_factory<magpie::rmm_memory_resource, decltype(make_magpie)>>(\
      "Magpie", make_magpie);\
  } else if (name == "CUDA") {|' \
  "$T/mr_ref_test.hpp"
expect_marks "$T/mr_ref_test.hpp" 3

# 2. mr_ref_<adaptor>_tests.cpp: RMM's typed suites over an adaptor, whose
#    fixture owns a cuda_memory_resource as the adaptor's upstream. Make it
#    magpie's (cuda_memory_resource again under MAGPIE_RMM_BASELINE=1):
#    otherwise these tests would not touch magpie at all.
patch_fixture_upstream() {
  sed -i \
    -e '0,/^#include/s|^#include|#include <magpie_rmm_test.hpp>  // magpie-rmm: magpie_rmm_test::upstream()\n&|' \
    -e 's|^\( *\)rmm::mr::cuda_memory_resource \([a-z_]*\){};$|\1rmm::device_async_resource_ref \2{magpie_rmm_test::upstream()};  // magpie-rmm: was a cuda_memory_resource|' \
    "$1"
  expect_marks "$1" 2
}

# 3. random_allocations.cpp: a "magpie" resource beside RMM's, by the same
#    names (-r magpie, BM_RandomAllocations/magpie_mr/...), in the default
#    set run without -r, and in profiling mode (-p). In the default set it
#    runs last: magpie keeps the memory it cached after its resource object
#    is gone, which would leave less free memory to the pool and arena
#    resources that size themselves by it.
B="$WORK/cpp/benchmarks/random_allocations/random_allocations.cpp"
MAKE_MAGPIE='#include <magpie_rmm_bench.hpp>  // magpie-rmm: make_magpie(), the "magpie" resource'
sed -i \
  -e "s|^#include <rmm/resource_ref.hpp>\$|&\n$MAKE_MAGPIE|" \
  -e 's|^#include <rmm/cuda_device.hpp>$|&\n#include <rmm/cuda_stream_view.hpp>  // magpie-rmm: used, and no longer included by the 26.10 headers|' \
  -e 's|^  if (name == "cuda") {$|  if (name == "magpie") {  // magpie-rmm: added by integrations/rmm/build.sh\
    BENCHMARK_CAPTURE(BM_RandomAllocations, magpie_mr, \&make_magpie)  // NOLINT\
      ->Apply(benchmark_range);\
  } else if (name == "cuda") {|' \
  -e 's|^\( *std::map<std::string, MRFactoryFunc> const funcs({\)\({"arena", &make_arena},\)$|\1{"magpie", \&make_magpie},  // magpie-rmm\n                                                        \2|' \
  -e 's|^\( *std::vector<std::string> mrs{"pool", .*\)};$|\1, "magpie"};  // magpie-rmm|' \
  "$B"
expect_marks "$B" 5

# 4. multi_stream_allocations_bench.cu (CUDA source, built with nvcc): the
#    same "magpie" resource (-r magpie, BM_MultiStreamAllocations/magpie/...),
#    in the default set last.
M="$WORK/cpp/benchmarks/multi_stream_allocations/multi_stream_allocations_bench.cu"
sed -i \
  -e "s|^#include <rmm/resource_ref.hpp>\$|&\n$MAKE_MAGPIE|" \
  -e 's|^  if (resource_name == "cuda") { return &make_cuda; }$|  if (resource_name == "magpie") { return \&make_magpie; }  // magpie-rmm\n&|' \
  -e 's|^  if (name == "cuda") {$|  if (name == "magpie") {  // magpie-rmm: added by integrations/rmm/build.sh\
    BENCHMARK_CAPTURE(BM_MultiStreamAllocations, magpie, \&make_magpie)  // NOLINT\
      ->Apply(benchmark_range);\
    return;\
  }\
\
&|' \
  -e 's|^\( *\)resource_names.emplace_back("binning");$|&\n\1resource_names.emplace_back("magpie");  // magpie-rmm|' \
  -e 's|^\( *\)compute_bound_kernel<<<1, 1, 0, stream.value()>>>(buffer.data());$|\1// magpie-rmm: 26.10 pools hand out cuda::stream_ref (get(), not value())\n\1compute_bound_kernel<<<1, 1, 0, stream.get()>>>(buffer.data());|' \
  "$M"
expect_marks "$M" 5

# Google Benchmark before 1.8 names its benchmark class benchmark::internal::
# Benchmark only; RMM's benchmarks use the benchmark::Benchmark of later
# versions. Where the installed one lacks it, a header forced into the
# benchmark's compilation supplies the name.
BENCH_FLAGS=()
if ! printf '#include <benchmark/benchmark.h>\nbenchmark::Benchmark *b;\n' |
  "$CXX" -std=c++20 -fsyntax-only -x c++ - 2> /dev/null; then
  mkdir -p "$WORK/compat"
  printf '%s\n' '/* magpie-rmm: benchmark::Benchmark for Google Benchmark < 1.8 (integrations/rmm/build.sh) */' \
    '#include <benchmark/benchmark.h>' 'namespace benchmark {' 'using Benchmark = internal::Benchmark;' '}' \
    > "$WORK/compat/benchmark_compat.hpp"
  BENCH_FLAGS=(-include "$WORK/compat/benchmark_compat.hpp")
fi

# --- what is built -----------------------------------------------------------------

# RMM's test files of cpp/tests/mr about adaptors, resource refs and
# allocators, built as they are: those taking the current device resource
# as upstream run on magpie through magpie_test_main.cpp.
PLAIN_TESTS=(
  adaptor_tests aligned_mr_tests callback_mr_tests cccl_adaptor_tests failure_callback_mr_tests
  limiting_mr_tests polymorphic_allocator_tests prefetch_resource_adaptor_tests
  resource_ref_conversion_tests statistics_mr_tests stream_allocator_adaptor_tests tracking_mr_tests
)
# RMM's typed suites over each adaptor, with the fixture patched (2. above).
ADAPTOR_REF_TESTS=(
  mr_ref_aligned_tests mr_ref_callback_tests mr_ref_failure_callback_tests mr_ref_limiting_tests
  mr_ref_logging_tests mr_ref_prefetch_tests mr_ref_statistics_tests mr_ref_thread_safe_tests
  mr_ref_tracking_tests
)
for t in "${ADAPTOR_REF_TESTS[@]}"; do
  if [[ -e "$T/$t.cpp" ]]; then patch_fixture_upstream "$T/$t.cpp"; fi
done
# Beyond cpp/tests/mr: RMM's containers over the current device resource
# (host C++ too), so over magpie.
CONTAINER_TESTS=(device_scalar_tests device_uvector_tests)

# name:source pairs for the test binaries. RMM's CMake builds every test a
# second time with the per-thread default stream (its _PTDS_TEST binaries);
# so does this build for the suites on magpie itself (rmm_mr_tests_ptds).
TEST_BINARIES=("rmm_mr_tests:$HERE/mr_ref_magpie_tests.cpp" "rmm_mr_tests_ptds:$HERE/mr_ref_magpie_tests.cpp")
declare -A TEST_FLAGS=([rmm_mr_tests_ptds]=-DCUDA_API_PER_THREAD_DEFAULT_STREAM)
for t in "${PLAIN_TESTS[@]}" "${ADAPTOR_REF_TESTS[@]}" "${CONTAINER_TESTS[@]}"; do
  for f in "$T/$t.cpp" "$WORK/cpp/tests/$t.cpp" ""; do
    if [[ -z "$f" ]]; then
      # Test files come and go between RMM versions.
      echo "build: note: RMM $RMM_COMMIT has no $t.cpp; not built"
    elif [[ -e "$f" ]]; then
      TEST_BINARIES+=("rmm_$t:$f")
      break
    fi
  done
done

# --- compiling -------------------------------------------------------------------

# The include order matters: the wheel's CCCL (include/rapids: cuda/, cub/,
# thrust/), which librmm was built with, comes before the toolkit's own.
INCLUDES=(
  -I"$HERE" -I"$ROOT/include"
  -I"$WHL/librmm/include/rapids" -I"$CUDA_HOME/include"
  -I"$WHL/librmm/include" -I"$WHL/rapids_logger/include"
  -I"$T" -I"$WORK/cpp"
)
# The definitions librmm's CMake package gives its users (rmm-dependencies.cmake
# and RMM's test CMakeLists: log level INFO, RMM's default). RMM's tests build
# with -Werror; here their warnings are shown but do not fail the build, the
# tests coming from a commit other than the headers'. Deprecations are not
# shown (RMM's DISABLE_DEPRECATION_WARNING): 26.10 deprecates the
# cuda_stream_view that tests of earlier commits use throughout.
CXXFLAGS=(
  -std=c++20 -O2 -pthread -Wall -Wextra -Wno-unknown-pragmas -Wno-deprecated-declarations
  -DCUB_DISABLE_NAMESPACE_MAGIC -DCUB_IGNORE_NAMESPACE_MAGIC_ERROR
  -DTHRUST_DISABLE_ABI_NAMESPACE -DTHRUST_IGNORE_ABI_NAMESPACE_ERROR -DCCCL_DISABLE_PDL
  -DRMM_LOG_ACTIVE_LEVEL=RAPIDS_LOGGER_LOG_LEVEL_INFO
)
# librmm.so, librapids_logger.so and libmagpie.so from OUTDIR ($ORIGIN); the
# CUDA runtime dynamically, from the system (or CUDA_HOME/lib64, searched
# after it by the second RUNPATH entry).
# shellcheck disable=SC2016,SC2054 # a literal $ORIGIN; commas are the linker's
LDFLAGS=(
  -pthread -Wl,-rpath,'$ORIGIN' -Wl,-rpath,"$CUDA_HOME/lib64" -Wl,--as-needed
  -L"$OUT" -lrmm -lrapids_logger -lmagpie -L"$CUDA_HOME/lib64" -lcudart -ldl
)

compile() { # SOURCE OBJECT [FLAG...]
  local src="$1" obj="$2"
  shift 2
  if ! "$CXX" "${CXXFLAGS[@]}" "${INCLUDES[@]}" "$@" -c "$src" -o "$obj" 2> "$obj.log"; then
    cat "$obj.log" >&2
    echo "build: compiling $src failed" >&2
    return 1
  fi
  # Warnings, if any, once per file.
  if [[ -s "$obj.log" ]]; then
    echo "build: warnings compiling $(basename "$src"): $(grep -c 'warning:' "$obj.log" || true) (see $obj.log)"
  fi
}

# CUDA sources: nvcc with CXX as the host compiler, code for compute
# capability 9.0 (H100, H200) and its PTX for later devices.
# Definitions and the optimisation level go to nvcc (device code needs the
# CCCL ones too), warnings and threads to the host compiler; FLAGs (a forced
# include) to nvcc, which passes them on once.
compile_cu() { # SOURCE OBJECT [FLAG...]
  local src="$1" obj="$2" f flags=()
  shift 2
  for f in "${CXXFLAGS[@]:1}"; do
    case "$f" in
      -D* | -O*) flags+=("$f") ;;
      *) flags+=(-Xcompiler "$f") ;;
    esac
  done
  if ! "$CUDA_HOME/bin/nvcc" -std=c++20 -ccbin "$CXX" -gencode arch=compute_90,code='[sm_90,compute_90]' \
    --expt-relaxed-constexpr --expt-extended-lambda "${flags[@]}" "$@" "${INCLUDES[@]}" -c "$src" -o "$obj" \
    2> "$obj.log"; then
    cat "$obj.log" >&2
    echo "build: compiling $src failed" >&2
    return 1
  fi
}

# Compilations run JOBS at a time; the first failure stops the build.
pids=()
run_job() {
  while [[ $(jobs -rp | wc -l) -ge $JOBS ]]; do wait -n || exit 1; done
  "$@" &
  pids+=($!)
}
wait_all() {
  local p
  for p in "${pids[@]}"; do wait "$p" || exit 1; done
  pids=()
}

echo "build: compiling ${#TEST_BINARIES[@]} test files, the test main and the benchmark ($JOBS at a time)"
run_job compile "$HERE/magpie_test_main.cpp" "$WORK/obj/magpie_test_main.o"
for entry in "${TEST_BINARIES[@]}"; do
  name="${entry%%:*}"
  run_job compile "${entry#*:}" "$WORK/obj/$name.o" ${TEST_FLAGS[$name]:+"${TEST_FLAGS[$name]}"}
done
run_job compile "$B" "$WORK/obj/rmm_random_allocations.o" "${BENCH_FLAGS[@]}"
run_job compile_cu "$M" "$WORK/obj/rmm_multi_stream_allocations.o" "${BENCH_FLAGS[@]}"
wait_all

# --- linking -------------------------------------------------------------------------

for entry in "${TEST_BINARIES[@]}"; do
  name="${entry%%:*}"
  "$CXX" -o "$OUT/$name" "$WORK/obj/$name.o" "$WORK/obj/magpie_test_main.o" "${GTEST_LIBS[@]}" "${LDFLAGS[@]}"
  strip "$OUT/$name"
done
"$CXX" -o "$OUT/rmm_random_allocations" "$WORK/obj/rmm_random_allocations.o" "${BENCH_LIB[@]}" "${LDFLAGS[@]}"
strip "$OUT/rmm_random_allocations"
"$CXX" -o "$OUT/rmm_multi_stream_allocations" "$WORK/obj/rmm_multi_stream_allocations.o" "${BENCH_LIB[@]}" \
  "${LDFLAGS[@]}"
strip "$OUT/rmm_multi_stream_allocations"

# What the binaries were built from, for their results to name it.
{
  echo "rmm_source_commit $RMM_COMMIT"
  echo "rmm_source_version $(cat "$SRC/VERSION")"
  echo "rmm_source_origin $(cat "$SRC/ORIGIN")"
  echo "librmm_wheel_version $(tr -d '[:space:]' < "$WHL/librmm/VERSION")"
  echo "librmm_wheel_commit $(tr -d '[:space:]' < "$WHL/librmm/GIT_COMMIT")"
  echo "magpie_commit $(git -C "$ROOT" rev-parse HEAD 2> /dev/null || echo unknown)"
  echo "tests ${TEST_BINARIES[*]%%:*}"
} > "$OUT/BUILD_INFO"

echo "build: done: $OUT ($(du -sh "$OUT" | cut -f1))"
