#!/usr/bin/env bash
# Runs tests/layering_test.py over the sources in the runfiles.
set -euo pipefail
exec python3 tests/layering_test.py .
