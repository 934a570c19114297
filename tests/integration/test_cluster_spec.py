#!/usr/bin/env python3
"""Speculative decoding in the cluster (CPU nodes, pycoder-12m with pycoder-draft-2m).

  1. A prefill node and a decode node, both with the draft model (k 4, fixed): the prefill node
     computes the draft's KV of each prompt and ships it with the model's, the decode node
     speculates from it. Greedy completions, streamed and not, equal `pdctl generate` without
     speculation; the draft's KV landed for every request (pd_node_draft_kv_transfers_total on
     both sides); the decode node proposed and accepted tokens (pd_node_spec_*), and exactly as
     many as when its draft computes the prompts itself (the same cluster with no draft on the
     prefill node: the CPU forward is row-invariant, so shipped and local draft KV are the same
     bits and give the same proposals); the router reports the mean acceptance length, and
     `pdctl bench` prints it.
  2. A prefill node and two decode nodes, all with the draft model: kill -9 of the decode node
     serving a stream; the stream migrates (its prompt and output prefilled again, the draft's
     KV shipped to the new node) and its greedy text equals the uninterrupted one.
  3. A unified node with the draft model, adaptive: text equal to `pdctl generate`.
  4. `pdctl cluster up --speculative-method ngram --num-speculative-tokens 3` gives the decode
     node those options (its metrics carry method="ngram") and the prefill node the method."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pdcluster as pc  # noqa: E402

pc.ensure_packages(("requests", "requests"))
import requests  # noqa: E402

DRAFT = os.path.join(os.path.dirname(pc.MODEL), "pycoder-draft-2m")
SHORT = "def fibonacci(n):"
LONG = "".join("def f%d(x):\n    return x * %d + %d\n\n" % (i, i, i % 7) for i in range(8))
PROMPTS = (SHORT, LONG, "class Stack:\n    def __init__(self):\n")


def metric(url, name, labels=None):
    return pc.metric(requests.get(url + "/metrics", timeout=10).text, name, labels) or 0


def node_metric(c, node, name, labels=None):
    return metric("http://127.0.0.1:%d" % c.node_metrics_port(node), name, labels)


def complete(c, prompt, max_tokens, stream):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if stream:
        text, finish, err, done, _ = pc.stream_completion(c.url, body, timeout=120)
        assert err is None and done, (err, done)
        return text
    r = requests.post(c.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def draft_cluster_run(build, chk, ship):
    """Part 1's requests on a cluster whose prefill node has the draft (ship) or not; returns
    the decode node's proposed and accepted counts after them."""
    spec = ["--speculative-model", DRAFT, "--num-speculative-tokens", "4",
            "--speculative-adaptive", "off"]
    c = pc.Cluster(build, decode_args=spec, prefill_args=spec[:2] if ship else ())
    what = "shipped draft KV" if ship else "local draft KV"
    lab = {"method": "draft"}
    try:
        c.up(1, 1)
        for prompt in PROMPTS:
            ref = pc.pdctl_generate(build, prompt, max_tokens=40)["text"]
            for stream in (False, True):
                chk.eq(complete(c, prompt, 40, stream), ref,
                       "%s: %s %r == pdctl generate" %
                       (what, "stream" if stream else "non-stream", prompt[:16]))
        n = 2 * len(PROMPTS)
        sent = node_metric(c, "p0", "pd_node_draft_kv_transfers_total", {"direction": "sent"})
        landed = node_metric(c, "d0", "pd_node_draft_kv_transfers_total", {"outcome": "landed"})
        missing = node_metric(c, "d0", "pd_node_draft_kv_transfers_total", {"outcome": "missing"})
        if ship:
            chk.ok(sent == n and landed == n and missing == 0,
                   "draft KV shipped and landed for all %d requests (sent %d, landed %d, "
                   "missing %d)" % (n, sent, landed, missing))
        else:
            chk.ok(sent == 0 and landed == 0,
                   "no draft KV without a draft on the prefill node (%d, %d)" % (sent, landed))
        proposed = node_metric(c, "d0", "pd_node_spec_proposed_tokens_total", lab)
        accepted = node_metric(c, "d0", "pd_node_spec_accepted_tokens_total", lab)
        chk.ok(proposed > 0 and 0 < accepted <= proposed,
               "%s: %d proposed, %d accepted" % (what, proposed, accepted))
        if not ship:
            return proposed, accepted
        chk.ok(node_metric(c, "d0", "pd_node_spec_draft_steps_total", lab) > 0,
               "decode node: draft forwards counted")
        t0 = time.time()
        gauge = 0
        while time.time() - t0 < 10 and not gauge > 1:  # the next load report carries it
            gauge = metric(c.url, "pd_router_spec_acceptance_length")
            time.sleep(0.1)
        chk.ok(1 < gauge <= 5, "router: mean acceptance length %.2f in (1, 5]" % gauge)
        pdctl = os.path.join(build, "tools", "pdctl")
        b = subprocess.run([pdctl, "bench", "--url", c.url, "--num-prompts", "4", "--input-len",
                            "16", "--output-len", "8", "--tokenizer", pc.MODEL, "--quiet"],
                           capture_output=True, text=True, timeout=120)
        chk.ok(b.returncode == 0 and "Mean acceptance length (server):" in b.stdout,
               "pdctl bench prints the server's acceptance length" +
               ("" if b.returncode == 0 else ": " + b.stderr[-300:]))
        return proposed, accepted
    finally:
        chk.ok(not c.down(), "no sanitizer report (%s)" % what)


