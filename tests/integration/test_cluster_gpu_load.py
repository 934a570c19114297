#!/usr/bin/env python3
"""Serving under load on one GPU, CUDA graphs on: a router, a prefill node and a decode node on
cuda:0 (--gpu-memory-utilization 0.4 each), the layout the README shows for a GPU.

For --seconds (150 by default), up to --concurrency clients (256) send completions with
  - prompts of 1 to 4,096 tokens (token ids, lengths log-uniform, each prompt distinct),
  - output lengths 1 to 256 (ignore_eos, so each runs to its max_tokens),
  - streaming and not, n = 1 mostly and 2 to 4 for some (sampled with a seed),
  - about one request in ten abandoned on purpose: a stream closed after a few chunks, or a
    non-streamed request whose connection closes before the answer.
Checks: no request that was not abandoned fails (HTTP status, error events, a missing [DONE],
a choice with fewer tokens than asked); the decode node replayed graphs; once the load is over
the router holds no request and every KV block of both nodes is free; then greedy completions of
fresh prompts (sent one at a time) equal `pdctl generate` of the same prompts on the same GPU,
token for token.

--memcheck runs the nodes under `compute-sanitizer --tool memcheck` (a short form: the small
model, shorter prompts, fewer and smaller requests) and requires no error report.

Label gpu; exits 77 (skipped) where `pdctl devices` reports no CUDA device. The model is
`--model DIR`, else a 4-layer Llama-3-8B-shaped model with random weights that the test makes
(pdctl make-model) in a temporary folder."""
import argparse
import concurrent.futures as cf
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pdcluster as pc  # noqa: E402

pc.ensure_packages(("requests", "requests"))
import requests  # noqa: E402

SKIP = 77


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--model", help="model folder (default: make a 4-layer llama3-8b)")
    ap.add_argument("--seconds", type=float, default=150)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--memcheck", action="store_true",
                    help="short form with the nodes under compute-sanitizer memcheck")
    return ap.parse_args()


def pdctl(a, args, timeout):
    return subprocess.run([os.path.join(a.build, "tools", "pdctl")] + args, capture_output=True,
                          text=True, timeout=timeout)


def references(a, model, prompts, max_tokens):
    """Greedy texts of `pdctl generate` batch mode, one process per prompt (alone in its
    batch, as each greedy request is in the cluster)."""
    out = []
    with tempfile.TemporaryDirectory(prefix="pd-gpu-load-ref-") as d:
        for i, ids in enumerate(prompts):
            path = os.path.join(d, "in%d.jsonl" % i)
            with open(path, "w") as f:
                f.write(json.dumps({"prompt_ids": ids, "max_tokens": max_tokens,
                                    "temperature": 0, "ignore_eos": True}) + "\n")
            r = pdctl(a, ["generate", "--model", model, "--input", path, "--output", "-",
                          "--quiet", "--device", "cuda:0", "--kv-cache-tokens", "16384"], 300)
            if r.returncode != 0:
                raise RuntimeError("pdctl generate: %s" % r.stderr[-2000:])
            line = json.loads(r.stdout.strip().splitlines()[-1])
            if "error" in line:
                raise RuntimeError("pdctl generate: %s" % line)
            out.append(line["text"])
    return out


