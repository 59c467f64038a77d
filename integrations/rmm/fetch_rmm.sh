#!/usr/bin/env bash
# Fetches what integrations/rmm/build.sh needs, into RMM_DIR (default
# <repo>/.rmm, ignored by git):
#   RMM_DIR/wheels/  the RMM 26.10 wheels from PyPI (librmm-cu13, rapids-logger,
#                    rmm-cu13), downloaded with pip;
#   RMM_DIR/whl/     the same, unpacked (librmm/include, librmm/lib64/librmm.so,
#                    rapids_logger/include, rapids_logger/lib64, ...);
#   RMM_DIR/src/     RMM's C++ tests and benchmarks (cpp/tests, cpp/benchmarks),
#                    with COMMIT (the RMM commit they come from), VERSION (that
#                    commit's RMM version) and ORIGIN (where they were taken).
#
# The sources come from RMM_SRC if it is set: a local RMM git repository
# (bare or a checkout), exported with `git archive` at RMM_REF (default
# HEAD). Otherwise they are fetched from GitHub at RMM_REF, by default the
# commit the librmm wheel was built from (librmm/GIT_COMMIT), so the tests
# match the library they run against.
#
# Usage: integrations/rmm/fetch_rmm.sh [--wheels-only]   (RMM_DIR, RMM_SRC,
#                                                  RMM_REF from the environment)
# Idempotent: wheels already downloaded or unpacked, and sources already
# exported at the same commit, are kept.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
RMM_DIR="${RMM_DIR:-$ROOT/.rmm}"

# One RAPIDS release: librmm and rmm 26.10.0 were built against rapids-logger
# 0.3.0. The wheels for CUDA 13 (the -cu13 suffix) match the CUDA 13 toolkit
# and runtime the binaries are built and run with.
RMM_VERSION="${RMM_VERSION:-26.10.0}"
RAPIDS_LOGGER_VERSION="${RAPIDS_LOGGER_VERSION:-0.3.0}"
CUDA_SUFFIX="${CUDA_SUFFIX:-cu13}"
# librmm and rapids-logger are py3-none wheels; only rmm-cu13 (the Python
# package, fetched so that the release's three wheels sit together) depends on
# the Python version. Naming the platform and version lets pip fetch them on
# any host, whatever its own Python is.
PY_VERSION="${PY_VERSION:-3.12}"
PLATFORM="${PLATFORM:-manylinux_2_28_x86_64}"

WHEELS=("librmm-${CUDA_SUFFIX}==${RMM_VERSION}" "rapids-logger==${RAPIDS_LOGGER_VERSION}"
  "rmm-${CUDA_SUFFIX}==${RMM_VERSION}")

mkdir -p "$RMM_DIR/wheels" "$RMM_DIR/whl"

# --- wheels -------------------------------------------------------------------

# A wheel's file name starts with its distribution name, '-' turned into '_'.
wheel_file() {
  local spec="$1" name version
  name="${spec%%==*}"
  version="${spec##*==}"
  compgen -G "$RMM_DIR/wheels/${name//-/_}-${version}-*.whl" | head -n 1 || true
}

for spec in "${WHEELS[@]}"; do
  if [[ -n "$(wheel_file "$spec")" ]]; then
    echo "fetch_rmm: $spec: already downloaded"
    continue
  fi
  echo "fetch_rmm: downloading $spec"
  # --no-deps: the wheels' Python dependencies (cuda-python, numpy, ...) are
  # not needed to build or run C++ against librmm.
  "${PYTHON:-python3}" -m pip download --quiet --no-deps --python-version "$PY_VERSION" --platform "$PLATFORM" \
    --only-binary=:all: --dest "$RMM_DIR/wheels" "$spec"
  [[ -n "$(wheel_file "$spec")" ]] || {
    echo "fetch_rmm: pip did not leave a wheel for $spec in $RMM_DIR/wheels" >&2
    exit 1
  }
done

for spec in "${WHEELS[@]}"; do
  whl="$(wheel_file "$spec")"
  stamp="$RMM_DIR/whl/.unpacked-$(basename "$whl")"
  if [[ -e "$stamp" ]]; then
    echo "fetch_rmm: $(basename "$whl"): already unpacked"
    continue
  fi
  # A wheel is a zip archive; python's zipfile module is there wherever pip is.
  python3 -m zipfile -e "$whl" "$RMM_DIR/whl/"
  touch "$stamp"
