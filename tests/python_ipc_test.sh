#!/usr/bin/env bash
# magpie.ipc (python/magpie/ipc.py) between processes on the simulated
# device: blocks exported by this process and imported by children it
# starts, held exports, the failures (freed, revoked, garbage, exporter
# gone), and peer access on two simulated devices. The checks are in
# python_ipc_test.py.
set -euo pipefail
. "$(dirname "$0")/python_test_prelude.sh"
lib=$1
shift
pkg=$(python_test_pkg "$@")
python_test_skip_sanitized "$lib"
export MAGPIE_LIB=$PWD/$lib MAGPIE_BACKEND=sim MAGPIE_SIM_MEMORY=256m PYTHONPATH=$PWD/$pkg
unset GLIBC_TUNABLES MAGPIE_SIM_DEVICES MAGPIE_CONF
python3 "$(dirname "$0")/python_ipc_test.py"
