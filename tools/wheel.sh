#!/usr/bin/env bash
# Builds the magpie wheel (the Python package with libmagpie.so and
# libmagpie_sim.so inside, tagged py3-none-<platform>) into .whl/:
#
#   tools/wheel.sh [MAGPIE_PREBUILT=DIR]
#   pip install .whl/magpie_cuda-*.whl
#
# The libraries are built with Bazel (-c opt) unless MAGPIE_PREBUILT names a
# folder that has them (python/setup.py).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/tools/install_deps.sh"
rm -rf "$root/python/build" "$root/.whl"
python3 -m pip wheel --no-deps -w "$root/.whl" "$root/python"
rm -rf "$root/python/build" "$root/python/"*.egg-info
ls "$root/.whl"
