#!/usr/bin/env bash
# The Python package (python/magpie) against libmagpie.so on the simulated
# device, which libmagpie.so loads from libmagpie_sim.so beside it: its
# ctypes magpie_stats must be at least as large as the C struct (a field
# added in C but not in Python would make magpie_stats_get write past the
# Python buffer), and magpie.stats() reports an allocation.
set -euo pipefail
. "$(dirname "$0")/python_test_prelude.sh"
lib=$1
shift
pkg=$(python_test_pkg "$@")
python_test_skip_sanitized "$lib"
export MAGPIE_LIB=$PWD/$lib MAGPIE_BACKEND=sim PYTHONPATH=$PWD/$pkg
# No GLIBC_TUNABLES: loading libmagpie.so with dlopen after start-up works
# with glibc's defaults (no initial-exec TLS: tools/build_jemalloc.sh,
# defs.bzl).
unset GLIBC_TUNABLES
python3 - <<'PY'
import ctypes
import magpie
from magpie import _lib

l = _lib.lib()
size = ctypes.sizeof(_lib.Stats)
guard = 256
buf = (ctypes.c_ubyte * (size + guard))(*([0xA5] * (size + guard)))
p = l.magpie_malloc_async(4096, None)
assert p, l.magpie_last_error_message()
assert l.magpie_active_backend() == 2, "not on the simulated device (MAGPIE_BACKEND_SIM)"
assert l.magpie_stats_get(0, ctypes.cast(buf, ctypes.POINTER(_lib.Stats))) == 0
spoiled = [i for i in range(size, size + guard) if buf[i] != 0xA5]
assert not spoiled, f"magpie_stats_get wrote {len(spoiled)} bytes past the Python struct ({size} bytes): add the new fields to python/magpie/_lib.py"
st = magpie.stats()
assert st["in_use_bytes"] >= 4096, st
assert st["reserved_bytes"] >= st["in_use_bytes"], st
assert "event_queries" in st and "event_queries_pending" in st, sorted(st)
assert l.magpie_free_async(p, None) == 0
print(f"python stats: {size} bytes, in use {st['in_use_bytes']}, reserved {st['reserved_bytes']}")
PY
