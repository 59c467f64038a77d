#!/usr/bin/env bash
# magpie.rmm on the simulated device: RMM 26.10's Python package (from
# PyPI, into a fresh venv with Cython) and magpie's resource built on first
# use against it; allocations through the resource and RMM's adaptors over
# it, errors as MemoryError, and use() making it a device's resource. No
# CUDA call is made: RMM hands magpie the stream (the default stream's
# handle here), and magpie serves it on the simulated device.
# Arguments: libmagpie.so, then the package's files (//:python_pkg).
set -euo pipefail
here=$(dirname "$0")
. "$here/python_test_prelude.sh"
lib=$1
shift
python_test_skip_sanitized "$lib"
pkg=$(python_test_pkg "$@")
venv="$TEST_TMPDIR/venv"
python3 -m venv "$venv"
# rmm-cu13 brings librmm-cu13, rapids-logger, cuda-bindings and numpy.
"$venv/bin/pip" install --quiet --disable-pip-version-check "rmm-cu13==26.10.*" cython
export MAGPIE_LIB=$lib MAGPIE_BACKEND=sim MAGPIE_SIM_MEMORY=256m MAGPIE_CACHE_DIR="$TEST_TMPDIR/cache"
PYTHONPATH=$pkg "$venv/bin/python" - <<'PY'
import magpie
import magpie.rmm
import rmm

failed = []
passed = 0


def check(ok, what):
    global passed
    print(("PASS " if ok else "FAIL ") + what)
    if ok:
        passed += 1
    else:
        failed.append(what)


mr = magpie.rmm.resource()
check(isinstance(mr, rmm.mr.DeviceMemoryResource), "the resource is an rmm.mr.DeviceMemoryResource")
base = magpie.stats()["in_use_bytes"]
p = mr.allocate(1000)
check(p % 256 == 0 and magpie.stats()["in_use_bytes"] >= base + 1000, "allocate reaches magpie")
mr.deallocate(p, 1000)
check(magpie.stats()["in_use_bytes"] == base, "deallocate gives the block back")
q = mr.allocate(1000)
check(q == p, "the default stream takes its own freed block back at once")
mr.deallocate(q, 1000)

stats = rmm.mr.StatisticsResourceAdaptor(mr)
a = stats.allocate(5000)
b = stats.allocate(70000)
c = stats.allocation_counts
check(c.current_bytes == 75000 and c.current_count == 2, f"StatisticsResourceAdaptor over magpie: {c}")
stats.deallocate(a, 5000)
stats.deallocate(b, 70000)
check(stats.allocation_counts.current_bytes == 0, "StatisticsResourceAdaptor: all given back")

limit = rmm.mr.LimitingResourceAdaptor(mr, 1 << 20)
k = limit.allocate(768 << 10)
try:
    limit.allocate(512 << 10)
    check(False, "LimitingResourceAdaptor over magpie refuses past its limit")
except MemoryError:
    check(True, "LimitingResourceAdaptor over magpie refuses past its limit")
limit.deallocate(k, 768 << 10)

try:
    mr.allocate(1 << 50)
    check(False, "more than the device raises MemoryError")
except MemoryError as e:
    msg = str(e)
    check("out_of_memory" in msg and "device 0 has 268435456 bytes" in msg,
          f"more than the device raises MemoryError with magpie's account: {msg[:200]}")

got = magpie.rmm.use(device=0)
check(magpie.rmm.in_use(0) and rmm.mr.get_per_device_resource(0) is got, "use(device=0) makes it device 0's resource")
check(magpie.stats()["in_use_bytes"] == base, "nothing left in use")
# In cmocka's words, which tools/test.sh counts.
print(f"[  PASSED  ] {passed} test(s).")
if failed:
    print(f"[  FAILED  ] {len(failed)} test(s): " + "; ".join(failed))
raise SystemExit(1 if failed else 0)
PY
