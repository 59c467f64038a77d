#!/usr/bin/env bash
# Installs what magpie's build needs on Debian, if missing: Bazel (Debian's
# bazel-bootstrap, used offline), cmocka, jemalloc (its headers from
# libjemalloc-dev; the library itself is built from Debian's source by
# tools/build_jemalloc.sh, last), clang with its runtime
# libraries (sanitizer builds, libFuzzer), clang-format (tools/format.sh), Relacy (model checking),
# matplotlib (the snapshot picture). Safe to run repeatedly.
set -euo pipefail
need=()
command -v bazel >/dev/null 2>&1 || need+=(bazel-bootstrap)
[ -e /usr/include/cmocka.h ] || need+=(libcmocka-dev)
[ -e /usr/include/jemalloc/jemalloc.h ] || need+=(libjemalloc-dev)
command -v clang >/dev/null 2>&1 || need+=(clang)
command -v clang-format >/dev/null 2>&1 || need+=(clang-format)
compgen -G "/usr/lib/llvm-14/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a" >/dev/null ||
  need+=(libclang-rt-14-dev)
[ -e /usr/include/relacy/relacy.hpp ] || need+=(relacy-dev)
command -v g++ >/dev/null 2>&1 || need+=(g++)
command -v gcc >/dev/null 2>&1 || need+=(build-essential)
command -v make >/dev/null 2>&1 || need+=(make)
command -v bzip2 >/dev/null 2>&1 || need+=(bzip2)
# tools/snapshot_png.py and its test draw with Debian's matplotlib.
/usr/bin/python3 -c 'import matplotlib' >/dev/null 2>&1 || need+=(python3-matplotlib)
# tests/pip_install_test.sh installs the package into a fresh venv.
/usr/bin/python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || need+=(python3-venv)
# integrations/rmm/fetch_rmm.sh downloads RMM's wheels with pip.
python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  echo "installing: ${need[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
"$(dirname "$0")/build_jemalloc.sh"
# RMM's wheels from PyPI, unpacked into .rmm/whl: the headers and librmm.so
# the RMM resource's test builds against (third_party/local_libs.bzl,
# rmm_wheels); skipped when present. Optional, like the CUDA toolkit: without
# them (no network) that test is not defined, and everything else runs.
"$(dirname "$0")/../integrations/rmm/fetch_rmm.sh" --wheels-only ||
  echo "install_deps: RMM's wheels were not fetched (above); tests/rmm_resource_test is left out" >&2
