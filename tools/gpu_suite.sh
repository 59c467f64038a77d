#!/usr/bin/env bash
# Builds magpie's GPU tests here (no GPU needed) and bundles them, with the
# shared libraries a GPU machine may lack, into .gpu_bundle/ for running
# there with `bash .gpu_bundle/run.sh [--sanitize]` (see tests/gpu/README.md).
#
#   tools/gpu_suite.sh build [--keep-going] [TARGET...]
#
# Builds (-c opt) every test tagged "gpu" plus each TARGET given (benchmarks,
# //:demo, ...). Tests land in .gpu_bundle/tests/ and run.sh runs them all;
# other targets land in .gpu_bundle/bin/ (run.sh --bin NAME runs one).
# --keep-going builds target by target and bundles those that build,
# listing the others, instead of stopping at the first failure.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# MAGPIE_GPU_BUNDLE names another folder under the repository root (it must
# start with .gpu_ so that git ignores it), for bundles built side by side.
bundle="$root/${MAGPIE_GPU_BUNDLE:-.gpu_bundle}"

usage() {
  sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  exit 2
}

# Libraries every Linux GPU machine has (glibc, the compiler runtime) or
# must have its own of (the CUDA driver): never bundled.
system_lib() {
  case "$1" in
    linux-vdso.so* | ld-linux*.so* | libc.so* | libm.so* | libdl.so* | libpthread.so* | \
      librt.so* | libutil.so* | libresolv.so* | libgcc_s.so* | libstdc++.so* | \
      libcuda.so* | libnvidia-*.so*) return 0 ;;
  esac
  return 1
}

# //pkg:name or //pkg or :name -> the output path under bazel-bin.
output_of() {
  local label=$1 pkg name
  label=${label#@//}
  label=${label#//}
  if [[ $label == *:* ]]; then
    pkg=${label%%:*}
    name=${label#*:}
  else
    pkg=$label
    name=${label##*/}
  fi
  echo "$root/bazel-bin/${pkg:+$pkg/}$name"
}

bundle_libs() {
  local bin=$1 line name path
  while read -r line; do
    # "libx.so.1 => /path/libx.so.1 (0x...)" or "libx.so.1 => not found"
    [[ $line == *"=>"* ]] || continue
    name=${line%% =>*}
    path=${line#*=> }
    path=${path%% (*}
    system_lib "$name" && continue
    if [[ $path == "not found" ]]; then
      echo "warning: $(basename "$bin") needs $name, which is not found here" >&2
      continue
    fi
    [[ -e $bundle/lib/$name ]] || cp -L "$path" "$bundle/lib/$name"
  done < <(ldd "$bin")
}

build() {
  local keep=0 targets=() extras=() t
  while (($#)); do
    case "$1" in
      --keep-going) keep=1 ;;
      -h | --help) usage ;;
      -*) echo "unknown option $1" >&2; usage ;;
      *) extras+=("$1") ;;
    esac
    shift
  done
  cd "$root"
  # Query sees manual targets (the GPU tests are tagged manual).
  mapfile -t targets < <(bazel query 'attr(tags, "\bgpu\b", tests(//...))' 2>/dev/null)
  if ((${#targets[@]} == 0)); then
    echo "no GPU tests found (is the CUDA toolkit installed? see @cuda//:defs.bzl)" >&2
    exit 1
  fi

  local built=() failed=()
  if ((keep)); then
    for t in "${targets[@]}" "${extras[@]}"; do
      if bazel build -c opt "$t"; then built+=("$t"); else failed+=("$t"); fi
    done
  else
    bazel build -c opt "${targets[@]}" "${extras[@]}"
    built=("${targets[@]}" "${extras[@]}")
  fi

  rm -rf "$bundle"
  mkdir -p "$bundle/tests" "$bundle/bin" "$bundle/lib"
  for t in "${built[@]}"; do
    local out dest=bin
    out=$(output_of "$t")
    if [[ ! -x $out || -d $out ]]; then
      echo "warning: $t has no executable output at $out; not bundled" >&2
      continue
    fi
    for x in "${targets[@]}"; do [[ $x == "$t" ]] && dest=tests; done
    cp -L "$out" "$bundle/$dest/"
    chmod u+w "$bundle/$dest/$(basename "$out")"
    bundle_libs "$out"
  done
  cp "$root/tests/gpu/run.sh" "$bundle/run.sh"
  {
    echo "commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)$(
      git -C "$root" diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
    echo "built: $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(uname -m)"
    echo "tests: $(ls "$bundle/tests" | tr '\n' ' ')"
    echo "bin: $(ls "$bundle/bin" | tr '\n' ' ')"
    echo "lib: $(ls "$bundle/lib" | tr '\n' ' ')"
  } > "$bundle/MANIFEST"
  cat "$bundle/MANIFEST"
  echo "bundle: $bundle ($(du -sh "$bundle" | cut -f1)); run there: bash $(basename "$bundle")/run.sh [--sanitize]"
  if ((${#failed[@]})); then
    echo "not built: ${failed[*]}" >&2
    exit 1
  fi
}

case "${1:-}" in
  build) shift; build "$@" ;;
  *) usage ;;
esac
