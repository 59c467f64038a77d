#!/usr/bin/env bash
# What the shared objects export: libmagpie.so magpie_* and nothing of the
# simulated device (magpie_sim_*: that is libmagpie_sim.so, a library of its
# own); libmagpie_sim.so magpie_sim_* only, so it carries no copy of the
# allocator. (Running libmagpie.so on the simulated device with
# libmagpie_sim.so beside it: install_test.sh and python_stats_test.sh.)
set -euo pipefail
lib=$1
sim=$2
failed=0
# Global symbols a shared object defines (nm -D: its dynamic symbol table).
exported() { nm -D --defined-only "$1" | awk 'NF == 3 && $2 ~ /^[A-Z]$/ {print $3}'; }
if exported "$lib" | grep '^magpie_sim_'; then
  echo "FAIL: libmagpie.so defines the simulator's functions above"
  failed=1
fi
if ! exported "$lib" | grep -qx 'magpie_malloc_async'; then
  echo "FAIL: libmagpie.so does not export magpie_malloc_async"
  failed=1
fi
if exported "$sim" | grep -v '^magpie_sim_'; then
  echo "FAIL: libmagpie_sim.so exports more than magpie_sim_* (above)"
  failed=1
fi
for f in magpie_sim_device_table magpie_sim_stream_create magpie_sim_last_error; do
  if ! exported "$sim" | grep -qx "$f"; then
    echo "FAIL: libmagpie_sim.so does not export $f"
    failed=1
  fi
done
# Loadable with dlopen after start-up with glibc's defaults: no object in it
# uses the initial-exec TLS model, which marks the library STATIC_TLS and
# needs room glibc does not set aside (tools/build_jemalloc.sh, defs.bzl).
# Sanitizer builds are exempt: their runtimes are initial-exec themselves.
if ! grep -qa -e '__tsan_func_entry' -e '__asan_init' "$lib" && readelf -dW "$lib" | grep -q STATIC_TLS; then
  echo "FAIL: libmagpie.so needs static TLS (an initial-exec thread-local variable): dlopen after start-up fails"
  failed=1
fi
# Built by gcc, its thread-local variables are reached through TLS
# descriptors (defs.bzl, MAGPIE_LIB_COPTS), not the slower default model.
if ! readelf -p .comment "$lib" 2>/dev/null | grep -q clang && ! readelf -rW "$lib" | grep -q TLSDESC; then
  echo "FAIL: libmagpie.so built by gcc reaches its thread-local variables without TLS descriptors (-mtls-dialect=gnu2)"
  failed=1
fi
if ((failed)); then exit 1; fi
echo "exports: PASS ($(exported "$lib" | wc -l) in libmagpie.so, $(exported "$sim" | wc -l) in libmagpie_sim.so)"
