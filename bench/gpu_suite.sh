#!/usr/bin/env bash
# pdserve's GPU tests and benchmarks in one pass, for a CUDA machine that has the driver and the
# CUDA toolkit but none of the build dependencies: run from the repository root with a bundle of
# prebuilt programs (bin/: pdctl, pd-router, pd-prefill, pd-decode, the test_cuda_* tests,
# pd-bench-cuda; lib/: their non-glibc shared libraries), e.g. one made by bench/pack_dev.sh.
#
#   bench/gpu_suite.sh BUNDLE_DIR [quick | notorch]   (quick: tests and kernel benches only)
#
# Prints every section; never stops at a failure (each step's exit status is printed).
set -u
. "$(dirname "$0")/bundle_tree.sh"
D=${1:?usage: gpu_suite.sh BUNDLE_DIR [quick | notorch]}
quick=${2:-}
export LD_LIBRARY_PATH="$D/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export PD_TEST_DATA_DIR="$PWD/tests/data"
M=/tmp/pdserve-llama3-8b
step() { echo; echo "=== $* ($(date +%T))"; }
run() { "$@"; echo "--- exit $?"; }

step machine
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
step test_cuda_ops;    run "$D/bin/test_cuda_ops"
step test_cuda_sample; run "$D/bin/test_cuda_sample"
step test_cuda_kvstage; run "$D/bin/test_cuda_kvstage"
step compute-sanitizer memcheck
run compute-sanitizer --tool memcheck --error-exitcode 9 "$D/bin/test_cuda_ops" small
run compute-sanitizer --tool memcheck --error-exitcode 9 "$D/bin/test_cuda_sample" small
run compute-sanitizer --tool memcheck --error-exitcode 9 "$D/bin/test_cuda_kvstage"
# (racecheck reports hazards inside cuBLAS's own nvjet kernels, whose barriers it does not follow;
# those are counted apart. --kernel-name-exclude kns=nvjet instead broke the run on the H200: an
# internal sanitizer error, then wrong cuBLAS results.)
step "compute-sanitizer racecheck (hazards in cuBLAS's nvjet kernels counted apart)"
# (the sanitizer's reports go to a file of their own: interleaved with the test's output, a
# report line could be split from its kernel's name and be counted as pdserve's)
R=$(mktemp) T=$(mktemp)
compute-sanitizer --tool racecheck --print-limit 100000 --log-file "$R" \
  "$D/bin/test_cuda_ops" small > "$T" 2>&1
echo "--- test_cuda_ops under racecheck: exit $?"
grep -E "checks passed|FAIL|failed" "$T" | tail -3
echo "hazards in nvjet kernels: $(grep "Race reported" "$R" | grep -c nvjet)"
ours=$(grep "Race reported" "$R" | grep -vc nvjet)
echo "hazards in pdserve's kernels: $ours"
grep "Race reported" "$R" | grep -v nvjet | cut -c1-200 | sort | uniq -c | head -20
[ "$ours" = 0 ]; echo "--- exit $?"
rm -f "$R" "$T"
for m in pycoder-12m pycoder-draft-2m pycoder-qwen2-4m tiny-random-llama31; do
  step "test_cuda_golden $m"; run "$D/bin/test_cuda_golden" "$m"
done
step "GPU cluster (test_cluster_gpu)"
# the test finds the node programs as a build tree lays them out
T=$(mktemp -d)
bundle_tree "$D" "$T"
run timeout 400 python3 tests/integration/test_cluster_gpu.py --pdctl "$T/tools/pdctl" --repo "$PWD"
rm -rf "$T"
step pd-bench-cuda;    run "$D/bin/pd-bench-cuda"
[ "$quick" = quick ] && exit 0

step make-model llama3-8b
run "$D/bin/pdctl" make-model --like llama3-8b --tokenizer synthetic --force --out "$M"
step "decode, batch 1 (prompt 128)"
run "$D/bin/pdctl" bench-model --device cuda:0 --model "$M" --batch 1 --prompt-len 128 \
  --decode-tokens 256 --repeat 2
