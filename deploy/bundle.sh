#!/usr/bin/env bash
# Packs the built programs, the shared libraries they load that are not part of glibc, and
# the bundled model into one folder, for a machine that has none of the build dependencies
# (e.g. a GPU box): copy the folder over and run bin/pdctl there.
#
#   deploy/bundle.sh [--build-dir DIR] [--out DIR] [--model DIR]... [--no-model] [--tar]
#
#   --build-dir DIR  where the programs were built (default: build)
#   --out DIR        the bundle folder (default: deploy/bundle; emptied first)
#   --model DIR      a model folder to include (repeatable; default tests/data/models/pycoder-12m)
#   --no-model       include no model
#   --tar            also write DIR.tar.gz
#
# Layout:  bin/<program>        small wrappers that set LD_LIBRARY_PATH and run ...
#          libexec/<program>    the stripped binaries (pdctl finds pd-router etc. next to it)
#          lib/                 the non-glibc shared libraries (libzmq, libprotobuf-c, cuBLAS, ...)
#          models/<name>/       the models
# The CUDA driver (libcuda, libnvidia-*) is never copied: it must match the target's kernel
# module and comes from the target machine.
set -euo pipefail
cd "$(dirname "$0")/.."

build=build
out=deploy/bundle
models=()
no_model=0
tar=0
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) build="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --model) models+=("$2"); shift 2 ;;
    --no-model) no_model=1; shift ;;
    --tar) tar=1; shift ;;
    -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bundle: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[ ${#models[@]} -eq 0 ] && [ $no_model = 0 ] && models=(tests/data/models/pycoder-12m)

progs=(router/pd-router prefill-node/pd-prefill decode-node/pd-decode tools/pdctl)
for p in "${progs[@]}"; do
  if [ ! -x "$build/$p" ]; then
    echo "bundle: $build/$p is missing: build first (deploy/setup.sh, or cmake --build $build)" >&2
    exit 1
  fi
done
for m in "${models[@]}"; do
  [ -f "$m/config.json" ] || { echo "bundle: $m is not a model folder (no config.json)" >&2; exit 1; }
done

case "$out" in
  ""|"/"|".") echo "bundle: refusing to empty '$out'" >&2; exit 2 ;;
esac
rm -rf "$out"
mkdir -p "$out/bin" "$out/libexec" "$out/lib" "$out/models"

# glibc's own libraries and the loader stay on the target; so does the GPU driver.
skip_re='^(linux-vdso|linux-gate|ld-linux[^ ]*|libc|libm|libdl|libpthread|librt|libresolv|libutil|libanl|libnsl|libmvec|libBrokenLocale|libcuda|libnvidia-[^ ]*|libnvcuvid|libdxcore)\.so'

strip_prog=strip
command -v strip >/dev/null || strip_prog=true
declare -A seen=()
for p in "${progs[@]}"; do
  name=$(basename "$p")
  cp "$build/$p" "$out/libexec/$name"
  "$strip_prog" "$out/libexec/$name"
  # every resolved library of the program (ldd lists the transitive closure)
  while read -r lib arrow path _; do
    [ "$arrow" = "=>" ] || continue
    [ -f "$path" ] || continue
    if [[ "$lib" =~ $skip_re ]]; then continue; fi
    [ -n "${seen[$lib]:-}" ] && continue
    seen[$lib]=1
    cp -L "$path" "$out/lib/$lib"
    chmod 644 "$out/lib/$lib"
  done < <(ldd "$build/$p")
  if ldd "$build/$p" | grep -q "not found"; then
    echo "bundle: $build/$p has unresolved libraries:" >&2
    ldd "$build/$p" | grep "not found" >&2
    exit 1
  fi
  cat > "$out/bin/$name" <<SH
#!/bin/sh
# Runs $name with the libraries of this bundle.
here=\$(cd "\$(dirname "\$0")/.." && pwd)
LD_LIBRARY_PATH="\$here/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "\$here/libexec/$name" "\$@"
SH
  chmod 755 "$out/bin/$name"
done
shopt -s nullglob
libs=("$out"/lib/*.so*)
[ ${#libs[@]} -gt 0 ] && "$strip_prog" --strip-unneeded "${libs[@]}" 2>/dev/null || true

for m in "${models[@]}"; do
  cp -r "$m" "$out/models/$(basename "$m")"
done

cat > "$out/README" <<EOF2
pdserve bundle, built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m) from $build.
glibc $(ldd --version | head -1 | awk '{print $NF}') or newer is needed on the target.

  bin/pdctl cluster up --model models/$( [ ${#models[@]} -gt 0 ] && basename "${models[0]}" || echo MODEL) \\
      --prefill 1 --decode 1 --port 8000 --run-dir /tmp/pdserve
  bin/pdctl cluster down --run-dir /tmp/pdserve
EOF2

if [ $tar = 1 ]; then
  tar -C "$(dirname "$out")" -czf "$out.tar.gz" "$(basename "$out")"
  echo "bundle: wrote $out.tar.gz"
fi
echo "bundle: $out ($(du -sh "$out" | cut -f1)): ${#progs[@]} programs, ${#seen[@]} libraries, ${#models[@]} models"
