#!/usr/bin/env bash
# The Python package as a user installs it: `pip install` of python/ (with
# MAGPIE_PREBUILT pointing at this build's libraries, so that the test does
# not run Bazel inside Bazel) into a fresh virtual environment, then used
# from a process with no environment variables at all (no PYTHONPATH,
# MAGPIE_LIB or GLIBC_TUNABLES): libmagpie.so is found inside the
# installed package (magpie.h too, for the PyTorch allocator built on first
# use), loads with dlopen, finds libmagpie_sim.so beside it
# (no GPU here), allocates and reports. pip fetches setuptools and wheel
# for the build (PyPI).
set -euo pipefail
. "$(dirname "$0")/python_test_prelude.sh"
lib=$1
sim=$2
header=$3
shift 3
src=""
for f in "$@"; do [[ $f == */pyproject.toml ]] && src=$(dirname "$f"); done
[[ -n $src ]] || { echo "python/pyproject.toml not among the arguments"; exit 1; }
python_test_skip_sanitized "$lib"
tmp=${TEST_TMPDIR:-$(mktemp -d)}
mkdir -p "$tmp/prebuilt"
cp -L "$lib" "$sim" "$header" "$tmp/prebuilt/"
cp -rL "$src" "$tmp/python" # pip builds in the source folder: a copy of our own
python3 -m venv "$tmp/venv"
MAGPIE_PREBUILT=$tmp/prebuilt PIP_DISABLE_PIP_VERSION_CHECK=1 "$tmp/venv/bin/pip" install -q "$tmp/python"
cd "$tmp"
env -i PATH=/usr/bin:/bin HOME="$tmp" "$tmp/venv/bin/python" - <<'PY'
import ctypes
import os
import sys

import magpie
from magpie import _lib

path = _lib.library_path()
site = os.path.dirname(os.path.dirname(magpie.__file__))
assert path.startswith(site) and path.endswith("magpie/libmagpie.so"), (path, site)
assert os.path.isfile(os.path.join(os.path.dirname(path), "torch_shim.cpp"))
assert os.path.isfile(os.path.join(os.path.dirname(path), "magpie.h"))
l = _lib.lib()
p = l.magpie_malloc_async(1 << 20, None)
assert p, l.magpie_last_error_message()
assert l.magpie_active_backend() == 2, "expected the simulated device (no GPU here)"
st = magpie.stats()
assert st["in_use_bytes"] >= 1 << 20, st
assert l.magpie_free_async(p, None) == 0
assert "GLIBC_TUNABLES" not in os.environ and "MAGPIE_LIB" not in os.environ
print(f"pip install: magpie {magpie.version()} from {path}, in use {st['in_use_bytes']}")
PY
