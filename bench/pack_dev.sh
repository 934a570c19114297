#!/usr/bin/env bash
# Packs a CUDA build's programs and GPU tests (stripped) with the non-glibc, non-CUDA shared
# libraries they load into one xz tarball, small enough to carry to a GPU machine that has the
# CUDA toolkit (cuBLAS, cudart) but no build dependencies. Unpack and run bench/gpu_suite.sh.
#
#   bench/pack_dev.sh BUILD_DIR OUT.tar.xz
set -euo pipefail
B=${1:?usage: pack_dev.sh BUILD_DIR OUT.tar.xz}
OUT=${2:?usage: pack_dev.sh BUILD_DIR OUT.tar.xz}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
mkdir -p "$T/bin" "$T/lib"
for p in tools/pdctl router/pd-router prefill-node/pd-prefill decode-node/pd-decode \
         kernels/cuda/pd-bench-cuda kernels/cuda/pd-bench-sync \
         kernels/cuda/pd-bench-dataflow; do
  [ -x "$B/$p" ] && cp "$B/$p" "$T/bin/"
done
for t in "$B"/tests/test_cuda_* "$B"/tests/test_gpu_*; do
  [ -x "$t" ] && cp "$t" "$T/bin/"
done
strip "$T"/bin/* 2>/dev/null || true
# the kernel timeline recorder (CUDA_INJECTION64_PATH; bench/trace_summary.py), where built
[ -f "$B/kernels/cuda/libpd-cupti-trace.so" ] && cp "$B/kernels/cuda/libpd-cupti-trace.so" "$T/lib/"
skip='^(linux-vdso|ld-linux[^ ]*|libc|libm|libdl|libpthread|librt|libutil|libresolv|libgcc_s|libstdc\+\+|libcuda|libcudart|libcublas|libcublasLt|libnvidia-[^ ]*)\.so'
for f in "$T"/bin/* "$T"/lib/libpd-cupti-trace.so; do
  [ -e "$f" ] || continue
  ldd "$f" 2>/dev/null | awk '$3 ~ /^\// {print $1, $3}' | while read -r name path; do
    if ! [[ "$name" =~ $skip ]]; then cp -L "$path" "$T/lib/"; fi
  done
done
strip "$T"/lib/* 2>/dev/null || true
tar -C "$T" -cf - bin lib | xz -9 -T2 > "$OUT"
ls -l "$OUT"
