#!/usr/bin/env python3
"""Unified nodes (pd-decode --unified) and the router's choice of local or remote prefill.

  1. A router and one unified node, no prefill node: greedy completions, streamed and not,
     equal `pdctl generate` of the same prompts; every prompt was prefilled locally (router
     pd_router_prefills_total{path="local"}, node pd_node_local_prefills_total); no KV moved.
  2. A prefill node and a unified node, router --remote-prefill-min-tokens 48: a prompt of fewer
     tokens is prefilled by the unified node, a longer one by the prefill node (its pages go to
     the unified node as to any decode node); both texts equal `pdctl generate`. With
     --remote-prefill-max-queue 0 and a long prompt queued on the (stopped) prefill node, the
     next long prompt is prefilled locally.
  3. Two unified nodes, no prefill node: kill -9 of the one serving a stream; the stream is
     migrated (prompt + tokens so far prefilled locally on the other) and its greedy text equals
     the uninterrupted one.
  4. `pdctl cluster up --prefill 0 --decode 1` starts a unified node that answers."""
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pdcluster as pc  # noqa: E402

pc.ensure_packages(("requests", "requests"))
import requests  # noqa: E402

SHORT = "def fibonacci(n):"
LONG = "".join("def f%d(x):\n    return x * %d + %d\n\n" % (i, i, i % 7) for i in range(8))


def metric(url, name, labels=None):
    return pc.metric(requests.get(url + "/metrics", timeout=10).text, name, labels) or 0


def node_metric(c, node, name):
    port = c.node_metrics_port(node)
    return metric("http://127.0.0.1:%d" % port, name)


