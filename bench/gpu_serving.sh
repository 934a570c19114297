#!/usr/bin/env bash
# pdserve's serving benchmark on GPUs: a local cluster (router, one prefill node, one decode node,
# KV pages through pinned host buffers and ZeroMQ over loopback) serving a Llama-3-8B-shaped
# model, loaded by `pdctl bench` with every request sent at once under a concurrency cap; then
# the nodes' KV loop-time counters. Run from the repository root with a bundle of prebuilt
# programs as bench/gpu_suite.sh takes it (bin/, lib/; bench/pack_dev.sh makes one).
#
#   bench/gpu_serving.sh BUNDLE_DIR [two | one | unified | cpu] [CONCURRENCY ...]
#
#   two      prefill node on cuda:0, decode node on cuda:1, --gpu-memory-utilization 0.85
#            (default; a machine with two GPUs)
#   one      both nodes on cuda:0, 0.4 each
#   unified  one unified node (pd-decode --unified) on cuda:0, 0.85: prefill and decode in one
#            continuous batch, no KV transfer
#   cpu  both nodes on the CPU: a smoke test of this script, not a benchmark
#   CONCURRENCY: the caps to run, one `pdctl bench` each (default: 128 256)
#
# Environment: MODEL (a model folder; default: `pdctl make-model --like llama3-8b` into
# /tmp/pdserve-llama3-8b), PROMPTS (512), INPUT_LEN (128), OUTPUT_LEN (128), NODE_ARGS (options
# for every node, after `--` of `pdctl cluster up`, e.g. "--kv-crc-threads 1"), UP_ARGS (options
# of `pdctl cluster up` itself, e.g. "--insecure" to measure without CURVE).
# docs/benchmarks.md ("Serving on GPUs") has the figures of this recipe.
set -u
. "$(dirname "$0")/bundle_tree.sh"
D=${1:?usage: gpu_serving.sh BUNDLE_DIR [two | one | unified | cpu] [CONCURRENCY ...]}
mode=${2:-two}
shift $(($# >= 2 ? 2 : 1))
concs=${*:-128 256}
case "$mode" in
two) devs=(--prefill-device cuda:0 --decode-device cuda:1 --gpu-memory-utilization 0.85) ;;
one) devs=(--device cuda:0 --prefill 1 --decode 1 --gpu-memory-utilization 0.4) ;;
unified) devs=(--device cuda:0 --unified 1 --gpu-memory-utilization 0.85) ;;
cpu) devs=(--device cpu) ;;
*) echo "gpu_serving.sh: unknown mode '$mode' (two, one, unified or cpu)" >&2; exit 2 ;;
esac
export LD_LIBRARY_PATH="$D/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
M=${MODEL:-/tmp/pdserve-llama3-8b}
N=${PROMPTS:-512}
IN=${INPUT_LEN:-128}
OUTL=${OUTPUT_LEN:-128}
for p in pdctl pd-router pd-prefill pd-decode; do
  [ -x "$D/bin/$p" ] || { echo "gpu_serving.sh: $D/bin/$p is missing" >&2; exit 2; }
done
if [ -z "${MODEL:-}" ]; then
  echo "=== make-model llama3-8b -> $M"
  "$D/bin/pdctl" make-model --like llama3-8b --tokenizer synthetic --force --out "$M" > /dev/null ||
    exit 1
fi

T=$(mktemp -d)
R="$T/run"
bundle_tree "$D" "$T" || exit 1
down() {
  "$T/tools/pdctl" cluster down --run-dir "$R" > /dev/null 2>&1
  rm -rf "$T"
}
trap down EXIT

echo "=== cluster up: $mode (${devs[*]}), model $M ($(date +%T))"
extra=()
[ -n "${NODE_ARGS:-}" ] && read -r -a extra <<< "-- $NODE_ARGS"
up=()
[ -n "${UP_ARGS:-}" ] && read -r -a up <<< "$UP_ARGS"
if ! timeout 300 "$T/tools/pdctl" cluster up --model "$M" "${devs[@]}" "${up[@]}" --port 0 \
  --run-dir "$R" --quiet "${extra[@]}"; then
  echo "gpu_serving.sh: the cluster did not come up; its logs:" >&2
  tail -n 20 "$R"/*.log >&2 2>/dev/null
  exit 1
fi
port=$(sed -nE 's/.*"http_port":[[:space:]]*([0-9]+).*/\1/p' "$R/cluster.json" | head -1)
[ -n "$port" ] || { echo "gpu_serving.sh: no http_port in $R/cluster.json" >&2; exit 1; }

status=0
for c in $concs; do
  echo
  echo "=== pdctl bench: $N prompts, $IN in, $OUTL out, concurrency $c ($(date +%T))"
  timeout 600 "$T/tools/pdctl" bench --url "http://127.0.0.1:$port" --num-prompts "$N" \
    --input-len "$IN" --output-len "$OUTL" --concurrency "$c" --seed 0 --tokenizer "$M" ||
    status=1
done

echo
echo "=== the nodes' KV loop time and steps (Prometheus counters, after the runs above)"
python3 - "$R/cluster.json" <<'EOF'
import json, sys, urllib.request
keep = ("pd_node_kv_loop_seconds_total", "pd_node_kv_transfer_bytes_total", "pd_node_kv_frames_total",
        "pd_node_step_seconds_count", "pd_node_step_seconds_sum")
for p in json.load(open(sys.argv[1]))["processes"]:
    if "metrics_port" not in p:
        continue
    try:
        url = "http://127.0.0.1:%d/metrics" % p["metrics_port"]
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except Exception as e:
        print(p["name"], "scrape failed:", e)
        continue
    for line in text.splitlines():
        if line.startswith(keep):
            print(p["name"], line)
EOF
exit $status
