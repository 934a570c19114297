#!/usr/bin/env python3
"""The operator's GPU options of every command that runs a model (label gpu; exits 77, skipped,
when `pdctl devices --json` reports no CUDA device):

  --enforce-eager       decode steps op by op: the same greedy text as with CUDA graphs (the same
                        kernels on the same shapes);
  --no-device-sampling  logits to the host, sampled there: the same greedy text;
  --profile-gpu         the per-op GPU time table on stderr at exit, with graph replays (graphs)
                        or with the decode step's ops (eager), and the same text.

Each through `pdctl generate --input` on cuda:0 with the bundled pycoder-12m, greedy, 48 tokens."""
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_pdctl_common import SKIP, parse_args, run  # noqa: E402

PROMPT = "import numpy as np\n\n\ndef moving_average(xs, n):\n"


def generate(args, path, flags):
    r = run(args, ["generate", "--model", args.model, "--input", path, "--output", "-",
                   "--kv-cache-tokens", "4096", "--device", "cuda:0"] + flags, 180, check=0)
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert "error" not in line, line
    return line["text"], r.stderr


def main():
    args = parse_args()
    d = run(args, ["devices", "--json"], 60, check=0)
    if json.loads(d.stdout)["cuda_devices"] == 0:
        print("skip: no CUDA device (pdctl devices: %s)" % d.stdout.strip())
        sys.exit(SKIP)
    with tempfile.TemporaryDirectory(prefix="pd-gpu-opts-") as tmp:
        path = os.path.join(tmp, "in.jsonl")
        with open(path, "w") as f:
            f.write(json.dumps({"prompt": PROMPT, "max_tokens": 48, "temperature": 0}) + "\n")
        ref, err = generate(args, path, [])
        assert ref, "empty reference text"
        assert "GPU time by op" not in err, "profile table without --profile-gpu:\n" + err
        for flags in (["--enforce-eager"], ["--no-device-sampling"],
                      ["--enforce-eager", "--no-device-sampling"]):
            text, _ = generate(args, path, flags)
            assert text == ref, "%s: %r, without: %r" % (" ".join(flags), text, ref)
            print("ok %s" % " ".join(flags))
        text, err = generate(args, path, ["--profile-gpu"])
        assert text == ref, "--profile-gpu changed the text: %r vs %r" % (text, ref)
        assert "profile-gpu: GPU time by op" in err, err
        assert "profile-gpu: graph replays" in err, "no graph replay rows:\n" + err
        print("ok --profile-gpu (graphs)")
        text, err = generate(args, path, ["--profile-gpu", "--enforce-eager"])
        assert text == ref
        table = err[err.index("profile-gpu: GPU time by op"):]
        for op in ("attention decode", "matmul"):
            assert op in table, "no %s row in the eager profile:\n%s" % (op, table)
        print("ok --profile-gpu --enforce-eager")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print("FAIL: %s" % e, file=sys.stderr)
        sys.exit(1)
    sys.exit(0)