# (best of 2 runs: the second replays the graphs the first recorded, as a server's steps do; a
# run's first steps of each shape record one, ~0.1 s each)
step "decode with 1k context, batch 8..256"
run "$D/bin/pdctl" bench-model --device cuda:0 --model "$M" --batch 8,32,128,256 \
  --prompt-len 1024 --decode-tokens 192 --repeat 2
step "decode, 256 sequences at a mean context of 1k (prompts of 928 tokens, 192 steps)"
# (the sequences that decode while the last prompts are still prefilled have moved on: over the
# steps in which all 256 decode, the context averages 1,024 tokens)
# (the board's power draw and SM clock sampled every 20 ms meanwhile: the step runs at the power
# limit, where the SM clock drops and the compute-bound GEMMs with it)
P=$(mktemp)
nvidia-smi --query-gpu=power.draw,clocks.sm,clocks_throttle_reasons.active --format=csv,noheader \
  -lms 20 > "$P" 2>/dev/null &
SMI=$!
run "$D/bin/pdctl" bench-model --device cuda:0 --model "$M" --batch 256 --prompt-len 928 \
  --decode-tokens 192 --repeat 2
kill "$SMI" 2>/dev/null; wait "$SMI" 2>/dev/null
awk -F', ' '{ w = $1 + 0; n++; if (w >= 600) { h++; sw += w; sc += $2 + 0; if ($3 != "0x0000000000000000") t++ } }
  END { if (n) printf "power sampled %d times; at >= 600 W %d: mean %.0f W, SM clock %.0f MHz, throttled %d\n", n, h, h ? sw / h : 0, h ? sc / h : 0, t }' "$P"
awk -F', ' '$1 + 0 >= 600 { print "  throttle reasons " $3 }' "$P" | sort | uniq -c
rm -f "$P"
step "prefill 1k and 8k"
run "$D/bin/pdctl" bench-model --device cuda:0 --model "$M" --batch 1 --prompt-len 1024 \
  --decode-tokens 2 --repeat 3
run "$D/bin/pdctl" bench-model --device cuda:0 --model "$M" --batch 1 --prompt-len 8000 \
  --decode-tokens 2 --repeat 2
step "prefill 8k in one chunk (--max-batch-tokens 8192)"
run "$D/bin/pdctl" bench-model --device cuda:0 --model "$M" --batch 1 --prompt-len 8000 \
  --decode-tokens 2 --repeat 2 --max-batch-tokens 8192
step "where a batch-1 decode step goes (--profile-gpu, eager)"
"$D/bin/pdctl" bench-model --profile-gpu --device cuda:0 --model "$M" --batch 1 \
  --prompt-len 128 --decode-tokens 64 --repeat 1 --enforce-eager 2>&1 | head -18
step "a batch-1 step with graphs: the replay's GPU time against the step's (--profile-gpu)"
"$D/bin/pdctl" bench-model --profile-gpu --device cuda:0 --model "$M" --batch 1 \
  --prompt-len 128 --decode-tokens 256 --repeat 1 2>&1 |
  grep -E "graph replay|sample|ms/step|^ +1 |^graph +[0-9]+ |launch =|clock against"
# (enough decode tokens that the last prompts are in before the first sequences finish)
step "a 256 x 1k step with graphs on the GPU's clock (--profile-gpu): launch, replay, sampling, host"
"$D/bin/pdctl" bench-model --profile-gpu --device cuda:0 --model "$M" --batch 256 \
  --prompt-len 928 --decode-tokens 192 --repeat 2 2>&1 |
  grep -E "^graph +[0-9]+ |launch =|clock against|^ +256 "
step "where a 256 x 1k decode step goes (--profile-gpu, eager; M=256 rows)"
"$D/bin/pdctl" bench-model --profile-gpu --device cuda:0 --model "$M" --batch 256 \
  --prompt-len 1024 --decode-tokens 192 --repeat 1 --enforce-eager 2>&1 |
  grep -E "^op |M=256 |seqs=256 tokens=256|sample n=256"
step "energy of the decode step's kinds of work (pd-bench-cuda --power 2)"
run "$D/bin/pd-bench-cuda" --power 2
[ "$quick" = notorch ] && exit 0
step "PyTorch baselines"
run timeout 240 python3 bench/torch_baseline.py "$M" --batches 1,32 --budget-s 200
