#!/usr/bin/env python3
"""pdctl's single-process commands, run as a user would (standard library only).

  generate --prompt-ids/--prompt --json --temperature 0 --ignore-eos equals the golden greedy ids,
  --dump-logits equals the golden last logits, --chat applies the template, tokenize matches the
  golden tokenizer reference, the offline batch mode keeps input order, reports malformed lines
  and runs the rest, devices reports the CPU kernels and CUDA devices, and bad command lines
  exit non-zero with a message.
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "tests", "data")
MODEL = os.path.join(DATA, "models", "pycoder-12m")
PDCTL = sys.argv[1]
failures = 0


def check(cond, what):
    global failures
    if not cond:
        failures += 1
        print("FAIL:", what, file=sys.stderr)


def pdctl(*args, input=None):
    return subprocess.run([PDCTL, *args], capture_output=True, text=True, timeout=300,
                          input=input)


ref = json.load(open(os.path.join(DATA, "golden", "pycoder-12m", "reference.json")))
case = ref["cases"][1]
gaps = case["greedy_top2_gap"]
cut = next((i for i, g in enumerate(gaps) if g < 0.02), len(gaps))

# generate: greedy ids, via ids and via text
with tempfile.TemporaryDirectory() as tmp:
    dump = os.path.join(tmp, "logits.f32")
    r = pdctl("generate", "--model", MODEL, "--prompt-ids", ",".join(map(str, case["input_ids"])),
              "--max-tokens", "48", "--temperature", "0", "--ignore-eos", "--json",
              "--dump-logits", dump)
    check(r.returncode == 0, "generate --prompt-ids: " + r.stderr)
    out = json.loads(r.stdout)
    check(out["input_ids"] == case["input_ids"], "input ids echoed")
    check(out["output_ids"][:cut] == case["greedy_ids"][:cut], "greedy ids equal the golden ones")
    check(len(out["output_ids"]) == 48, "48 tokens with --ignore-eos")
    raw = open(dump, "rb").read()
    mine = struct.unpack("<%df" % (len(raw) // 4), raw)
    gold_raw = open(os.path.join(DATA, "golden", "pycoder-12m", case["last_logits_file"]), "rb").read()
    gold = struct.unpack("<%df" % (len(gold_raw) // 4), gold_raw)
    check(len(mine) == len(gold) == 4096, "dump-logits writes vocab_size floats")
    err = max(abs(a - b) for a, b in zip(mine, gold)) / max(abs(b) for b in gold)
    check(err < 1e-3, "dumped logits match the golden ones (rel err %g)" % err)

r = pdctl("generate", "--model", MODEL, "--prompt", case["prompt"], "--max-tokens", "48",
          "--temperature", "0", "--ignore-eos", "--json")
check(r.returncode == 0, "generate --prompt")
out = json.loads(r.stdout)
check(out["input_ids"] == case["input_ids"], "--prompt adds no special tokens")
check(out["output_ids"][:cut] == case["greedy_ids"][:cut], "--prompt greedy ids")

# streaming text equals the JSON text
r2 = pdctl("generate", "--model", MODEL, "--prompt", case["prompt"], "--max-tokens", "48",
           "--temperature", "0", "--ignore-eos")
check(r2.returncode == 0 and r2.stdout == out["text"] + "\n", "streamed text equals --json text")

# the single-prompt form takes the engine options of every other command: with an unusual
# cache layout and chunked prefill it gives what batch mode gives with the same options
eng = ["--kv-cache-dtype", "bf16", "--block-size", "32", "--max-batch-tokens", "16",
       "--device", "cpu", "--threads", "1"]
r = pdctl("generate", "--model", MODEL, "--prompt", case["prompt"], "--max-tokens", "24",
          "--temperature", "0", "--ignore-eos", "--json", *eng)
check(r.returncode == 0, "generate --prompt with engine options: " + r.stderr)
with tempfile.TemporaryDirectory() as tmp:
    inp = os.path.join(tmp, "in.jsonl")
    with open(inp, "w") as f:
        f.write(json.dumps({"prompt": case["prompt"], "max_tokens": 24, "temperature": 0,
                            "ignore_eos": True}) + "\n")
    rb = pdctl("generate", "--model", MODEL, "--input", inp, "--output", "-", "--quiet", *eng)
    check(rb.returncode == 0, "batch mode with the same options: " + rb.stderr)
    if r.returncode == 0 and rb.returncode == 0:
        check(json.loads(r.stdout)["output_ids"] == json.loads(rb.stdout)["output_ids"],
              "single-prompt and batch mode agree with the same engine options")
bad = pdctl("generate", "--model", MODEL, "--prompt", "x", "--device", "tpu:0")
check(bad.returncode != 0 and "--device" in bad.stderr, "a bad --device is refused with a message")

# chat template applied
r = pdctl("generate", "--model", MODEL, "--chat", "hello", "--max-tokens", "4", "--json",
          "--temperature", "0")
check(r.returncode == 0, "generate --chat")
ids = json.loads(r.stdout)["input_ids"]
tok = pdctl("tokenize", "--model", MODEL, "--text", "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
check(tok.returncode == 0 and ids == [int(x) for x in tok.stdout.strip().split(",")],
      "--chat renders ChatML")

# seeded sampling is reproducible, different seeds differ
a = pdctl("generate", "--model", MODEL, "--prompt", "import", "--max-tokens", "24", "--seed", "5",
          "--temperature", "1.0", "--ignore-eos", "--json")
b = pdctl("generate", "--model", MODEL, "--prompt", "import", "--max-tokens", "24", "--seed", "5",
          "--temperature", "1.0", "--ignore-eos", "--json")
c = pdctl("generate", "--model", MODEL, "--prompt", "import", "--max-tokens", "24", "--seed", "6",
          "--temperature", "1.0", "--ignore-eos", "--json")
check(json.loads(a.stdout)["output_ids"] == json.loads(b.stdout)["output_ids"], "same seed, same ids")
check(json.loads(a.stdout)["output_ids"] != json.loads(c.stdout)["output_ids"], "other seed, other ids")

# tokenize against the golden tokenizer reference
tref = json.load(open(os.path.join(DATA, "golden", "tokenizer_reference.json")))["pycoder"]
for entry in tref[:8]:
    if not entry["text"]:
        continue
    r = pdctl("tokenize", "--model", MODEL, "--text", entry["text"], "--json")
    check(r.returncode == 0 and json.loads(r.stdout)["ids"] == entry["ids"],
          "tokenize %r" % entry["text"][:20])
    r = pdctl("tokenize", "--model", MODEL, "--decode", ",".join(map(str, entry["ids"])), "--json")
    check(r.returncode == 0 and json.loads(r.stdout)["text"] == entry["decoded"], "decode")

# offline batch: order, errors, the rest still runs, n and logprobs
lines = [
    {"prompt_ids": case["input_ids"], "max_tokens": 16, "temperature": 0, "ignore_eos": True},
    "this is not json",
    {"prompt": "x", "temperature": -1},
    {"prompt": "def f(x):", "max_tokens": 8, "n": 3, "seed": 1, "logprobs": 2, "ignore_eos": True},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
    {"prompt_ids": [999999], "max_tokens": 4},
    {"prompt": "import os", "max_tokens": 4000},
]
with tempfile.TemporaryDirectory() as tmp:
    inp, outp = os.path.join(tmp, "in.jsonl"), os.path.join(tmp, "out.jsonl")
    with open(inp, "w") as f:
        for l in lines:
            f.write((l if isinstance(l, str) else json.dumps(l)) + "\n")
    r = pdctl("generate", "--model", MODEL, "--input", inp, "--output", outp, "--quiet")
    check(r.returncode == 0, "batch mode runs: " + r.stderr)
    res = [json.loads(l) for l in open(outp)]
    check([x["index"] for x in res] == list(range(len(lines))), "results in input order")
    k = min(16, cut)
    check(len(res[0]["output_ids"]) == 16 and res[0]["output_ids"][:k] == case["greedy_ids"][:k],
          "batch greedy ids")
    for k in (1, 2, 5, 6):
        check("error" in res[k] and res[k]["error"]["type"] == "invalid_request_error",
              "line %d gets an error record" % k)
    check(len(res[3]["choices"]) == 3 and all(len(ch["output_ids"]) == 8 for ch in res[3]["choices"]),
          "n = 3 choices")
    check(all(len(ch["logprobs"]) == 8 and len(ch["logprobs"][0]["top_logprobs"]) == 2
              for ch in res[3]["choices"]), "logprobs with 2 alternatives")
    check(res[4]["usage"]["prompt_tokens"] > 0 and "text" in res[4], "chat line")

# bench-model: decode tok/s over decode steps only. A step in which a sequence gets its first
# token ran its prompt's last prefill chunk, so it is not counted even where every other
# sequence decoded in it. With every prompt in the first step that leaves decode-tokens - 1
# steps; with a 20-token budget the second prompt's last chunk comes in step 2 beside the first
# sequence's decode, and of the 6 steps in which the first sequence generates, steps 3-6 count.
for batch, gen, extra, want in ((1, 2, [], 1), (2, 4, [], 3), (3, 6, [], 5),
                                (2, 6, ["--max-batch-tokens", "20"], 4)):
    r = pdctl("bench-model", "--model", MODEL, "--batch", str(batch), "--prompt-len", "16",
              "--decode-tokens", str(gen), "--repeat", "1", "--json", *extra)
    res = json.loads(r.stdout)["results"][0] if r.returncode == 0 else {}
    check(res.get("decode_steps") == want and res.get("decode_tokens_per_s", 0) > 0 and
          res.get("decode_ms_per_step", 0) > 0,
          "bench-model batch %d, %d tokens %s: %d decode steps: %r %s" %
          (batch, gen, extra, want, res, r.stderr))
r = pdctl("bench-model", "--model", MODEL, "--decode-tokens", "1")
check(r.returncode != 0 and "decode-tokens" in r.stderr, "bench-model rejects 1 token")

# devices: the CPU kernel family and the CUDA device count (what GPU tests skip on)
r = pdctl("devices", "--json")
dev = json.loads(r.stdout) if r.returncode == 0 else {}
check(dev.get("cpu_isa") in ("avx512", "avx2", "generic") and
      isinstance(dev.get("cuda_devices"), int) and dev["cuda_devices"] >= 0,
      "devices --json: %r %s" % (r.stdout, r.stderr))
r = pdctl("devices")
check(r.returncode == 0 and "cuda" in r.stdout, "devices: " + r.stdout + r.stderr)

# bad command lines: non-zero exit and a message, never a crash
for args in (["generate"], ["generate", "--model", MODEL],
             ["generate", "--model", "/nonexistent", "--prompt", "x"],
             ["generate", "--model", MODEL, "--prompt", "x", "--max-tokens", "0"],
             ["generate", "--model", MODEL, "--prompt", "x", "--temperature", "abc"],
             ["generate", "--model", MODEL, "--prompt-ids", "1,x"],
             ["generate", "--model", MODEL, "--prompt-ids", "99999"],
             ["generate", "--model", MODEL, "--prompt", "x", "--max-tokens", "100000"],
             ["generate", "--model", MODEL, "--prompt", "x", "--bogus"],
             ["tokenize", "--model", MODEL], ["devices", "--bogus"], ["nonsense"]):
    r = pdctl(*args)
    check(r.returncode not in (0,) and r.returncode > 0 and "pdctl" in r.stderr + r.stdout,
          "rejects %s (rc %d)" % (" ".join(args[1:3]), r.returncode))

print("%d failure(s)" % failures)
sys.exit(1 if failures else 0)
