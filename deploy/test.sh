#!/usr/bin/env bash
# Installs, builds and runs every test: the Release build (all labels; gpu tests skip without
# a GPU), then an ASan+UBSan build of the unit, golden and integration tests. It installs what
# the tests need (apt: the build dependencies and promtool; pip: tests/integration/
# requirements.txt, pinned, into build/pyenv), prints a line of counts after each run, and exits
# non-zero when a test failed or a test other than the gpu ones was skipped.
#   deploy/test.sh [--no-sanitize]
set -euo pipefail
cd "$(dirname "$0")/.."
sanitize=1
[ "${1:-}" = "--no-sanitize" ] && sanitize=0

deploy/setup.sh
jobs=$(nproc)

# Python clients the integration tests drive the cluster with (openai, locust, ...): in a
# virtual environment of the build, never a dependency of the product itself.
if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get install -y -qq python3-venv >/dev/null
fi
# promtool (Debian package prometheus, no service started here): the metrics tests lint /metrics
if ! command -v promtool > /dev/null; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get install -y -qq --no-install-recommends prometheus > /dev/null 2>&1 ||
    { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends prometheus \
        > /dev/null; }
fi
if [ ! -x build/pyenv/bin/python3 ]; then
  python3 -m venv build/pyenv
fi
build/pyenv/bin/python3 -m pip install -q --disable-pip-version-check -r tests/integration/requirements.txt
export PATH="$PWD/build/pyenv/bin:$PATH"
# the Python tests run with the interpreter that has those packages
py=(-DPD_PYTHON3="$PWD/build/pyenv/bin/python3" -DPython3_EXECUTABLE="$PWD/build/pyenv/bin/python3")
cmake -S . -B build "${py[@]}" > /dev/null

# Every test runs; then one line counts them, and the run fails when a test failed or a test
# that is not labelled gpu was skipped (only gpu tests may skip, where there is no GPU).
status=0
ctest --test-dir build --output-on-failure -j"$jobs" --output-junit ctest-junit.xml || status=1
python3 tests/ctest_summary.py build build/ctest-junit.xml Release || status=1

if [ $sanitize = 1 ]; then
  PD_SKIP_APT=1 PD_BUILD_DIR=build-asan deploy/setup.sh -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DPD_SANITIZE=address,undefined -DPD_CUDA=OFF "${py[@]}"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build-asan --output-on-failure -j"$jobs" -L 'unit|golden|integration' \
    --output-junit ctest-junit.xml || status=1
  python3 tests/ctest_summary.py build-asan build-asan/ctest-junit.xml "ASan+UBSan" || status=1
fi
exit $status
