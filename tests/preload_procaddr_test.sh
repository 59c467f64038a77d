#!/usr/bin/env bash
# Runs preload_procaddr_test (tests/preload_procaddr_test.c) with the
# stand-in driver as libcuda.so.1 and the stand-in shared runtime as
# libcudart.so.13 and libcudart-0a1b2c3d.so.12 (auditwheel's renaming) on
# the library path: once as is, once under LD_PRELOAD=libmagpie_preload.so.
# MAGPIE_BACKEND=cuda: magpie finds no device in the stand-in and says so,
# rather than looking for the simulator.
#   preload_procaddr_test.sh PROGRAM PRELOAD FAKE_DRIVER FAKE_RUNTIME LIBMAGPIE
set -euo pipefail
prog=$(realpath "$1")
preload=$(realpath "$2")
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
ln -s "$(realpath "$3")" "$dir/libcuda.so.1"
ln -s "$(realpath "$4")" "$dir/libcudart.so.13"
cp "$(realpath "$4")" "$dir/libcudart-0a1b2c3d.so.12" # another file: loaded a second time
libmagpie=$(realpath "$5")
export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" MAGPIE_BACKEND=cuda
echo "### plain"
"$prog" plain "$libmagpie"
echo "### LD_PRELOAD=libmagpie_preload.so"
LD_PRELOAD="$preload" "$prog" preload "$libmagpie"
