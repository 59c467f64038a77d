# Sourced by the tests of the Python package (python_stats_test.sh,
# python_torch_test.sh, pip_install_test.sh), which run python3 against
# this build's libmagpie.so.

# A sanitizer build of the library needs the sanitizer's runtime in the
# executable, which python3 is not: the test is skipped there (exit 0), and
# the plain build checks the same binding.
python_test_skip_sanitized() {
  if grep -qa -e '__tsan_func_entry' -e '__asan_init' "$1"; then
    echo "skipped: $1 is a sanitizer build (python3 cannot load it)"
    exit 0
  fi
}

# The folder holding the package `magpie`, from the files of //:python_pkg
# (each is python/magpie/<file>).
python_test_pkg() {
  local f pkg=""
  for f in "$@"; do pkg=$(dirname "$(dirname "$f")"); done
  echo "$pkg"
}
