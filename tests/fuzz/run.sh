#!/usr/bin/env bash
# Runs every libFuzzer target of a PD_FUZZ build for a bounded time each and fails on any crash,
# leak, timeout, out-of-memory or sanitizer report (tests/fuzz/README.md).
#   tests/fuzz/run.sh BUILD_DIR SECONDS [TARGET...]
# Each target starts from its seeds and regressions (tests/fuzz/corpus/<name>/, never written
# to) plus what earlier runs in this build found (BUILD_DIR/fuzz/corpus/<name>/); an input that
# fails is saved as BUILD_DIR/fuzz/artifacts/<name>/crash-* (leak-*, timeout-*, oom-*) and its
# log is printed. Targets run side by side, one per core (PD_FUZZ_JOBS overrides).
# Environment: PD_FUZZ_JOBS (parallel targets), PD_FUZZ_TIMEOUT (seconds one input may take,
# default 10), PD_FUZZ_RSS_MB (memory limit, default 2048).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [ $# -lt 2 ]; then
  sed -n '2,10p' "$0"
  exit 2
fi
build=$(cd "$1" && pwd) || exit 2
secs=$2
shift 2
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  for f in "$here"/fuzz_*.c; do
    n=$(basename "$f" .c)
    targets+=("${n#fuzz_}")
  done
fi
jobs=${PD_FUZZ_JOBS:-$(nproc)}
timeout=${PD_FUZZ_TIMEOUT:-10}
rss=${PD_FUZZ_RSS_MB:-2048}
mkdir -p "$build/fuzz"

# One target: BUILD_DIR/fuzz/<name>.log, exit status 0 when it ran clean.
run_one() {
  local name=$1 exe
  exe=$(find "$build" -name "fuzz_$name" -type f -perm -u+x | head -n 1)
  local log="$build/fuzz/$name.log"
  if [ -z "$exe" ]; then
    echo "fuzz_$name: not built in $build (configure with -DPD_FUZZ=ON)" > "$log"
    return 1
  fi
  local work="$build/fuzz/corpus/$name" art="$build/fuzz/artifacts/$name/"
  mkdir -p "$work" "$art"
  ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1:${ASAN_OPTIONS:-} \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-} \
    "$exe" -max_total_time="$secs" -timeout="$timeout" -rss_limit_mb="$rss" \
    -artifact_prefix="$art" -print_final_stats=1 "$work" "$here/corpus/$name" > "$log" 2>&1
}

names=() pids=() status=0 passed=0 failed=0
report() { # waits for the i-th running target and prints its summary line
  local i=$1 name=${names[$1]} rc
  wait "${pids[$i]}"
  rc=$?
  local log="$build/fuzz/$name.log"
  local execs rate
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
  if [ $rc -eq 0 ] && ! grep -qE 'ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|runtime error:' "$log"; then
    echo "fuzz_$name: ok, ${execs:-?} inputs in ${secs} s (${rate:-?}/s)"
    passed=$((passed + 1))
  else
    echo "fuzz_$name: FAILED (exit $rc); log $log:"
    grep -E -A40 'ERROR:|runtime error:|FUZZ_CHECK|deadly signal|Test unit written' "$log" | head -n 80
    status=1
    failed=$((failed + 1))
  fi
}
running=0 first=0
for name in "${targets[@]}"; do
  if [ $running -ge "$jobs" ]; then
    report $first
    first=$((first + 1))
    running=$((running - 1))
  fi
  run_one "$name" &
  pids+=($!)
  names+=("$name")
  running=$((running + 1))
done
for ((i = first; i < ${#names[@]}; i++)); do report $i; done
echo "fuzz: $passed passed, $failed failed"
exit $status
