#!/usr/bin/env bash
# Installs, builds and runs every test: the Release build (all labels; gpu tests skip without
# a GPU), then an ASan+UBSan build of the unit, golden and integration tests, then the fuzz
# targets (tests/fuzz: clang-14, libFuzzer, ASan+UBSan, in build-fuzz), each run for a bounded
# time. It installs what the tests need (apt: the build dependencies, promtool, clang-14 and
# libfuzzer-14-dev, docker.io, docker-compose and debootstrap; pip: tests/integration/requirements.txt, pinned, into build/pyenv), prints a
# line of counts after each run, and exits non-zero when a test failed, a test other than the
# gpu ones was skipped, or a fuzz target found a crash, leak, hang or sanitizer report.
#   deploy/test.sh [--no-sanitize] [--fuzz-seconds N]   (N per target, default 60; 0: no fuzzing)
set -euo pipefail
cd "$(dirname "$0")/.."
sanitize=1
fuzz_secs=60
while [ $# -gt 0 ]; do
  case "$1" in
    --no-sanitize) sanitize=0 ;;
    --fuzz-seconds) fuzz_secs=${2:?--fuzz-seconds needs a number}; shift ;;
    *) echo "usage: deploy/test.sh [--no-sanitize] [--fuzz-seconds N]" >&2; exit 2 ;;
  esac
  shift
done

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
# clang-14 and libFuzzer for the fuzz targets (tests/fuzz)
if [ "$fuzz_secs" != 0 ] && ! { command -v clang-14 > /dev/null &&
                                dpkg-query -W -f='${Status}' libfuzzer-14-dev 2>/dev/null |
                                  grep -q "install ok installed"; }; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get install -y -qq --no-install-recommends clang-14 libfuzzer-14-dev > /dev/null 2>&1 ||
    { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends clang-14 \
        libfuzzer-14-dev > /dev/null; }
fi
# Docker (the daemon, docker-compose) and debootstrap for the image test (label docker), which
# starts dockerd itself where none runs and makes its base images from Debian's packages
if ! { command -v dockerd > /dev/null && command -v docker-compose > /dev/null &&
       command -v debootstrap > /dev/null; }; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get install -y -qq --no-install-recommends docker.io docker-compose debootstrap \
      > /dev/null 2>&1 ||
    { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends docker.io \
        docker-compose debootstrap > /dev/null; }
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

# The fuzz targets, each for fuzz_secs seconds from its seeds and regressions (tests/fuzz/README.md)
if [ "$fuzz_secs" != 0 ]; then
  mkdir -p build-fuzz
  if CC=clang-14 cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPD_FUZZ=ON \
       -DPD_CUDA=OFF -DPD_BUILD_TESTS=OFF > build-fuzz/build.log 2>&1 &&
     cmake --build build-fuzz -j"$jobs" --target fuzz >> build-fuzz/build.log 2>&1; then
    tests/fuzz/run.sh build-fuzz "$fuzz_secs" || status=1
  else
    tail -n 40 build-fuzz/build.log
    echo "fuzz: the fuzz targets did not build (build-fuzz/build.log)"
    status=1
  fi
fi
exit $status