class Load:
    def __init__(self, url, vocab, max_prompt, max_out, seed, timeout):
        self.url = url
        self.timeout = timeout  # per request: a hung request counts as failed
        self.vocab = vocab
        self.max_prompt = max_prompt
        self.max_out = max_out
        self.rnd = random.Random(seed)
        self.lock = threading.Lock()
        self.stats = {"ok": 0, "abandoned": 0, "failed": 0, "choices": 0, "tokens": 0}
        self.failures = []
        self.serial = 0

    def prompt(self, rnd, n):
        # distinct from the first token on: ids start with a serial number
        with self.lock:
            self.serial += 1
            k = self.serial
        return [100 + k % 20000] + [rnd.randrange(100, self.vocab - 1000) for _ in range(n - 1)]

    def one(self, rnd):
        n_prompt = max(1, min(self.max_prompt, int(math.exp(rnd.uniform(0, math.log(
            self.max_prompt))))))
        max_tokens = rnd.choice([1, 2, 8, 16, 32, 64, 128, self.max_out])
        max_tokens = min(max_tokens, self.max_out)
        n = 1 if rnd.random() < 0.8 else rnd.randint(2, 4)
        stream = rnd.random() < 0.5
        abandon = rnd.random() < 0.1
        body = {"prompt": self.prompt(rnd, n_prompt), "max_tokens": max_tokens, "n": n,
                "stream": stream, "ignore_eos": True}
        if n > 1 or rnd.random() < 0.3:
            body.update(temperature=0.8, top_p=0.95, seed=rnd.randrange(1 << 30))
        else:
            body["temperature"] = 0
        try:
            if stream:
                res = self.stream(body, abandon, rnd)
            else:
                res = self.plain(body, abandon, rnd)
        except requests.RequestException as e:
            res = ("failed", "%s: %s" % (type(e).__name__, e))
        with self.lock:
            self.stats[res[0]] += 1
            if res[0] == "ok":
                self.stats["choices"] += n
                self.stats["tokens"] += n * max_tokens
            if res[0] == "failed" and len(self.failures) < 10:
                self.failures.append((res[1], {k: v for k, v in body.items() if k != "prompt"},
                                      n_prompt))

    def plain(self, body, abandon, rnd):
        if abandon:
            s = socket.create_connection(("127.0.0.1", int(self.url.rsplit(":", 1)[1])), 10)
            data = json.dumps(body).encode()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
            time.sleep(rnd.random() * 0.5)
            s.close()
            return ("abandoned", None)
        r = requests.post(self.url + "/v1/completions", json=body, timeout=self.timeout)
        if r.status_code != 200:
            return ("failed", "HTTP %d: %s" % (r.status_code, r.text[:300]))
        j = r.json()
        if len(j["choices"]) != body["n"]:
            return ("failed", "%d choices" % len(j["choices"]))
        if j["usage"]["completion_tokens"] != body["n"] * body["max_tokens"]:
            return ("failed", "usage %s" % j["usage"])
        for c in j["choices"]:
            if c["finish_reason"] != "length":
                return ("failed", "finish_reason %r" % c["finish_reason"])
        return ("ok", None)

    def stream(self, body, abandon, rnd):
        body = dict(body, stream_options={"include_usage": True})
        stop_after = rnd.randint(0, 6) if abandon else -1
        events, done, usage, finish = 0, False, None, {}
        with requests.post(self.url + "/v1/completions", json=body, stream=True,
                           timeout=self.timeout) as r:
            if r.status_code != 200:
                return ("failed", "HTTP %d: %s" % (r.status_code, r.text[:300]))
            for o in pc.sse_events(r):
                if events == stop_after:
                    return ("abandoned", None)  # closes the connection mid-stream
                events += 1
                if o == "[DONE]":
                    done = True
                    break
                if "error" in o:
                    return ("failed", "error event %s" % o["error"])
                if o.get("usage"):
                    usage = o["usage"]
                for c in o["choices"]:
                    if c.get("finish_reason"):
                        finish[c["index"]] = c["finish_reason"]
        if abandon:
            return ("abandoned", None)
        if not done:
            return ("failed", "no [DONE]")
        if not usage or usage["completion_tokens"] != body["n"] * body["max_tokens"]:
            return ("failed", "usage %s" % usage)
        if sorted(finish) != list(range(body["n"])) or set(finish.values()) != {"length"}:
            return ("failed", "finish reasons %s" % finish)
        return ("ok", None)

    def run(self, seconds, concurrency):
        end = time.time() + seconds

        def worker(w):
            rnd = random.Random(w * 7919 + 1)
            while time.time() < end:
                self.one(rnd)

        with cf.ThreadPoolExecutor(concurrency) as ex:
            futs = [ex.submit(worker, w) for w in range(concurrency)]
            for f in futs:
                f.result()


def node_metric(c, name, metric):
    text = requests.get("http://127.0.0.1:%d/metrics" % c.node_metrics_port(name),
                        timeout=10).text
    return pc.metric(text, metric)


def stop_wrapped(c):
    """SIGTERM to the nodes themselves, the children of their compute-sanitizer wrappers, so
    that they shut down and the wrappers write their summaries and exit."""
    import signal
    for name, p in c.procs.items():
        if name == "router" or not p.alive():
            continue
        try:
            with open("/proc/%d/task/%d/children" % (p.p.pid, p.p.pid)) as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            kids = []
        for k in kids:
            try:
                os.kill(k, signal.SIGTERM)
            except OSError:
                pass
    end = time.time() + 180
    while time.time() < end and any(p.alive() for n, p in c.procs.items() if n != "router"):
        time.sleep(0.5)


