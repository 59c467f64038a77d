#!/usr/bin/env bash
# Builds the jemalloc that holds magpie's host metadata, from Debian's source
# package, into .jemalloc/ at the repository root (git ignores it;
# third_party/local_libs.bzl links .jemalloc/lib/libjemalloc_pic.a into
# libmagpie). Called by tools/install_deps.sh; safe to run repeatedly (a
# stamp records the version and flags built).
#
# Why not Debian's libjemalloc_pic.a: it keeps 2.6 KiB of thread-local state
# in the initial-exec model, which a library loaded with dlopen after
# start-up (Python's ctypes, PyTorch) can only get with
# GLIBC_TUNABLES=glibc.rtld.optional_static_tls=16384 set before the process
# starts. Built with --disable-initial-exec-tls, its thread-local state is
# allocated as any dlopened library's is. The mpje_ prefix and private
# namespace keep every jemalloc symbol apart from the application's malloc
# (the linking step then makes all but five of them local).
#
# The source: $MAGPIE_JEMALLOC_SRC (a jemalloc_*.orig.tar.bz2) if set, else
# `apt-get source --download-only jemalloc` (a deb-src entry for the
# system's Debian suites is added if there is none; apt checks the files
# against the signed Sources index).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$root/.jemalloc
flags=(--disable-initial-exec-tls --with-jemalloc-prefix=mpje_ --with-private-namespace=mpje_ --disable-cxx
  --with-pic --disable-doc)
stamp="jemalloc ${flags[*]}"
if [[ -f $out/lib/libjemalloc_pic.a && -f $out/STAMP && $(cat "$out/STAMP") == "$stamp" ]]; then
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
mkdir -p "$out/src"
tarball=${MAGPIE_JEMALLOC_SRC:-}
if [[ -z $tarball ]]; then
  tarball=$(compgen -G "$out/src/jemalloc_*.orig.tar.bz2" | head -1 || true)
fi
if [[ -z $tarball ]]; then
  if ! grep -rqs '^Types:.*deb-src\|^deb-src ' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    suites=$(sed -n 's/^Suites: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)
    suites=${suites:-$(. /etc/os-release && echo "$VERSION_CODENAME")}
    echo "adding a deb-src entry for Debian $suites (/etc/apt/sources.list.d/magpie-deb-src.sources)"
    printf 'Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: %s\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
      "$suites" | $SUDO tee /etc/apt/sources.list.d/magpie-deb-src.sources > /dev/null
    $SUDO apt-get update -qq
  fi
  (cd "$out/src" && apt-get source --download-only jemalloc > /dev/null 2>&1) || {
    echo "apt-get source jemalloc failed: add a deb-src entry, or set MAGPIE_JEMALLOC_SRC to a jemalloc source tarball" >&2
    exit 1
  }
  tarball=$(compgen -G "$out/src/jemalloc_*.orig.tar.bz2" | head -1)
fi
echo "building jemalloc from $(basename "$tarball") (${flags[*]}) into $out"
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
tar -xjf "$tarball" -C "$build" --strip-components=1
(
  cd "$build"
  ./configure "${flags[@]}" > configure.log 2>&1 || {
    tail -30 configure.log >&2
    exit 1
  }
  make -j"$(nproc)" build_lib_static > make.log 2>&1 || {
    tail -30 make.log >&2
    exit 1
  }
)
mkdir -p "$out/lib"
cp "$build/lib/libjemalloc_pic.a" "$out/lib/libjemalloc_pic.a"
echo "$stamp" > "$out/STAMP"
# Bazel reads the archive through a repository rule: let it look again.
if command -v bazel > /dev/null 2>&1 && [[ -d $root/bazel-bin ]]; then (cd "$root" && bazel shutdown 2> /dev/null) || true; fi
