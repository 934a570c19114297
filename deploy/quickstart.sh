#!/usr/bin/env bash
# The README's main command, on a fresh Debian/Ubuntu machine: install the build dependencies,
# build, start a three-process cluster (router + one prefill node + one decode node) with the
# bundled 12M-parameter model on the CPU, ask it one question through the OpenAI-compatible
# chat API, print the answer, and stop the cluster again (also on Ctrl-C or an error).
#
# Environment: PD_BUILD_DIR (default build), PD_RUN_DIR (default /tmp/pdserve-quickstart),
# PD_QUICKSTART_PORT (default 8000; a free port is used when it is taken), PD_SKIP_APT=1.
set -euo pipefail
cd "$(dirname "$0")/.."

deploy/setup.sh
build=${PD_BUILD_DIR:-build}
pdctl="$build/tools/pdctl"
model=tests/data/models/pycoder-12m
run_dir=${PD_RUN_DIR:-/tmp/pdserve-quickstart}
port=${PD_QUICKSTART_PORT:-8000}

# A cluster left over from an interrupted run goes first.
"$pdctl" cluster down --run-dir "$run_dir" --quiet >/dev/null 2>&1 || true
# Port taken (something answers on it)? Let the router pick a free one.
if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
  echo "quickstart: port $port is in use; using a free port"
  port=0
fi

trap '"$pdctl" cluster down --run-dir "$run_dir" --quiet || true' EXIT
trap 'exit 130' INT TERM

"$pdctl" cluster up --model "$model" --prefill 1 --decode 1 --port "$port" --run-dir "$run_dir"
port=$(sed -nE 's/.*"http_port":[[:space:]]*([0-9]+).*/\1/p' "$run_dir/cluster.json")
url="http://127.0.0.1:$port"

question="Write a Python function that returns the factorial of n."
echo
echo "quickstart: POST $url/v1/chat/completions"
echo "  user: $question"
if command -v curl >/dev/null; then
  # Greedy, with a frequency penalty: a 12M-parameter model left to itself repeats lines.
  body='{"model": "pycoder-12m", "max_tokens": 64, "temperature": 0, "frequency_penalty": 1.0,
         "messages": [{"role": "user", "content": "'"$question"'"}]}'
  resp=$(curl -sS --fail-with-body --max-time 300 "$url/v1/chat/completions" \
           -H 'Content-Type: application/json' -d "$body")
  # The answer is choices[0].message.content: a JSON string; undo its escapes for printing.
  answer=$(printf '%s' "$resp" | sed -nE 's/.*"content":[[:space:]]*"((\\.|[^"\\])*)".*/\1/p')
  if [ -z "$answer" ]; then
    echo "quickstart: unexpected answer: $resp" >&2
    exit 1
  fi
  echo "  assistant:"
  printf '%b\n' "$(printf '%s' "$answer" | sed -e 's/\\"/"/g' -e 's#\\/#/#g')" | sed 's/^/    /'
else
  # No curl: the same question through the router's ZeroMQ client API.
  client=$(sed -nE 's/.*"client_endpoint":[[:space:]]*"([^"]+)".*/\1/p' "$run_dir/cluster.json")
  echo "  assistant:"
  "$pdctl" client --endpoint "$client" --server-key "$run_dir/keys/router.pub" \
    --chat "$question" --max-tokens 64 --temperature 0 --quiet | sed 's/^/    /'
fi
echo
echo "quickstart: done; the cluster is being stopped (logs stay in $run_dir)."
echo "Run it yourself:  $pdctl cluster up --model $model --prefill 1 --decode 1 --port 8000 --run-dir $run_dir"
