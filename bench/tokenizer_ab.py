#!/usr/bin/env python3
"""Tokenizer speed of this tree against another revision, side by side in one run.

  bench/tokenizer_ab.py [--base REV] [--runs N] [--reps R] [--build DIR] [--corpus FILE]

Builds REV's tokenizer libraries (git archive into DIR/tokenizer_ab/, Release, no CUDA), links
this tree's pd-bench-tokenizer source (public API only) against them, then runs the two
programs alternately N times over the llama2, llama3 and qwen3 tokenizers of DIR/tokenizers
and prints the medians of load time and encoding MB/s (CPU time), their ratios, and whether
both gave the same ids. The corpus (about 1 MB) defaults to this tree's docs and common/ C
sources plus the golden tokenizer texts 20 times (multilingual, edge cases)."""
import argparse, glob, json, os, re, shutil, statistics, subprocess, sys

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ap = argparse.ArgumentParser()
ap.add_argument("--base", default="main")
ap.add_argument("--runs", type=int, default=12)
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--build", default=os.path.join(root, "build"))
ap.add_argument("--corpus")
a = ap.parse_args()

new_bin = os.path.join(a.build, "common", "pd-bench-tokenizer")
toks = [os.path.join(a.build, "tokenizers", t) for t in ("llama2", "llama3", "qwen3")]
if not os.path.exists(new_bin) or not all(os.path.isdir(t) for t in toks):
    sys.exit(f"build pd-bench-tokenizer and pd_tokenizer_data in {a.build} first")
work = os.path.join(a.build, "tokenizer_ab")
os.makedirs(work, exist_ok=True)

corpus = a.corpus or os.path.join(work, "corpus.txt")
if not a.corpus:
    parts = []
    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if k in ("text", "input") and isinstance(v, str): parts.append(v)
                else: walk(v)
        elif isinstance(x, list):
            for v in x: walk(v)
    walk(json.load(open(os.path.join(root, "tests/data/golden/tokenizer_reference.json"))))
    files = sorted(glob.glob(os.path.join(root, "docs/*.md")) + [os.path.join(root, "README.md")] +
                   glob.glob(os.path.join(root, "common/**/*.c"), recursive=True))
    src = "\n".join(open(f, encoding="utf-8", errors="replace").read() for f in files)
    open(corpus, "w").write(("\n".join(parts) + "\n") * 20 + src)

sha = subprocess.run(["git", "-C", root, "rev-parse", "--short", a.base], check=True,
                     capture_output=True, text=True).stdout.strip()
src_dir, bld = os.path.join(work, f"src-{sha}"), os.path.join(work, f"build-{sha}")
if not os.path.isdir(src_dir):
    os.makedirs(src_dir + ".tmp", exist_ok=True)
    subprocess.run(f"git -C '{root}' archive {sha} | tar -x -C '{src_dir}.tmp'", shell=True, check=True)
    os.rename(src_dir + ".tmp", src_dir)
subprocess.run(["cmake", "-S", src_dir, "-B", bld, "-DCMAKE_BUILD_TYPE=Release", "-DPD_CUDA=OFF",
                "-DPD_BUILD_TESTS=OFF"], check=True, stdout=subprocess.DEVNULL)
subprocess.run(["cmake", "--build", bld, f"-j{os.cpu_count() or 2}", "--target", "pdtokenizer"], check=True,
               stdout=subprocess.DEVNULL)
libs = sorted(glob.glob(os.path.join(bld, "common", "**", "*.a"), recursive=True))
incs = [d for d in (os.path.join(src_dir, "common/include"), os.path.join(src_dir, "common/base/include"))
        if os.path.isdir(d)]
pkg = subprocess.run(["pkg-config", "--libs", "libpcre2-8", "libutf8proc", "libcjson", "libxxhash"],
                     check=True, capture_output=True, text=True).stdout.split()
old_bin = os.path.join(work, f"pd-bench-tokenizer-{sha}")
subprocess.run(["cc", "-O2", "-std=c11", "-D_GNU_SOURCE", *[f"-I{d}" for d in incs],
                os.path.join(root, "common/tokenizer/bench/bench_tokenizer.c"), "-o", old_bin,
                "-Wl,--start-group", *libs, "-Wl,--end-group", *pkg, "-lpthread", "-lm"], check=True)

bins = [(f"{a.base} ({sha})", old_bin), ("this tree", new_bin)]
res, ids = {}, {}
for i in range(a.runs):
    for label, b in (bins if i % 2 == 0 else bins[::-1]):
        out = subprocess.run([b, corpus, str(a.reps), *toks], check=True, capture_output=True,
                             text=True).stdout
        for line in out.splitlines():
            m = re.match(r"(\S+)\s+load ([\d.]+) ms\s+encode ([\d.]+) MB/s\s+\d+ tokens\s+ids (\S+)", line)
            tok, load, enc, h = m.groups()
            res.setdefault((label, tok), []).append((float(load), float(enc)))
            ids.setdefault(tok, set()).add(h)
print(f"corpus {os.path.getsize(corpus)} bytes, {a.runs} alternated runs, best of {a.reps} passes each; medians:")
for tok in ("llama2", "llama3", "qwen3"):
    base = res[(bins[0][0], tok)]
    bl, be = (statistics.median(x[i] for x in base) for i in (0, 1))
    for label, _ in bins:
        r = res[(label, tok)]
        l, e = (statistics.median(x[i] for x in r) for i in (0, 1))
        print(f"  {tok:7s} {label:16s} load {l:7.1f} ms ({l / bl:5.3f})  encode {e:6.2f} MB/s ({e / be:5.3f})")
    print(f"  {tok:7s} same ids: {'yes' if len(ids[tok]) == 1 else 'NO'}")
