#!/usr/bin/env python3
"""Cluster load test: one router, one prefill and two decode nodes.

Checks: 100 concurrent mixed requests (completions / chat, streamed / not, greedy / sampled)
all complete, greedy ones with the text the same request gives alone; a slow client (reads
nothing for seconds) and a vanished client (disconnects mid-stream) block nobody, and the
vanished one's sequence is aborted on the nodes; a bounded locust run (vLLM-style locust file
posting to /generate) ends with zero failures."""
import argparse
import concurrent.futures as cf
import csv
import json
import os
import random
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pdcluster as pc  # noqa: E402

pc.ensure_packages(("requests", "requests"), ("locust", "locust"))
import requests  # noqa: E402

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Node:\n    def __init__(self",
           "# compute the mean of a list\n", "for i in range(10):", "def quicksort(xs):"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True, help="the CMake build folder")
    ap.add_argument("--decode-arg", action="append", default=[],
                    help="a flag for the decode nodes (repeatable)")
    a = ap.parse_args()
    chk = pc.Checks()
    pc.run_checks(pc.Cluster(a.build, decode_args=a.decode_arg), run, chk, n_decode=2)
    return chk.done()


def sse_events(resp):
    """Data payloads of an SSE response (requests, stream=True)."""
    out = []
    for line in resp.iter_lines(decode_unicode=False):
        if line.startswith(b"data: "):
            out.append(line[6:].decode())
    return out


def one_request(c, i, ref):
    kind = ["comp", "comp-stream", "chat", "chat-stream"][i % 4]
    greedy = i % 2 == 0
    prompt = PROMPTS[i % len(PROMPTS)]
    mt = 8 + (i * 7) % 25
    body = {"max_tokens": mt, "temperature": 0 if greedy else 0.8, "seed": i}
    if kind.startswith("comp"):
        path = "/v1/completions"
        body["prompt"] = prompt
    else:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": prompt}]
    stream = kind.endswith("stream")
    body["stream"] = stream
    r = requests.post(c.url + path, json=body, timeout=120, stream=stream)
    if r.status_code != 200:
        return f"{i}: status {r.status_code} {r.text[:200]}"
    if stream:
        ev = sse_events(r)
        if not ev or ev[-1] != "[DONE]":
            return f"{i}: stream did not end with [DONE]"
        text, finish = "", None
        for e in ev[:-1]:
            o = json.loads(e)
            if "error" in o:
                return f"{i}: error event {o}"
            for ch in o["choices"]:
                text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                finish = ch.get("finish_reason") or finish
    else:
        o = r.json()
        ch = o["choices"][0]
        text = ch.get("text") if "text" in ch else ch["message"]["content"]
        finish = ch["finish_reason"]
        if o["usage"]["completion_tokens"] > mt:
            return f"{i}: {o['usage']['completion_tokens']} tokens > max_tokens {mt}"
    if finish not in ("stop", "length"):
        return f"{i}: finish_reason {finish}"
    if greedy:
        want = ref[(path, prompt, mt)]
        if text != want:
            return f"{i}: greedy text {text!r} != alone {want!r}"
    return None


