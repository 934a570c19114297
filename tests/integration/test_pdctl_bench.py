#!/usr/bin/env python3
"""pdctl bench against a running cluster: a handful of requests, sane figures, --json parses
and agrees with the request shape, --svg is valid SVG, a dead URL fails fast."""
import json
import os
import re
import xml.etree.ElementTree as ET

from test_pdctl_common import Cluster, main, run


def scenario(args):
    with Cluster(args) as c:
        c.up()
        svg = os.path.join(c.tmp, "latency.svg")
        n, L, O = 6, 32, 8
        b = run(args, ["bench", "--url", c.url, "--num-prompts", str(n), "--input-len", str(L),
                       "--output-len", str(O), "--concurrency", "3", "--tokenizer", args.model,
                       "--json", "--svg", svg, "--seed", "1"], 240, check=0)
        r = json.loads(b.stdout)
        assert r["completed"] == n and r["failed"] == 0, r
        assert r["total_input_tokens"] == n * L, r       # token-id prompts: exact
        assert r["total_output_tokens"] == n * O, r      # ignore_eos + max_tokens: exact
        assert r["short_outputs"] == 0, r
        assert r["duration_s"] > 0 and r["request_throughput"] > 0, r
        assert abs(r["output_throughput"] - n * O / r["duration_s"]) < 1e-6 * n * O + 1e-3, r
        for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            d = r[k]
            # ITL and TPOT may be 0: tokens that arrive in one read share a timestamp (a
            # loaded machine can deliver a short request's whole stream in one read)
            lo = d["min"] >= 0 if k in ("itl_ms", "tpot_ms") else d["min"] > 0
            assert d["n"] > 0 and lo and d["min"] <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"], (k, d)
        assert r["ttft_ms"]["n"] == n and r["e2e_ms"]["n"] == n, r
        assert r["itl_ms"]["n"] > 0, r
        # each request's first token comes before its last
        assert r["ttft_ms"]["max"] <= r["e2e_ms"]["max"], r
        assert r["ttft_ms"]["mean"] < r["e2e_ms"]["mean"], r
        # TPOT is (e2e - ttft) / (O - 1): its mean cannot exceed the mean e2e / (O - 1)
        assert r["tpot_ms"]["mean"] <= r["e2e_ms"]["mean"] / (O - 1) + 1e-6, r

        root = ET.parse(svg).getroot()
        assert root.tag.endswith("svg"), root.tag
        ns = "{http://www.w3.org/2000/svg}"
        assert len(root.findall(".//%spolyline" % ns)) == 2, "two CDF lines expected"
        assert root.findall(".//%srect" % ns), "no histogram bars"

        # Poisson arrivals, text report, chat endpoint
        t = run(args, ["bench", "--url", c.url, "--num-prompts", "4", "--input-len", "16",
                       "--output-len", "4", "--rate", "20", "--endpoint", "chat",
                       "--tokenizer", args.model, "--no-warmup"], 240, check=0)
        m = re.search(r"Successful requests:\s+(\d+)", t.stdout)
        assert m and int(m.group(1)) == 4, t.stdout
        for k in ("TTFT", "TPOT", "ITL", "E2E", "Output token throughput"):
            assert k in t.stdout, (k, t.stdout)
        assert "bench:" in t.stderr, t.stderr   # progress on stderr

    # nothing listens any more: a clear, quick failure
    dead = run(args, ["bench", "--url", c.url, "--num-prompts", "2", "--quiet"], 30)
    assert dead.returncode == 1, dead
    assert "test request failed" in dead.stderr or "models" in dead.stderr, dead.stderr

    # --save-prompts: the same random prompts as `pdctl generate --input` lines, nothing sent
    # (no --url); generate runs them offline to the exact output length
    saved = os.path.join(c.tmp, "prompts.jsonl")
    s = run(args, ["bench", "--save-prompts", saved, "--num-prompts", "5", "--input-len", "12",
                   "--output-len", "3", "--seed", "7", "--tokenizer", args.model], 60, check=0)
    lines = [json.loads(x) for x in open(saved)]
    assert len(lines) == 5, lines
    for x in lines:
        assert len(x["prompt_ids"]) == 12 and x["max_tokens"] == 3 and x["ignore_eos"] is True, x
    assert len({tuple(x["prompt_ids"]) for x in lines}) == 5, "prompts should differ"
    again = os.path.join(c.tmp, "again.jsonl")
    run(args, ["bench", "--save-prompts", again, "--num-prompts", "5", "--input-len", "12",
               "--output-len", "3", "--seed", "7", "--tokenizer", args.model], 60, check=0)
    assert open(again).read() == open(saved).read(), "the same seed gives the same prompts"
    out = os.path.join(c.tmp, "offline.jsonl")
    run(args, ["generate", "--model", args.model, "--input", saved, "--output", out, "--quiet"],
        240, check=0)
    res = [json.loads(x) for x in open(out)]
    assert len(res) == 5 and all(len(r["output_ids"]) == 3 for r in res), res


if __name__ == "__main__":
    main(scenario)
