#!/usr/bin/env bash
# Installs pdserve's build dependencies (Debian/Ubuntu) and builds it into ./build.
#   deploy/setup.sh [extra cmake args...]
# Environment: PD_BUILD_DIR (default build), PD_SKIP_APT=1 to skip the package step.
set -euo pipefail
cd "$(dirname "$0")/.."

pkgs=(build-essential cmake pkg-config xz-utils curl libpcre2-dev libutf8proc-dev libcjson-dev
      libxxhash-dev libcurl4-openssl-dev libzmq3-dev libprotobuf-c-dev protobuf-c-compiler zlib1g-dev
      python3 python3-venv)
if [ "${PD_SKIP_APT:-0}" != 1 ]; then
  missing=()
  for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]}"
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi

build=${PD_BUILD_DIR:-build}
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build "$build" -j"$(nproc)" >/dev/null
echo "setup: built into $build"
