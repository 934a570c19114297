#!/usr/bin/env python3
"""Cluster fault test: kill -9 and stop nodes and the router under load; every request must end
with a result or a defined error within seconds.

  1. kill -9 of the decode node serving a stream, with a second decode node: the stream is
     migrated (prompt + tokens so far re-prefilled toward the other node) and its greedy text
     equals the uninterrupted one; the dead node leaves rotation.
  2. kill -9 of the last decode node mid-stream: the stream ends with an error event and
     [DONE], a non-streamed request with a 502, both within seconds; new requests get 503.
  3. kill -9 of a prefill node mid-prompt (long prompts, small prefill chunks): its prompts are
     retried on the other prefill node and all complete with the right text.
  4. a decode node that stops answering (SIGSTOP) leaves rotation, and rejoins after SIGCONT.
  5. the router is killed and restarted on the same ports: the nodes register again and
     requests work.
  6. a stalled KV transfer (prefill node stopped while a decode reservation waits): the
     reservation expires on the decode node (--kv-ttl-ms), the router retries, and the request
     completes once the prefill node runs again."""
import concurrent.futures as cf
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pdcluster as pc  # noqa: E402

pc.ensure_packages(("requests", "requests"))
import requests  # noqa: E402


def nodes(c):
    return {n["node_id"]: n for n in
            requests.get(c.url + "/cluster/nodes", timeout=10).json()["nodes"]}


def stream_request(c, body, on_chunk=None, timeout=60):
    """Streams a completion; returns (text, finish_reason, error_event, done, seconds)."""
    return pc.stream_completion(c.url, body, on_chunk, timeout)


def serving_decode(c, names):
    for _ in range(200):
        ns = nodes(c)
        busy = [k for k in names if k in ns and ns[k]["requests"] > 0]
        if busy:
            return busy[0]
        time.sleep(0.01)
    return None


def metric(c, name, labels=None):
    return pc.metric(requests.get(c.url + "/metrics", timeout=10).text, name, labels) or 0


def part_decode(c, chk):
    c.up(1, 2)
    body = {"prompt": "def fibonacci(n):", "max_tokens": 1500, "ignore_eos": True,
            "temperature": 0}
    ref = requests.post(c.url + "/v1/completions", json=body, timeout=120).json()
    ref_text = ref["choices"][0]["text"]
    chk.eq(ref["usage"]["completion_tokens"], 1500, "reference: 1500 tokens")

    # 1. migration
    killed = {}

    def kill_at(n):
        if n == 40 and not killed:
            victim = serving_decode(c, ["d0", "d1"])
            killed["name"] = victim
            killed["t"] = time.time()
            if victim:
                c.procs[victim].kill(signal.SIGKILL)

    text, finish, err, done, dt = stream_request(c, body, kill_at, timeout=120)
    chk.ok(killed.get("name") is not None, f"killed the serving decode node {killed.get('name')}")
    chk.ok(err is None and done, f"migrated stream ended cleanly (error {err})")
    chk.eq(finish, "length", "migrated stream finish_reason")
    chk.ok(text == ref_text, "migrated greedy stream == uninterrupted text" +
           ("" if text == ref_text else f" (len {len(text or '')} vs {len(ref_text)})"))
    chk.ok(metric(c, "pd_router_migrations_total") >= 1, "router counted a migration")
    t0 = time.time()
    while time.time() - t0 < 10 and c.health()[1].get("decode_nodes") != 1:
        time.sleep(0.1)
    chk.eq(c.health()[1].get("decode_nodes"), 1, "the dead decode node left rotation")
    survivor = "d1" if killed.get("name") == "d0" else "d0"

    # 2. the last decode node dies mid-stream: a defined error within seconds
    res = {}

    def non_stream():
        t = time.time()
        try:
            r = requests.post(c.url + "/v1/completions", json=body, timeout=60)
            res["ns"] = (r.status_code, r.json(), time.time() - t)
        except Exception as e:  # noqa: BLE001
            res["ns"] = (0, str(e), time.time() - t)

    th = threading.Thread(target=non_stream)
    th.start()
    killed2 = {}

    def kill_last(n):
        if n == 40 and not killed2:
            killed2["t"] = time.time()
            c.procs[survivor].kill(signal.SIGKILL)

    text, finish, err, done, dt = stream_request(c, body, kill_last, timeout=60)
    th.join(timeout=60)
    after = time.time() - killed2.get("t", time.time())
    chk.ok(err is not None and done, f"stream ends with an error event and [DONE] ({err})")
    chk.ok(after < 10, f"... within seconds of the kill ({after:.1f} s)")
    code, ans, _ = res.get("ns", (0, None, 0))
    chk.ok(code == 502 and isinstance(ans, dict) and "error" in ans,
           f"non-streamed request: 502 with an error body ({code})")
    r = requests.post(c.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4},
                      timeout=20)
    chk.eq(r.status_code, 503, "no decode node left: 503")


def long_prompt(i):
    lines = [f"value_{i}_{k} = compute({k}, {i * k})\n" for k in range(60)]
    return "".join(lines)


