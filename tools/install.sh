#!/usr/bin/env bash
# Installs magpie under PREFIX:
#   PREFIX/include/magpie.h, magpie_sim.h, magpie_rmm.hpp
#   PREFIX/lib/libmagpie.so, libmagpie.a, libmagpie_preload.so
#   PREFIX/lib/libmagpie_sim.so, libmagpie_sim.a (the simulated device;
#     libmagpie.so loads libmagpie_sim.so from its own folder when needed)
#   PREFIX/lib/pkgconfig/magpie.pc
#
#   bazel run -c opt //:install -- PREFIX      (PREFIX relative to where
#                                               bazel was started, or absolute)
# Run by Bazel: the files are in this script's runfiles.
set -euo pipefail

if (($# != 1)); then
  echo "usage: bazel run -c opt //:install -- PREFIX" >&2
  exit 2
fi
prefix=$1
if [[ $prefix != /* ]]; then
  prefix="${BUILD_WORKING_DIRECTORY:-$PWD}/$prefix"
fi

# The runfiles tree (bazel run starts here; a direct run may not).
src=${MAGPIE_INSTALL_FROM:-${RUNFILES_DIR:-$0.runfiles}/magpie}
[[ -f $src/include/magpie.h ]] || src=$PWD
for f in include/magpie.h include/magpie_rmm.hpp include/magpie_sim.h magpie.pc.in libmagpie.so libmagpie_preload.so \
  libmagpie_sim.so static/libmagpie.a static/libmagpie_sim.a; do
  if [[ ! -f $src/$f ]]; then
    echo "install: $f not found under $src (run through: bazel run -c opt //:install -- PREFIX)" >&2
    exit 1
  fi
done

version=$(sed -n 's/^#define MAGPIE_VERSION_STRING "\(.*\)"$/\1/p' "$src/include/magpie.h")
if [[ -z $version ]]; then
  echo "install: no MAGPIE_VERSION_STRING in magpie.h" >&2
  exit 1
fi

mkdir -p "$prefix/include" "$prefix/lib/pkgconfig"
install -m 0644 "$src/include/magpie.h" "$src/include/magpie_rmm.hpp" "$src/include/magpie_sim.h" "$prefix/include/"
install -m 0755 "$src/libmagpie.so" "$src/libmagpie_preload.so" "$src/libmagpie_sim.so" "$prefix/lib/"
install -m 0644 "$src/static/libmagpie.a" "$src/static/libmagpie_sim.a" "$prefix/lib/"
sed -e "s|@PREFIX@|$prefix|" -e "s|@VERSION@|$version|" "$src/magpie.pc.in" > "$prefix/lib/pkgconfig/magpie.pc"
chmod 0644 "$prefix/lib/pkgconfig/magpie.pc"
echo "installed magpie $version under $prefix"
echo "  compile and link: cc app.c \$(PKG_CONFIG_PATH=$prefix/lib/pkgconfig pkg-config --cflags --libs magpie)"
echo "  (add -lmagpie_sim where the program calls magpie_sim_*)"
