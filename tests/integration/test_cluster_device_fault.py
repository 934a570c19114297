#!/usr/bin/env python3
"""A node whose device fails leaves the cluster and exits; its requests go on elsewhere.

The fault is real for the node: --fail-device-after N makes its backend fail after N steps as
a device fault does (on a GPU a trapping kernel, the context's sticky launch failure; on the
CPU backend a recorded failure), and everything after that is the node's ordinary handling.

  1. Two decode nodes, one of them failing after 12 steps, under 16 concurrent greedy streams:
     the failing node logs the failure, deregisters ("device failed") and exits with status 3;
     every request completes, and the texts equal those of a healthy run (the streams it held
     migrate: prompt and tokens so far re-prefilled toward the other decode node); the router
     never routes to it again (its /cluster/nodes no longer lists it).
  2. Two prefill nodes taking 64 tokens a step, one failing after 3 steps: it exits with
     status 3, every request completes (the prompts it held are retried on the other prefill
     node) with the healthy run's text.
Under a sanitizer build, the logs hold no report.

--gpu runs the nodes on cuda:0 (label gpu; skipped without a device): the fault is then a kernel
that traps. The texts are compared with the healthy run's only on the CPU (on a GPU other batch
compositions round differently, so a greedy text may part at a near-tie)."""
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pdcluster as pc  # noqa: E402

pc.ensure_packages(("requests", "requests"))
import requests  # noqa: E402

HEADS = ["def add(a, b):", "import os\n", "class Stack:", "for i in range(10):",
         "def fib(n):", "x = [1, 2, 3]\n", "while True:", "print('hello')\n"]
# about a hundred tokens each, distinct from the first line on (no shared cached prefix)
PROMPTS = [h + "\n" + "".join("def f%d_%d(x):\n    return x * %d + %d\n" % (i, j, j, i)
                              for j in range(6)) + h for i, h in enumerate(HEADS)]
MAX_TOKENS = 24


def stream(c, prompt):
    """(text, None) of a greedy streamed completion, or (None, what went wrong)."""
    text, _, err, done, _ = pc.stream_completion(
        c.url, {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}, timeout=120)
    if err or not done:
        return None, f"error {err}, done {done}"
    return text, None


def load(c, n=32):
    with cf.ThreadPoolExecutor(16) as ex:
        futs = [ex.submit(stream, c, PROMPTS[i % len(PROMPTS)]) for i in range(n)]
        return [f.result() for f in futs]


def wait_exit(proc, timeout=30):
    end = time.time() + timeout
    while time.time() < end and proc.alive():
        time.sleep(0.1)
    return None if proc.alive() else proc.p.returncode


NODE_ARGS = ("--threads", "1", "--kv-cache-mb", "64")
EXACT = True  # texts must equal the healthy run's (the CPU backend is batch-invariant)


def check_texts(ck, results):
    wrong = sum(1 for (t, e), p in zip(results, [PROMPTS[i % len(PROMPTS)]
                                                  for i in range(len(results))])
                if not e and t != EXPECTED[p])
    if EXACT:
        ck.eq(wrong, 0, "every text equals the healthy cluster's")
    else:  # other batches, other rounding: greedy texts may part at a near-tie
        print("  --   %d of %d texts differ from the healthy cluster's" % (wrong, len(results)))


EXPECTED = {}


def start(build, prefill, decode):
    """A router and one node per entry of prefill / decode (each entry: its extra flags)."""
    c = pc.Cluster(build, base_node_args=NODE_ARGS)
    c.start_router()
    names = [c.start_node("prefill", x) for x in prefill]
    names += [c.start_node("decode", x) for x in decode]
    for n in names:
        c.wait_node_ready(n)
    c.wait_health(len(prefill), len(decode))
    return c


def part_decode(ck, build, expected):
    print("== a decode node's device fails under load")
    c = start(build, [[]], [[], ["--fail-device-after", "12"]])
    results = load(c)
    bad = [e for _, e in results if e]
    ck.eq(bad, [], "every stream completed while a decode node's device failed")
    check_texts(ck, results)
    code = wait_exit(c.procs["d1"])
    ck.eq(code, 3, "the failed decode node exited with status 3")
    log = c.procs["d1"].tail(200)
    ck.ok("the device failed" in log and "leaving the cluster" in log,
          "it logged the device failure")
    nodes = requests.get(c.url + "/cluster/nodes", timeout=10).json()["nodes"]
    ck.ok(all(n["node_id"] != "d1" for n in nodes), "the router no longer lists it")
    rlog = c.procs["router"].tail(400)
    ck.ok("device failed" in rlog, "the router logged why it left")
    ck.eq(c.health()[1].get("decode_nodes"), 1, "/health counts one decode node")
    text, err = stream(c, PROMPTS[0])
    ck.ok(err is None and (text == expected[PROMPTS[0]] or not EXACT),
          "a request afterwards is answered")
    m = requests.get(c.url + "/metrics", timeout=10).text
    moved = pc.metric(m, "pd_router_migrations_total") or 0
    ck.ok(moved > 0, f"streams it held migrated ({moved:.0f})")
    ck.eq(c.down(), [], "no sanitizer report")


def part_prefill(ck, build, expected):
    print("== a prefill node's device fails under load")
    # 64-token forward passes: the prompts take several steps each, so the failing node holds
    # some half-prefilled when its device goes
    c = start(build, [["--max-batch-tokens", "64"],
                      ["--max-batch-tokens", "64", "--fail-device-after", "3"]], [[]])
    results = load(c)
    bad = [e for _, e in results if e]
    ck.eq(bad, [], "every stream completed while a prefill node's device failed")
    check_texts(ck, results)
    ck.eq(wait_exit(c.procs["p1"]), 3, "the failed prefill node exited with status 3")
    ck.eq(c.health()[1].get("prefill_nodes"), 1, "/health counts one prefill node")
    m = requests.get(c.url + "/metrics", timeout=10).text
    retried = pc.metric(m, "pd_router_retries_total") or 0
    ck.ok(retried > 0, f"prompts it held were retried ({retried:.0f})")
    ck.eq(c.down(), [], "no sanitizer report")


def main():
    global NODE_ARGS, EXACT
    gpu = "--gpu" in sys.argv
    if gpu:
        sys.argv.remove("--gpu")
    a = pc.args()
    if gpu:
        d = subprocess.run([os.path.join(a.build, "tools", "pdctl"), "devices", "--json"],
                           capture_output=True, text=True, timeout=60)
        if d.returncode != 0 or json.loads(d.stdout).get("cuda_devices", 0) == 0:
            print("skip: no CUDA device")
            return 77
        NODE_ARGS = ("--device", "cuda:0", "--gpu-memory-utilization", "0.15")
        EXACT = False
    ck = pc.Checks()
    c = pc.Cluster(a.build, base_node_args=NODE_ARGS)
    c.up(1, 1)
    expected = {}
    for p in PROMPTS:
        t, e = stream(c, p)
        if e:
            print("healthy cluster failed:", e)
            print(c.logs())
            c.down()
            return 1
        expected[p] = t
    EXPECTED.update(expected)
    c.down()
    part_decode(ck, a.build, expected)
    part_prefill(ck, a.build, expected)
    return ck.done()


if __name__ == "__main__":
    sys.exit(main())