def run(c, chk):
    # references: every greedy request alone, one at a time
    ref = {}
    for i in range(0, 100, 2):
        prompt = PROMPTS[i % len(PROMPTS)]
        mt = 8 + (i * 7) % 25
        chat = (i % 4) >= 2
        path = "/v1/chat/completions" if chat else "/v1/completions"
        if (path, prompt, mt) in ref:
            continue
        body = {"max_tokens": mt, "temperature": 0}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        o = requests.post(c.url + path, json=body, timeout=60).json()
        ch = o["choices"][0]
        ref[(path, prompt, mt)] = ch["text"] if not chat else ch["message"]["content"]

    # ---- 100 concurrent mixed requests ----
    t0 = time.time()
    with cf.ThreadPoolExecutor(max_workers=100) as ex:
        errs = [f.result() for f in [ex.submit(one_request, c, i, ref) for i in range(100)]]
    bad = [e for e in errs if e]
    chk.ok(not bad, f"100 concurrent mixed requests complete ({time.time() - t0:.1f} s)" +
           (": " + "; ".join(bad[:5]) if bad else ""))
    nodes = requests.get(c.url + "/cluster/nodes", timeout=10).json()["nodes"]
    chk.eq(sorted(n["node_id"] for n in nodes), ["d0", "d1", "p0"], "/cluster/nodes lists nodes")
    m = requests.get(c.url + "/metrics", timeout=10).text
    d_tokens = [pc.metric(requests.get(f"http://127.0.0.1:{c.node_metrics_port(d)}/metrics",
                                       timeout=10).text, "pd_node_generation_tokens_total")
                for d in ("d0", "d1")]
    chk.ok(all(t and t > 0 for t in d_tokens), f"both decode nodes got work ({d_tokens})")

    # ---- a slow client blocks nobody ----
    slow = socket.create_connection(("127.0.0.1", c.port), timeout=30)
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    body = json.dumps({"prompt": "def slow():", "max_tokens": 400, "ignore_eos": True,
                       "temperature": 0, "stream": True}).encode()
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    t0 = time.time()
    with cf.ThreadPoolExecutor(max_workers=10) as ex:
        errs = [f.result() for f in [ex.submit(one_request, c, i, ref) for i in range(10)]]
    dt = time.time() - t0
    chk.ok(not any(errs) and dt < 20, f"others complete while a client reads nothing ({dt:.1f} s)")
    time.sleep(1.0)
    data = b""
    slow.settimeout(30)
    while not data.endswith(b"0\r\n\r\n"):
        chunk = slow.recv(65536)
        if not chunk:
            break
        data += chunk
    slow.close()
    chk.ok(b"data: [DONE]" in data and b'"finish_reason":"length"' in data,
           "the slow client gets its whole stream afterwards")

    # ---- a vanished client blocks nobody and its sequence is aborted ----
    m0 = requests.get(c.url + "/metrics", timeout=10).text
    gone = socket.create_connection(("127.0.0.1", c.port), timeout=30)
    body = json.dumps({"prompt": "def vanish():", "max_tokens": 1800, "ignore_eos": True,
                       "temperature": 0, "stream": True}).encode()
    gone.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = gone.recv(4096)
    chk.ok(got.startswith(b"HTTP/1.1 200"), "vanishing client got its stream started")
    gone.close()
    t0 = time.time()
    errs = [one_request(c, i, ref) for i in range(4)]
    chk.ok(not any(errs), "requests complete after a client vanished")
    aborted = False
    while time.time() - t0 < 10:
        m1 = requests.get(c.url + "/metrics", timeout=10).text
        running = sum(pc.metric(requests.get(
            f"http://127.0.0.1:{c.node_metrics_port(d)}/metrics", timeout=10).text,
            "pd_node_running_seqs") or 0 for d in ("d0", "d1"))
        if ((pc.metric(m1, "pd_router_errors_total", {"kind": "aborted"}) or 0) >
                (pc.metric(m0, "pd_router_errors_total", {"kind": "aborted"}) or 0) and running == 0):
            aborted = True
            break
        time.sleep(0.2)
    chk.ok(aborted, f"the vanished client's sequence was aborted on the nodes "
           f"({time.time() - t0:.1f} s)")
    gen0 = pc.metric(m1, "pd_router_generation_tokens_total")
    chk.ok(gen0 is not None and gen0 < pc.metric(m0, "pd_router_generation_tokens_total") + 1800,
           "the aborted request did not run to its max_tokens")

    # ---- locust, vLLM style ----
    here = os.path.dirname(os.path.abspath(__file__))
    out = os.path.join(c.dir, "locust")
    cmd = [sys.executable, "-m", "locust", "-f", os.path.join(here, "locustfile_vllm.py"),
           "--headless", "-u", "8", "-r", "8", "-t", "15s", "--host", c.url, "--csv", out,
           "--only-summary", "--stop-timeout", "10"]
    p = subprocess.run(cmd, capture_output=True, timeout=120)
    rows = {}
    try:
        with open(out + "_stats.csv") as f:
            for row in csv.DictReader(f):
                rows[row["Name"]] = row
    except OSError:
        pass
    agg = rows.get("Aggregated", {})
    n_req = int(agg.get("Request Count", 0) or 0)
    n_fail = int(agg.get("Failure Count", -1) or 0) if agg else -1
    chk.ok(p.returncode == 0 and n_req > 20 and n_fail == 0,
           f"locust: {n_req} requests, {n_fail} failures, exit {p.returncode}" +
           ("" if p.returncode == 0 else "\n" + p.stderr.decode(errors="replace")[-2000:]))
    chk.eq(requests.get(c.url + "/health", timeout=10).status_code, 200, "healthy at the end")


if __name__ == "__main__":
    random.seed(1)
    sys.exit(main())
