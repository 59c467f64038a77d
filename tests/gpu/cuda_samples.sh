#!/usr/bin/env bash
# NVIDIA's CUDA samples (github.com/NVIDIA/cuda-samples; not part of this
# repository) built with nvcc's -cudart shared and -cudart static, each run
# plainly and under LD_PRELOAD=libmagpie_preload.so with
# MAGPIE_CONF=verbose=1, whose statistics at exit show whether magpie
# served it. On a GPU machine with the CUDA toolkit:
#
#   tests/gpu/cuda_samples.sh SAMPLES_DIR PRELOAD_LIB [OUT_DIR]
#
# SAMPLES_DIR holds Common/ (the samples' headers) and src/NAME/ (each
# sample's .cu/.cpp files, copied from Samples/*/NAME). Prints one line per
# sample and runtime: plain and preload outcomes (exit status 0 and the
# sample's own "PASS"/"passed"/"Result = PASS" where it prints one), and
# the bytes magpie reserved at its peak under the preload (0: the sample
# allocated nothing magpie serves, such as graph memory nodes, mapped host
# memory or a pool of its own); then the samples that pass plainly and not
# under the preload ("regressions: N").
set -u
S=$(cd "$1" && pwd)
PRELOAD=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")
OUT=${3:-$(mktemp -d)}
mkdir -p "$OUT/bin" "$OUT/log"
ARCH=${ARCH:-sm_90}

libs_for() {
  case $1 in
    simpleCUBLAS) echo "-lcublas" ;;
    conjugateGradient) echo "-lcublas -lcusparse" ;;
    *) echo "" ;;
  esac
}

build() { # name runtime
  local n=$1 rt=$2 extra=()
  case $n in simpleIPC | streamOrderedAllocationIPC) extra=("$S/Common/helper_multiprocess.cpp") ;; esac
  # shellcheck disable=SC2046
  nvcc -O2 -std=c++17 -arch="$ARCH" -I"$S/Common" -I"$S/src/$n" -cudart "$rt" "$S/src/$n"/*.cu "$S/src/$n"/*.cpp \
    "${extra[@]}" $(libs_for "$n") -lcuda -o "$OUT/bin/$n.$rt" >"$OUT/log/$n.$rt.build" 2>&1
}

names=()
for d in "$S"/src/*/; do names+=("$(basename "$d")"); done
shopt -s nullglob
jobs=0
for n in "${names[@]}"; do
  for rt in shared static; do
    build "$n" "$rt" &
    jobs=$((jobs + 1))
    if ((jobs % 16 == 0)); then wait; fi
  done
done
wait
shopt -u nullglob

# The sample's own words, without magpie's statistics (whose "failed"
# counts requests, not the sample).
verdict() { # log rc
  if [[ $2 != 0 ]]; then echo "fail($2)"; return; fi
  if grep -vE "^magpie device|^  " "$1" | grep -qiE "waived|FAIL" && ! grep -qiE "PASS" "$1"; then
    echo "fail(output)"
    return
  fi
  echo "pass"
}

regress=()
printf '%-28s %-7s %-10s %-10s %s\n' sample runtime plain preload "magpie peak reserved (bytes)"
for n in "${names[@]}"; do
  for rt in shared static; do
    b=$OUT/bin/$n.$rt
    if [[ ! -x $b ]]; then
      printf '%-28s %-7s %s\n' "$n" "$rt" "build failed: $(tail -1 "$OUT/log/$n.$rt.build")"
      continue
    fi
    (cd "$OUT" && timeout 120 "$b" >"$OUT/log/$n.$rt.plain" 2>&1)
    p=$(verdict "$OUT/log/$n.$rt.plain" $?)
    (cd "$OUT" && MAGPIE_CONF=verbose=1 LD_PRELOAD=$PRELOAD timeout 120 "$b" >"$OUT/log/$n.$rt.preload" 2>&1)
    q=$(verdict "$OUT/log/$n.$rt.preload" $?)
    served=$(grep -oE "reserved [0-9]+ B \(peak [0-9]+\)" "$OUT/log/$n.$rt.preload" | grep -oE "peak [0-9]+" |
      grep -oE "[0-9]+" | sort -n | tail -1)
    printf '%-28s %-7s %-10s %-10s %s\n' "$n" "$rt" "$p" "$q" "${served:-0}"
    if [[ $p == pass && $q != pass ]]; then regress+=("$n.$rt"); fi
  done
done
echo "regressions: ${#regress[@]} ${regress[*]}"
echo "logs: $OUT/log"
