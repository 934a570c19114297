#!/usr/bin/env bash
# The main job on a fresh machine: install, build, and generate text from the bundled model
# on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/setup.sh
./build/tools/pdctl generate --model tests/data/models/pycoder-12m \
  --prompt "def fibonacci(n):" --max-tokens 48 --temperature 0
