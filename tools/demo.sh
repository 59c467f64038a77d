#!/usr/bin/env bash
# Installs what is missing, builds magpie and runs the main demo: on the GPU
# when a CUDA device is usable, else on the simulated device.
#   tools/demo.sh [threads] [streams_per_thread] [seconds]
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install_deps.sh
bazel build -c opt //:demo
exec bazel-bin/demo "$@"
