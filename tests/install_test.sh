#!/usr/bin/env bash
# //:install puts headers, libraries and magpie.pc where they belong, and a
# program builds against them (static and shared, through pkg-config where
# it is installed) and runs on the simulated device: one that calls the
# simulator links it (libmagpie_sim), one that does not finds
# libmagpie_sim.so beside libmagpie.so (or on the loader's search path), and
# fails with a message naming it where it is neither.
set -euo pipefail
root=$TEST_SRCDIR/magpie
prefix=$TEST_TMPDIR/prefix
MAGPIE_INSTALL_FROM=$root "$root/tools/install.sh" "$prefix"
for f in include/magpie.h include/magpie_rmm.hpp include/magpie_sim.h lib/libmagpie.so lib/libmagpie.a lib/libmagpie_preload.so \
  lib/libmagpie_sim.so lib/libmagpie_sim.a lib/pkgconfig/magpie.pc; do
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
if nm -g --defined-only "$prefix/lib/libmagpie.a" | awk 'NF == 3 {print $3}' | grep '^magpie_sim_'; then
  echo "libmagpie.a contains the simulator (above)"
  exit 1
fi
if nm -g --defined-only "$prefix/lib/libmagpie_sim.a" | awk 'NF == 3 {print $3}' | grep -v '^magpie_sim_'; then
  echo "libmagpie_sim.a exports more than magpie_sim_* (above)"
  exit 1
fi
if nm -D --defined-only "$prefix/lib/libmagpie.so" | awk 'NF == 3 {print $3}' | grep '^magpie_sim_'; then
  echo "libmagpie.so defines the simulator's functions (above)"
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
cc -o "$TEST_TMPDIR/app_static" "$TEST_TMPDIR/app.c" -I"$prefix/include" "$prefix/lib/libmagpie.a" \
  "$prefix/lib/libmagpie_sim.a" -lpthread -ldl -lm
MAGPIE_BACKEND=sim "$TEST_TMPDIR/app_static"
if command -v pkg-config > /dev/null; then
  flags=$(PKG_CONFIG_PATH=$prefix/lib/pkgconfig pkg-config --cflags --libs magpie)
else
  flags="-I$prefix/include -L$prefix/lib -lmagpie"
fi
# shellcheck disable=SC2086
cc -o "$TEST_TMPDIR/app_shared" "$TEST_TMPDIR/app.c" $flags -lmagpie_sim -Wl,-rpath,"$prefix/lib"
MAGPIE_BACKEND=sim "$TEST_TMPDIR/app_shared"

# A program that calls magpie_* only: magpie loads the simulator itself.
cat > "$TEST_TMPDIR/plain.c" <<'C'
#include <magpie.h>
#include <stdio.h>
int main(void) {
  void *p = magpie_malloc(1 << 20);
  if (p == NULL) {
    printf("%s\n", magpie_last_error_message());
    return 1;
  }
  if (magpie_active_backend() != MAGPIE_BACKEND_SIM) return 2;
  return magpie_free(p) == MAGPIE_OK ? 0 : 3;
}
C
# shellcheck disable=SC2086
cc -o "$TEST_TMPDIR/plain_shared" "$TEST_TMPDIR/plain.c" $flags -Wl,-rpath,"$prefix/lib"
MAGPIE_BACKEND=sim "$TEST_TMPDIR/plain_shared"
# libmagpie.so alone in a folder: no simulated device, and a message that
# says how to make it available.
mkdir -p "$TEST_TMPDIR/alone"
cp "$prefix/lib/libmagpie.so" "$TEST_TMPDIR/alone/"
# shellcheck disable=SC2086
cc -o "$TEST_TMPDIR/plain_alone" "$TEST_TMPDIR/plain.c" -I"$prefix/include" -L"$TEST_TMPDIR/alone" -lmagpie \
  -Wl,-rpath,"$TEST_TMPDIR/alone"
if out=$(MAGPIE_BACKEND=sim "$TEST_TMPDIR/plain_alone"); then
  echo "libmagpie.so alone started the simulated device"
  exit 1
fi
grep -q "libmagpie_sim.so beside libmagpie.so" <<< "$out" || { echo "unhelpful message: $out"; exit 1; }
# ... which then comes from the loader's search path.
MAGPIE_BACKEND=sim LD_LIBRARY_PATH=$prefix/lib "$TEST_TMPDIR/plain_alone"
# Statically linked magpie: the simulator from the search path.
cc -o "$TEST_TMPDIR/plain_static" "$TEST_TMPDIR/plain.c" -I"$prefix/include" "$prefix/lib/libmagpie.a" \
  -lpthread -ldl -lm
MAGPIE_BACKEND=sim LD_LIBRARY_PATH=$prefix/lib "$TEST_TMPDIR/plain_static"
echo "install: PASS"