def main():
    a = parse()
    d = pdctl(a, ["devices", "--json"], 60)
    if d.returncode != 0 or json.loads(d.stdout).get("cuda_devices", 0) == 0:
        print("skip: no CUDA device (%s)" % d.stdout.strip())
        return SKIP
    tmp = tempfile.mkdtemp(prefix="pd-gpu-load-")
    try:
        return run(a, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(a, tmp):
    ck = pc.Checks()
    model = a.model
    if a.memcheck and not model:
        model = pc.MODEL
    if not model:
        model = os.path.join(tmp, "llama3-8b-4l")
        t0 = time.time()
        r = pdctl(a, ["make-model", "--like", "llama3-8b", "--layers", "4", "--out", model],
                  600)
        if r.returncode != 0:
            print("make-model failed:", r.stderr[-2000:])
            return 1
        print("made a 4-layer llama3-8b in %.0f s" % (time.time() - t0))
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    vocab = cfg["vocab_size"]
    ctx = cfg.get("max_position_embeddings", 2048)
    max_out = 32 if a.memcheck else 256
    max_prompt = min(1024 if a.memcheck else 4096, ctx - max_out - 8)
    rnd = random.Random(12345)
    sample = [[17 + i] + [rnd.randrange(100, vocab - 1000) for _ in range(n - 1)]
              for i, n in enumerate([3, max_prompt // 4, max_prompt - 1])]
    t0 = time.time()
    refs = references(a, model, sample, 16)
    print("references in %.0f s" % (time.time() - t0))

    wrap = []
    share = "0.4"
    if a.memcheck:
        wrap = ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "86",
                "--log-file", os.path.join(tmp, "memcheck-%p.log")]
        share = "0.3"
    c = pc.Cluster(a.build, model=model, node_wrap=wrap,
                   base_node_args=("--device", "cuda:0", "--gpu-memory-utilization", share),
                   router_args=("--max-queue", "8192", "--request-timeout", "1200"))
    try:
        c.start_router()
        names = [c.start_node("prefill"), c.start_node("decode")]
        for n in names:
            c.wait_node_ready(n, timeout=900 if a.memcheck else 300)
        c.wait_health(1, 1, timeout=120)
        seconds = min(a.seconds, 60) if a.memcheck else a.seconds
        conc = min(a.concurrency, 16) if a.memcheck else a.concurrency
        load = Load(c.url, vocab, max_prompt, max_out, 1, 600 if a.memcheck else 120)
        t0 = time.time()
        load.run(seconds, conc)
        el = time.time() - t0
        st = load.stats
        print("  load: %.0f s, concurrency %d: %s; %.0f output tokens/s (completed requests)" %
              (el, conc, st, st["tokens"] / el))
        for f in load.failures:
            print("  failure:", f)
        ck.ok(st["ok"] >= (20 if a.memcheck else 200), "requests completed (%d)" % st["ok"])
        ck.ok(st["abandoned"] > 0, "some were abandoned on purpose (%d)" % st["abandoned"])
        ck.eq(st["failed"], 0, "no request failed")
        replays = node_metric(c, "d0", "pd_node_graph_replays_total")
        if replays is not None:
            ck.ok(replays > 0, "the decode node replayed CUDA graphs (%.0f)" % replays)

        def settled():
            m = requests.get(c.url + "/metrics", timeout=10).text
            v = {"live": pc.metric(m, "pd_router_requests_live")}
            for n in ("p0", "d0"):
                v[n] = (node_metric(c, n, "pd_node_kv_blocks_free"),
                        node_metric(c, n, "pd_node_kv_blocks_capacity"))
            return v

        end = time.time() + (60 if st["failed"] == 0 else 10)
        v = settled()
        while time.time() < end and not (v["live"] == 0 and all(
                v[n][0] == v[n][1] for n in ("p0", "d0"))):
            time.sleep(0.5)
            v = settled()
        ck.eq(v["live"], 0, "the router holds no request afterwards")
        for n in ("p0", "d0"):
            ck.eq(v[n][0], v[n][1], "every KV block of %s is free" % n)

        for ids, ref in zip(sample, refs):
            r = requests.post(c.url + "/v1/completions", timeout=300,
                              json={"prompt": ids, "max_tokens": 16, "temperature": 0,
                                    "ignore_eos": True})
            text = r.json()["choices"][0]["text"] if r.status_code == 200 else None
            ck.eq(text, ref, "greedy completion of a %d-token prompt equals pdctl generate" %
                  len(ids))
        for n in ("p0", "d0"):
            ck.ok(c.procs[n].alive(), "%s is still running" % n)
    finally:
        if a.memcheck:
            stop_wrapped(c)
        bad = c.down()
    ck.eq(bad, [], "no sanitizer report in the logs")
    if a.memcheck:
        errors = []
        for f in sorted(os.listdir(tmp)):
            if f.startswith("memcheck-"):
                with open(os.path.join(tmp, f), errors="replace") as fh:
                    text = fh.read()
                summary = [ln for ln in text.splitlines() if "ERROR SUMMARY" in ln]
                print("  %s: %s" % (f, summary[-1] if summary else "(no summary)"))
                if not summary or " 0 errors" not in summary[-1]:
                    errors.append(f)
                    print(text[:6000])
        ck.ok(len([f for f in os.listdir(tmp) if f.startswith("memcheck-")]) >= 2,
              "compute-sanitizer ran both nodes")
        ck.eq(errors, [], "compute-sanitizer memcheck found no error")
    return ck.done(c)


if __name__ == "__main__":
    sys.exit(main())