done

# zipfile does not keep the executable bit; the shared libraries need none to
# be loaded, but keep them as pip would install them.
chmod a+x "$RMM_DIR"/whl/librmm/lib64/*.so "$RMM_DIR"/whl/rapids_logger/lib64/*.so

WHEEL_COMMIT="$(tr -d '[:space:]' < "$RMM_DIR/whl/librmm/GIT_COMMIT")"
echo "fetch_rmm: librmm $(tr -d '[:space:]' < "$RMM_DIR/whl/librmm/VERSION") built from RMM commit $WHEEL_COMMIT"

# --- RMM C++ test and benchmark sources -----------------------------------------

# --wheels-only: what tools/install_deps.sh fetches for the resource's own
# test (tests/rmm_resource_test.cpp), which needs no RMM sources.
if [[ "${1:-}" == --wheels-only ]]; then
  exit 0
fi

SRC="$RMM_DIR/src"
PATHS=(cpp/tests cpp/benchmarks)

# Replaces RMM_DIR/src by the tree in $1, recording where it came from.
install_src() {
  local tree="$1" commit="$2" version="$3" origin="$4"
  echo "$commit" > "$tree/COMMIT"
  echo "$version" > "$tree/VERSION"
  echo "$origin" > "$tree/ORIGIN"
  rm -rf "$SRC"
  mv "$tree" "$SRC"
  echo "fetch_rmm: RMM sources at $SRC: commit $commit (version $version) from $origin"
}

tmp="$(mktemp -d "$RMM_DIR/src.tmp.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

if [[ -n "${RMM_SRC:-}" ]]; then
  ref="${RMM_REF:-HEAD}"
  commit="$(git -C "$RMM_SRC" rev-parse --verify --quiet "${ref}^{commit}")" || {
    echo "fetch_rmm: $RMM_SRC has no commit $ref" >&2
    exit 1
  }
  if [[ -f "$SRC/COMMIT" && "$(cat "$SRC/COMMIT")" == "$commit" ]]; then
    echo "fetch_rmm: RMM sources at $SRC already at $commit"
  else
    # git archive reads the object store, so a bare repository serves as well
    # as a checkout, and a checkout's uncommitted changes are left out.
    git -C "$RMM_SRC" archive --format=tar "$commit" "${PATHS[@]}" | tar -x -C "$tmp"
    version="$(git -C "$RMM_SRC" show "$commit:VERSION" 2> /dev/null | tr -d '[:space:]' || true)"
    install_src "$tmp" "$commit" "${version:-unknown}" "$RMM_SRC"
  fi
else
  ref="${RMM_REF:-$WHEEL_COMMIT}"
  if [[ -f "$SRC/COMMIT" && "$(cat "$SRC/COMMIT")" == "$ref" ]]; then
    echo "fetch_rmm: RMM sources at $SRC already at $ref"
  else
    # `git clone --depth 1` takes only branch and tag names; fetching one
    # commit by its id into an empty repository gets the same shallow tree
    # (GitHub serves any commit reachable from its branches).
    url="${RMM_URL:-https://github.com/rapidsai/rmm}"
    git -C "$tmp" init --quiet
    git -C "$tmp" fetch --quiet --depth 1 "$url" "$ref" || {
      echo "fetch_rmm: cannot fetch RMM $ref from $url; where it is out of reach, set RMM_SRC to a local" \
        "RMM git repository (and RMM_REF to the commit to take)" >&2
      exit 1
    }
    commit="$(git -C "$tmp" rev-parse FETCH_HEAD)"
    version="$(git -C "$tmp" show FETCH_HEAD:VERSION 2> /dev/null | tr -d '[:space:]' || true)"
    mkdir "$tmp/tree"
    git -C "$tmp" archive --format=tar FETCH_HEAD "${PATHS[@]}" | tar -x -C "$tmp/tree"
    install_src "$tmp/tree" "$commit" "${version:-unknown}" "$url"
  fi
fi

if [[ "$(cat "$SRC/COMMIT")" != "$WHEEL_COMMIT" ]]; then
  echo "fetch_rmm: note: the tests come from RMM $(cat "$SRC/COMMIT") (version $(cat "$SRC/VERSION")), not from the" \
    "wheel's commit $WHEEL_COMMIT; build.sh reports what does not compile against the wheel's headers"
fi