def part_prefill(c, chk):
    c.up(2, 1)
    prompts = [long_prompt(i) for i in range(8)]
    refs = {}
    for p in prompts:
        o = pc.pdctl_generate(c.build, prompt=p, max_tokens=8)
        refs[p] = o["text"]
        n_prompt = len(o["input_ids"])
    print(f"  (prompts of about {n_prompt} tokens)")
    m0 = metric(c, "pd_router_retries_total")

    def go(p):
        r = requests.post(c.url + "/v1/completions", timeout=300,
                          json={"prompt": p, "max_tokens": 8, "temperature": 0})
        return r.status_code, (r.json()["choices"][0]["text"] if r.status_code == 200 else r.text)

    with cf.ThreadPoolExecutor(max_workers=8) as ex:
        futs = [ex.submit(go, p) for p in prompts]
        victim = None
        for _ in range(500):
            ns = nodes(c)
            if ns.get("p0", {}).get("requests", 0) > 0:
                victim = "p0"
                break
            time.sleep(0.005)
        chk.ok(victim is not None, "prefill node p0 had prompts in flight")
        if victim:
            c.procs[victim].kill(signal.SIGKILL)
        res = [f.result() for f in futs]
    bad = [(code, t) for (code, t), p in zip(res, prompts) if code != 200 or t != refs[p]]
    chk.ok(not bad, "all prompts complete with the right text after the prefill kill" +
           (f": {bad[:2]}" if bad else ""))
    chk.ok(metric(c, "pd_router_retries_total") > m0, "router retried prompts of the dead node")

    # 4. a decode node that stops answering leaves rotation and comes back
    c.procs["d0"].kill(signal.SIGSTOP)
    t0 = time.time()
    while time.time() - t0 < 10 and c.health()[0] == 200:
        time.sleep(0.1)
    gone = time.time() - t0
    chk.ok(c.health()[0] == 503, f"a stopped decode node leaves rotation ({gone:.1f} s)")
    r = requests.post(c.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=20)
    chk.eq(r.status_code, 503, "requests without a decode node: 503")
    c.procs["d0"].kill(signal.SIGCONT)
    t0 = time.time()
    while time.time() - t0 < 10 and c.health()[0] != 200:
        time.sleep(0.1)
    chk.ok(c.health()[0] == 200, f"it rejoins after SIGCONT ({time.time() - t0:.1f} s)")
    r = requests.post(c.url + "/v1/completions",
                      json={"prompt": "def f():", "max_tokens": 8, "temperature": 0}, timeout=30)
    chk.eq(r.status_code, 200, "requests work after the rejoin")

    # 5. router restart: nodes register again. While the router is away a node is not ready
    # (/health 503 once its heartbeats go unanswered) but alive (/live 200): a liveness probe
    # must not restart it for another process's absence.
    c.procs["router"].kill(signal.SIGKILL)
    os.remove(os.path.join(c.dir, "router.ready"))
    port = c.node_metrics_port("d0")
    t0 = time.time()
    while time.time() - t0 < 10 and requests.get(
            f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
        time.sleep(0.1)
    chk.eq(requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code, 503,
           "without the router a node's /health is 503")
    chk.eq(requests.get(f"http://127.0.0.1:{port}/live", timeout=5).status_code, 200,
           "and its /live is 200")
    c.start_router()
    t0 = time.time()
    try:
        c.wait_health(1, 1, timeout=15)
        ok = True
    except RuntimeError:
        ok = False
    chk.ok(ok, f"nodes re-registered with the restarted router ({time.time() - t0:.1f} s)")
    r = requests.post(c.url + "/v1/completions",
                      json={"prompt": prompts[0], "max_tokens": 8, "temperature": 0}, timeout=30)
    chk.ok(r.status_code == 200 and r.json()["choices"][0]["text"] == refs[prompts[0]],
           "requests work after the router restart")


def part_stall(c, chk):
    c.up(1, 1)
    body = {"prompt": "def stalled(x):", "max_tokens": 16, "temperature": 0}
    ref = requests.post(c.url + "/v1/completions", json=body, timeout=30).json()
    c.procs["p0"].kill(signal.SIGSTOP)
    res = {}

    def go():
        r = requests.post(c.url + "/v1/completions", json=body, timeout=60)
        res["r"] = (r.status_code, r.json())

    th = threading.Thread(target=go)
    th.start()
    time.sleep(2.5)  # past the 1.5 s reservation ttl: the decode node gave its blocks back
    dport = c.node_metrics_port("d0")
    expired = pc.metric(requests.get(f"http://127.0.0.1:{dport}/metrics", timeout=10).text,
                        "pd_node_reservations_expired_total") or 0
    c.procs["p0"].kill(signal.SIGCONT)
    th.join(timeout=60)
    chk.ok(expired >= 1, f"the stalled reservation expired on the decode node ({expired})")
    code, ans = res.get("r", (0, {}))
    chk.ok(code == 200 and ans["choices"][0]["text"] == ref["choices"][0]["text"],
           f"the request completes after the stall ({code})")
    chk.ok(metric(c, "pd_router_retries_total") >= 1, "the router retried after the timeout")


def main():
    a = pc.args()
    chk = pc.Checks()
    rc = 0
    parts = [
        (part_decode, pc.Cluster(a.build)),
        # (the surviving prefill node takes all eight prompts one after the other; under the
        # sanitizers on two busy cores that is minutes, so its reservations get a TTL that
        # outlasts it: expiry is part_stall's subject, not this part's)
        (part_prefill, pc.Cluster(a.build, prefill_args=["--max-batch-tokens", "32",
                                                         "--no-prefix-cache"],
                                  router_args=["--kv-ttl-ms", "300000"])),
        (part_stall, pc.Cluster(a.build, router_args=["--kv-ttl-ms", "1500",
                                                      "--heartbeat-timeout-ms", "30000"])),
    ]
    for fn, c in parts:
        c.build = a.build
        print(f"== {fn.__name__}")
        n_fail = len(chk.failures)
        try:
            fn(c, chk)
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            chk.ok(False, f"{fn.__name__}: exception {e!r}")
        if len(chk.failures) > n_fail:
            print(c.logs(40))
            rc = 1
        chk.eq(c.down(), [], f"{fn.__name__}: no sanitizer reports")
    return chk.done() or rc


if __name__ == "__main__":
    sys.exit(main())
