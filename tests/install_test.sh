#!/usr/bin/env bash
# //:install puts headers, libraries and magpie.pc where they belong, and a
# program builds against them (static and shared, through pkg-config where
# it is installed) and runs on the simulated device.
set -euo pipefail
root=$TEST_SRCDIR/magpie
prefix=$TEST_TMPDIR/prefix
MAGPIE_INSTALL_FROM=$root "$root/tools/install.sh" "$prefix"
for f in include/magpie.h include/magpie_sim.h lib/libmagpie.so lib/libmagpie.a lib/libmagpie_preload.so \
  lib/pkgconfig/magpie.pc; do
  [[ -f $prefix/$f ]] || { echo "missing $prefix/$f"; exit 1; }
done
version=$(sed -n 's/^#define MAGPIE_VERSION_STRING "\(.*\)"$/\1/p' "$prefix/include/magpie.h")
grep -qx "Version: $version" "$prefix/lib/pkgconfig/magpie.pc" || { echo "magpie.pc: wrong version"; exit 1; }
grep -qx "prefix=$prefix" "$prefix/lib/pkgconfig/magpie.pc" || { echo "magpie.pc: wrong prefix"; exit 1; }
# Only magpie_* (and jemalloc's renamed mpje_*) are global in the archive.
if nm -g --defined-only "$prefix/lib/libmagpie.a" | awk 'NF == 3 {print $3}' | grep -v '^magpie_\|^mpje_'; then
  echo "libmagpie.a exports internal symbols (above)"
  exit 1
fi
# Sanitizer builds instrument the libraries: a plain compiler cannot link
# them. (grep without -q: nm must not die of SIGPIPE under pipefail.)
if nm "$prefix/lib/libmagpie.a" | grep '__tsan_\|__asan_' > /dev/null; then
  echo "sanitizer build: files checked, program not built"
  exit 0
fi
cat > "$TEST_TMPDIR/app.c" <<'C'
#include <magpie.h>
#include <magpie_sim.h>
#include <stdio.h>
#include <string.h>
int main(void) {
  if (strcmp(magpie_version(), MAGPIE_VERSION_STRING) != 0) return 3;
  cudaStream_t s = magpie_sim_stream_create();
  void *p = magpie_malloc_async(1 << 20, s);
  if (p == NULL || magpie_usable_size(p) != 1 << 20) return 4;
  printf("magpie %s: %p\n", magpie_version(), p);
  return magpie_free_async(p, s) == MAGPIE_OK ? 0 : 5;
}
C
cc -o "$TEST_TMPDIR/app_static" "$TEST_TMPDIR/app.c" -I"$prefix/include" "$prefix/lib/libmagpie.a" -lpthread -ldl -lm
MAGPIE_BACKEND=sim "$TEST_TMPDIR/app_static"
if command -v pkg-config > /dev/null; then
  flags=$(PKG_CONFIG_PATH=$prefix/lib/pkgconfig pkg-config --cflags --libs magpie)
else
  flags="-I$prefix/include -L$prefix/lib -lmagpie"
fi
# shellcheck disable=SC2086
cc -o "$TEST_TMPDIR/app_shared" "$TEST_TMPDIR/app.c" $flags -Wl,-rpath,"$prefix/lib"
MAGPIE_BACKEND=sim "$TEST_TMPDIR/app_shared"
echo "install: PASS"
