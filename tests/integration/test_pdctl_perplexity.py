#!/usr/bin/env python3
"""`pdctl perplexity` against the perplexities the tools computed (tests/data/quant, with
../shared/quant/README.md's tolerance of 0.5%):
  1. the GPTQ checkpoint (GPTQModel, pycoder-qwen2-4m) on the evaluation ids of
     tests/data/quant/eval_ids.json, windows of 256 with stride 256 (as its reference.json
     says), equals the tool's `quantized` perplexity, and the float model it was made from the
     `original_bf16_as_float32` one; both score 65,280 tokens in 256 windows;
  2. a stride shorter than the context scores every token after the first once (windows
     overlap) and gives a lower perplexity (more context per token);
  3. --text-file tokenizes a text; bad input (ids outside the vocabulary, not JSON, a stride over
     the context, neither file) exits nonzero with a message."""
import argparse
import json
import os
import subprocess
import sys
import tempfile


def run(pdctl, args, ok=True):
    p = subprocess.run([pdctl, "perplexity"] + args, capture_output=True, text=True, timeout=600)
    if ok:
        assert p.returncode == 0, (args, p.stderr)
        return json.loads(p.stdout)
    assert p.returncode != 0 and p.stderr.startswith("pdctl: "), (args, p.returncode, p.stderr)
    return p.stderr.strip()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pdctl", required=True)
    ap.add_argument("--repo", required=True)
    a = ap.parse_args()
    data = os.environ.get("PD_TEST_DATA_DIR") or os.path.join(a.repo, "tests", "data")
    ids = os.path.join(data, "quant", "eval_ids.json")
    gptq = os.path.join(data, "quant", "pycoder-qwen2-4m-gptq-g128")
    base = os.path.join(data, "models", "pycoder-qwen2-4m")
    with open(os.path.join(gptq, "reference.json")) as f:
        ref = json.load(f)["perplexity"]
    failures = []

    def check(cond, what):
        print(("  ok   " if cond else "  FAIL ") + what)
        if not cond:
            failures.append(what)

    for model, key in ((gptq, "quantized"), (base, "original_bf16_as_float32")):
        r = run(a.pdctl, ["--model", model, "--ids-file", ids, "--context", "256", "--json",
                          "--threads", "2"])
        want = ref[key]["ppl"]
        check(abs(r["perplexity"] - want) <= 0.005 * want and r["tokens_scored"] == 65280 and
              r["windows"] == 256,
              "%s: perplexity %.4f, the tool's %.4f (%d tokens in %d windows)" %
              (os.path.basename(model), r["perplexity"], want, r["tokens_scored"], r["windows"]))
        if key == "quantized":
            q = r

    # --quantization fp8 on the float model: llm-compressor's FP8_DYNAMIC scheme (per-channel
    # e4m3 weights, dynamic per-token activations) computed at load, against the perplexity of
    # the checkpoint the tool made from the same model with that scheme
    with open(os.path.join(data, "quant", "pycoder-qwen2-4m-llmc-fp8-dynamic-q_proj",
                           "reference.json")) as f:
        want = json.load(f)["perplexity"]["quantized"]["ppl"]
    r = run(a.pdctl, ["--model", base, "--ids-file", ids, "--context", "256", "--json",
                      "--threads", "2", "--quantization", "fp8"])
    check(abs(r["perplexity"] - want) <= 0.005 * want and r["tokens_scored"] == 65280,
          "pycoder-qwen2-4m --quantization fp8: perplexity %.4f, llm-compressor FP8_DYNAMIC's "
          "%.4f" % (r["perplexity"], want))
    # an FP8 (e4m3) KV cache, scale 1.0 (the float model has no kv_cache_scheme), within 0.5% of
    # the bf16 KV cache's perplexity
    ppl_kv = {}
    for kv in ("bf16", "fp8"):
        ppl_kv[kv] = run(a.pdctl, ["--model", base, "--ids-file", ids, "--context", "256",
                                   "--json", "--threads", "2", "--kv-cache-dtype", kv])["perplexity"]
    check(abs(ppl_kv["fp8"] - ppl_kv["bf16"]) <= 0.005 * ppl_kv["bf16"],
          "--kv-cache-dtype fp8: perplexity %.4f, bf16 KV %.4f" % (ppl_kv["fp8"], ppl_kv["bf16"]))
    err = run(a.pdctl, ["--model", gptq, "--ids-file", ids, "--quantization", "fp8"], ok=False)
    check("quantized already" in err, "--quantization fp8 on a GPTQ checkpoint: %s" % err)
    err = run(a.pdctl, ["--model", base, "--ids-file", ids, "--quantization", "int2"], ok=False)
    check("expected none or fp8" in err, "--quantization int2: %s" % err)

    with tempfile.TemporaryDirectory(prefix="pd-ppl-") as d:
        with open(ids) as f:
            first = json.load(f)["ids"][:2000]
        small = os.path.join(d, "ids.json")
        with open(small, "w") as f:
            json.dump(first, f)
        r1 = run(a.pdctl, ["--model", gptq, "--ids-file", small, "--context", "256", "--json"])
        r2 = run(a.pdctl, ["--model", gptq, "--ids-file", small, "--context", "256", "--stride",
                           "128", "--json"])
        check(r1["tokens_scored"] == 2000 - 8 and r2["tokens_scored"] == 1999,
              "windows of 256: %d scored (1 per window unscored), stride 128: %d (all but the "
              "first)" % (r1["tokens_scored"], r2["tokens_scored"]))
        check(r2["perplexity"] < r1["perplexity"],
              "overlapping windows give more context: %.4f < %.4f" % (r2["perplexity"],
                                                                      r1["perplexity"]))
        text = os.path.join(d, "t.txt")
        with open(text, "w") as f:
            f.write("def add(a, b):\n    return a + b\n\n" * 40)
        r = run(a.pdctl, ["--model", gptq, "--text-file", text, "--context", "128", "--json"])
        check(r["tokens_scored"] > 100 and 1 < r["perplexity"] < 50,
              "--text-file: %d tokens, perplexity %.3f" % (r["tokens_scored"], r["perplexity"]))
        bad = os.path.join(d, "bad.json")
        with open(bad, "w") as f:
            json.dump([1, 2, 99999], f)
        for args, want in (([ "--ids-file", bad], "outside the vocabulary"),
                           (["--ids-file", text], "expected a JSON array"),
                           (["--ids-file", small, "--context", "64", "--stride", "65"],
                            "longer than --context"),
                           ([], "exactly one of")):
            msg = run(a.pdctl, ["--model", gptq] + args, ok=False)
            check(want in msg, "refused %s: %s" % (args, msg))
    print("test_pdctl_perplexity: %s" % ("all checks passed" if not failures else
                                          "%d checks failed" % len(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