def complete(c, prompt, max_tokens, stream):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if stream:
        text, finish, err, done, _ = pc.stream_completion(c.url, body, timeout=120)
        assert err is None and done, (err, done)
        return text
    r = requests.post(c.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def part_local_only(build, chk):
    c = pc.Cluster(build, decode_args=["--unified"])
    try:
        c.up(0, 1)
        for prompt in (SHORT, LONG):
            ref = pc.pdctl_generate(build, prompt, max_tokens=24)["text"]
            for stream in (False, True):
                chk.eq(complete(c, prompt, 24, stream), ref,
                       "unified only: %s %r == pdctl generate" %
                       ("stream" if stream else "non-stream", prompt[:16]))
        chk.eq(metric(c.url, "pd_router_prefills_total", {"path": "local"}), 4,
               "router: 4 local prefills")
        chk.eq(metric(c.url, "pd_router_prefills_total", {"path": "remote"}), 0,
               "router: no remote prefill")
        chk.eq(node_metric(c, "d0", "pd_node_local_prefills_total"), 4, "node: 4 local prefills")
        chk.eq(node_metric(c, "d0", "pd_node_kv_transfers_total"), 0, "node: no KV transfer")
        role = requests.get(c.url + "/cluster/nodes", timeout=10).json()["nodes"][0]["role"]
        chk.eq(role, "unified", "/cluster/nodes role")
    finally:
        chk.ok(not c.down(), "no sanitizer report (unified only)")


def part_choice(build, chk):
    c = pc.Cluster(build, decode_args=["--unified"],
                   router_args=["--remote-prefill-min-tokens", "48"])
    try:
        c.up(1, 1)
        n_short = len(pc.pdctl_generate(build, SHORT, max_tokens=1)["input_ids"])
        n_long = len(pc.pdctl_generate(build, LONG, max_tokens=1)["input_ids"])
        chk.ok(n_short < 48 <= n_long, "prompt lengths %d and %d around the threshold" %
               (n_short, n_long))
        ref_s = pc.pdctl_generate(build, SHORT, max_tokens=16)["text"]
        ref_l = pc.pdctl_generate(build, LONG, max_tokens=16)["text"]
        chk.eq(complete(c, SHORT, 16, False), ref_s, "short prompt text")
        chk.eq((metric(c.url, "pd_router_prefills_total", {"path": "local"}),
                metric(c.url, "pd_router_prefills_total", {"path": "remote"})), (1, 0),
               "short prompt (%d tokens < 48): prefilled locally" % n_short)
        try:
            chk.eq(complete(c, LONG, 16, True), ref_l, "long prompt text")
        except Exception:
            print(c.logs(60))
            raise
        chk.eq((metric(c.url, "pd_router_prefills_total", {"path": "local"}),
                metric(c.url, "pd_router_prefills_total", {"path": "remote"})), (1, 1),
               "long prompt (%d tokens >= 48): prefilled remotely" % n_long)
        chk.ok(node_metric(c, "d0", "pd_node_kv_transfers_total") >= 1,
               "the unified node took the long prompt's KV pages")
    finally:
        chk.ok(not c.down(), "no sanitizer report (choice)")
    # the queue rule at --remote-prefill-max-queue 0: a prefill node with anything queued is
    # backed up. The prefill node is stopped (SIGSTOP) so that the first long prompt, sent to it
    # while it was idle, stays queued there; the next one then goes to the unified node.
    c = pc.Cluster(build, decode_args=["--unified"],
                   router_args=["--remote-prefill-min-tokens", "48",
                                "--remote-prefill-max-queue", "0",
                                "--heartbeat-interval-ms", "2000",
                                "--heartbeat-timeout-ms", "30000"])
    try:
        c.up(1, 1)
        c.procs["p0"].kill(signal.SIGSTOP)
        res = {}
        first = threading.Thread(target=lambda: res.setdefault("t", complete(c, LONG, 4, False)))
        first.start()
        t0 = time.time()
        while time.time() - t0 < 10 and metric(c.url, "pd_router_prefills_total",
                                               {"path": "remote"}) < 1:
            time.sleep(0.01)
        state = {n["node_id"]: n["state"] for n in
                 requests.get(c.url + "/cluster/nodes", timeout=10).json()["nodes"]}
        chk.eq(state.get("p0"), "alive", "the stopped prefill node still counts as alive")
        chk.eq(complete(c, LONG, 16, False), ref_l, "long prompt, prefill node backed up: text")
        chk.eq((metric(c.url, "pd_router_prefills_total", {"path": "remote"}),
                metric(c.url, "pd_router_prefills_total", {"path": "local"})), (1, 1),
               "queue rule: the first long prompt remote, the next (prefill node backed up) local")
        c.procs["p0"].kill(signal.SIGCONT)
        first.join(60)
        chk.ok(res.get("t") is not None, "the queued prompt finished once the node resumed")
    finally:
        c.procs["p0"].kill(signal.SIGCONT)
        chk.ok(not c.down(), "no sanitizer report (queue rule)")


def part_migration(build, chk):
    c = pc.Cluster(build, decode_args=["--unified"])
    try:
        c.up(0, 2)
        body = {"prompt": SHORT, "max_tokens": 400, "ignore_eos": True, "temperature": 0}
        ref = requests.post(c.url + "/v1/completions", json=body, timeout=120).json()
        ref_text = ref["choices"][0]["text"]
        killed = {}

        def kill_at(n):
            if n == 30 and not killed:
                for _ in range(200):
                    ns = requests.get(c.url + "/cluster/nodes", timeout=10).json()["nodes"]
                    busy = [x["node_id"] for x in ns if x["requests"] > 0]
                    if busy:
                        killed["name"] = busy[0]
                        c.procs[busy[0]].kill(signal.SIGKILL)
                        return
                    time.sleep(0.01)

        text, finish, err, done, _ = pc.stream_completion(c.url, body, kill_at, timeout=120)
        chk.ok(killed.get("name") is not None, "killed the serving unified node %s" %
               killed.get("name"))
        chk.ok(err is None and done, "migrated stream ended cleanly (error %s)" % err)
        chk.ok(text == ref_text, "migrated greedy stream == uninterrupted text" +
               ("" if text == ref_text else " (len %d vs %d)" % (len(text or ""), len(ref_text))))
        chk.ok(metric(c.url, "pd_router_migrations_total") >= 1, "router counted a migration")
    finally:
        c.down()


def part_pdctl(build, chk):
    pdctl = os.path.join(build, "tools", "pdctl")
    with tempfile.TemporaryDirectory(prefix="pd-unified-") as run:
        up = subprocess.run([pdctl, "cluster", "up", "--model", pc.MODEL, "--run-dir", run,
                             "--prefill", "0", "--decode", "1", "--port", "0", "--insecure",
                             "--", "--threads", "1"], capture_output=True, text=True,
                            timeout=180)
        try:
            chk.eq(up.returncode, 0, "pdctl cluster up --prefill 0 --decode 1" +
                   ("" if up.returncode == 0 else ": " + up.stderr[-500:]))
            chk.ok("1 unified" in up.stdout, "it started one unified node")
            port = [w for w in up.stdout.split() if w.startswith("http://127.0.0.1:")]
            url = port[0] if port else None
            if url:
                r = requests.post(url + "/v1/completions",
                                  json={"prompt": SHORT, "max_tokens": 8, "temperature": 0},
                                  timeout=60)
                chk.eq(r.status_code, 200, "the unified cluster answers")
        finally:
            subprocess.run([pdctl, "cluster", "down", "--run-dir", run], capture_output=True,
                           timeout=60)


def main():
    a = pc.args()
    chk = pc.Checks()
    for part in (part_local_only, part_choice, part_migration, part_pdctl):
        try:
            part(a.build, chk)
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            chk.ok(False, "%s: exception %r" % (part.__name__, e))
    return chk.done()


if __name__ == "__main__":
    sys.exit(main())