def part_draft(build, chk):
    local = draft_cluster_run(build, chk, False)
    shipped = draft_cluster_run(build, chk, True)
    chk.eq(shipped, local, "proposed and accepted with shipped draft KV == with the draft "
           "computing the prompts itself")


def part_migration(build, chk):
    spec = ["--speculative-model", DRAFT]
    c = pc.Cluster(build, decode_args=spec, prefill_args=spec)
    try:
        c.up(1, 2)
        body = {"prompt": LONG, "max_tokens": 300, "ignore_eos": True, "temperature": 0}
        ref = pc.pdctl_generate(build, LONG, max_tokens=300, extra=["--ignore-eos"])["text"]
        killed = {}

        def kill_at(n):
            if n == 20 and not killed:
                for _ in range(200):
                    ns = requests.get(c.url + "/cluster/nodes", timeout=10).json()["nodes"]
                    busy = [x["node_id"] for x in ns if x["requests"] > 0 and
                            x["node_id"].startswith("d")]
                    if busy:
                        killed["name"] = busy[0]
                        c.procs[busy[0]].kill(signal.SIGKILL)
                        return
                    time.sleep(0.01)

        text, finish, err, done, _ = pc.stream_completion(c.url, body, kill_at, timeout=120)
        chk.ok(killed.get("name") is not None, "killed the serving decode node %s" %
               killed.get("name"))
        chk.ok(err is None and done, "migrated stream ended cleanly (error %s)" % err)
        chk.ok(text == ref, "migrated speculative greedy stream == pdctl generate" +
               ("" if text == ref else " (len %d vs %d)" % (len(text or ""), len(ref))))
        chk.ok(metric(c.url, "pd_router_migrations_total") >= 1, "router counted a migration")
        other = "d1" if killed.get("name") == "d0" else "d0"
        chk.ok(node_metric(c, other, "pd_node_draft_kv_transfers_total",
                           {"outcome": "landed"}) >= 1,
               "the node that took over received the draft's KV of prompt and output")
        chk.ok(node_metric(c, other, "pd_node_spec_accepted_tokens_total", {"method": "draft"}) > 0,
               "the node that took over speculated")
    finally:
        c.down()


def part_unified(build, chk):
    c = pc.Cluster(build, decode_args=["--unified", "--speculative-model", DRAFT])
    try:
        c.up(0, 1)
        for prompt in PROMPTS:
            ref = pc.pdctl_generate(build, prompt, max_tokens=48)["text"]
            chk.eq(complete(c, prompt, 48, True), ref, "unified + draft: %r" % prompt[:16])
        chk.ok(node_metric(c, "d0", "pd_node_spec_proposed_tokens_total", {"method": "draft"}) > 0,
               "the unified node speculated")
    finally:
        chk.ok(not c.down(), "no sanitizer report (unified)")


def part_pdctl(build, chk):
    pdctl = os.path.join(build, "tools", "pdctl")
    with tempfile.TemporaryDirectory(prefix="pd-spec-") as run:
        up = subprocess.run([pdctl, "cluster", "up", "--model", pc.MODEL, "--run-dir", run,
                             "--prefill", "1", "--decode", "1", "--port", "0", "--insecure",
                             "--speculative-method", "ngram", "--num-speculative-tokens", "3",
                             "--", "--threads", "1"], capture_output=True, text=True,
                            timeout=180)
        try:
            chk.eq(up.returncode, 0, "pdctl cluster up --speculative-method ngram" +
                   ("" if up.returncode == 0 else ": " + up.stderr[-500:]))
            st = subprocess.run([pdctl, "cluster", "status", "--run-dir", run, "--json"],
                                capture_output=True, text=True, timeout=60)
            cmd = {}
            for p in json.loads(st.stdout)["processes"]:
                try:
                    with open("/proc/%d/cmdline" % p["pid"]) as f:
                        cmd[p["name"]] = f.read().split("\0")
                except OSError:
                    cmd[p["name"]] = []
            d = cmd.get("decode-0", [])
            chk.ok("--speculative-method" in d and d[d.index("--speculative-method") + 1] == "ngram"
                   and "3" == d[d.index("--num-speculative-tokens") + 1],
                   "the decode node got the speculative options: %s" % d)
            pf = cmd.get("prefill-0", [])
            chk.ok("--speculative-method" in pf and "--num-speculative-tokens" not in pf,
                   "the prefill node got the method only: %s" % pf)
        finally:
            subprocess.run([pdctl, "cluster", "down", "--run-dir", run], capture_output=True,
                           timeout=60)


def main():
    a = pc.args()
    chk = pc.Checks()
    for part in (part_draft, part_migration, part_unified, part_pdctl):
        try:
            part(a.build, chk)
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            chk.ok(False, "%s: exception %r" % (part.__name__, e))
    return chk.done()


if __name__ == "__main__":
    sys.exit(main())
