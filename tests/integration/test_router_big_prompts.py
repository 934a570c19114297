#!/usr/bin/env python3
"""Multi-megabyte prompts are tokenized off the router's event loop (issue 22, part 6).

The router runs with --max-body-mb 12 and --max-prompt-mb 6. While ordinary streamed
completions run one after the other, three 5 MB prompts go in at once over HTTP (two
completions and a chat whose message is 5 MB) and a 3.5 MB prompt over the ZeroMQ client API
(its frames are capped at 4 MiB). Meanwhile /health is polled every 50 ms and small
non-streamed completions are sent one after another. Checks:
  - the big prompts were tokenized (the 400 context_length_exceeded names their token counts;
    the ZeroMQ one gets CONTEXT_TOO_LONG);
  - /health answered within 0.5 s every time, the streams never paused 0.5 s between two events
    (1 s under a sanitizer build) and each ended with [DONE], and the small completions were
    answered within 1 s (3 s under a sanitizer build): they do not wait behind the big prompts;
  - a 7 MB prompt (over --max-prompt-mb) gets 400 naming the limit within 0.5 s, before any
    tokenizing, even while the pool is busy; a 13 MB body gets 413 naming the body limit;
  - a client that resets its connection right after sending a big prompt, and a ZeroMQ client
    that cancels its big prompt while it is tokenized (it gets one ABORT chunk), leave nothing
    behind: the router frees every request (pd_router_requests_live and
    pd_router_requests_tokenizing 0);
and the router reports no sanitizer error."""
import json
import os
import socket
import struct
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pdcluster as pc  # noqa: E402

pc.ensure_packages(("requests", "requests"), ("zmq", "pyzmq"))
import requests  # noqa: E402
import zmq  # noqa: E402
from pdcluster import pb_decode, pb_field  # noqa: E402

MB = 1 << 20


def python_text(nbytes):
    """Python-looking source of about nbytes (what pycoder's tokenizer sees all day)."""
    parts, n, i = [], 0, 0
    while n < nbytes:
        s = f"def f{i}(x, y):\n    return x * {i} + y  # line {i}\n\n"
        parts.append(s)
        n += len(s)
        i += 1
    return "".join(parts)[:nbytes]


# ---- the ZeroMQ client API, with pdcluster's few lines of protobuf ----

def zmq_generate(rid, prompt, max_tokens=8):
    req = (pc.pb_field(1, rid) + pc.pb_field(3, prompt) +
           pc.pb_field(6, pc.pb_field(6, max_tokens)))  # sampling.max_tokens
    return pc.pb_field(1, pc.PROTOCOL_VERSION) + pc.pb_field(2, "test") + pc.pb_field(10, req)


def zmq_cancel(rid):
    return (pc.pb_field(1, pc.PROTOCOL_VERSION) + pc.pb_field(2, "test") +
            pc.pb_field(11, pc.pb_field(1, rid)))


def zmq_chunks(sock, timeout_s):
    """GenerateChunks as dicts {id, finish, code, message} until timeout_s of silence."""
    out = []
    while sock.poll(int(timeout_s * 1000)):
        env = pc.pb_decode(sock.recv())
        if 12 not in env:
            out.append({"id": None, "finish": None, "code": None, "message": repr(env)})
            continue
        ch = pc.pb_decode(env[12][0])
        err = pc.pb_decode(ch[10][0]) if 10 in ch else {}
        out.append({"id": ch.get(1, [b""])[0].decode(), "finish": ch.get(6, [0])[0],
                    "code": err.get(1, [0])[0], "message": err.get(2, [b""])[0].decode()})
        if out[-1]["finish"] or out[-1]["code"]:
            timeout_s = min(timeout_s, 0.5)  # the answer is in: drain what follows briefly
    return out


def sse_stream(url, body, gaps, ends):
    """One streamed completion: appends the gaps between its events, and whether it ended."""
    t_last = time.time()
    done = False
    with requests.post(url, json=body, stream=True, timeout=60) as r:
        for line in r.iter_lines():
            if not line:
                continue
            now = time.time()
            gaps.append(now - t_last)
            t_last = now
            if line == b"data: [DONE]":
                done = True
    ends.append(done)


def main():
    a = pc.args()
    ck = pc.Checks()
    slow = pc.sanitized(a.build)
    c = pc.Cluster(a.build, router_args=["--max-body-mb", "12", "--max-prompt-mb", "6"])
    c.up(1, 1)
    url = c.url
    zctx = zmq.Context()

    def zsock():
        s = c.zmq_curve(zctx.socket(zmq.DEALER))
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{c.client_port}")
        return s

    # an ordinary request first: everything is warm
    r = requests.post(url + "/v1/completions", timeout=60,
                      json={"prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0})
    ck.eq(r.status_code, 200, "a small completion before the big prompts")

    big = python_text(5 * MB)
    zbig = python_text(3 * MB + MB // 2)
    stop = threading.Event()
    gaps, ends, health, small, errors = [], [], [], [], []

    def streams():
        body = {"prompt": "def add(a, b):", "max_tokens": 200, "stream": True,
                "temperature": 0, "ignore_eos": True}
        while not stop.is_set():
            try:
                sse_stream(url + "/v1/completions", body, gaps, ends)
            except requests.RequestException as e:
                errors.append(f"stream: {e}")

    def probes():
        while not stop.is_set():
            t0 = time.time()
            try:
                ok = requests.get(url + "/health", timeout=30).status_code == 200
            except requests.RequestException:
                ok = False
            health.append((ok, time.time() - t0))
            time.sleep(0.05)

    def smalls():
        while not stop.is_set():
            t0 = time.time()
            try:
                r = requests.post(url + "/v1/completions", timeout=60,
                                  json={"prompt": "import os", "max_tokens": 4})
                ok = r.status_code == 200
            except requests.RequestException:
                ok = False
            small.append((ok, time.time() - t0))
            time.sleep(0.05)

    results = {}

    def big_http(name, path, body):
        t0 = time.time()
        try:
            r = requests.post(url + path, json=body, timeout=300)
            results[name] = (r.status_code, r.text[:400], time.time() - t0)
        except requests.RequestException as e:
            results[name] = (0, str(e), time.time() - t0)

    def big_zmq():
        s = zsock()
        t0 = time.time()
        s.send(zmq_generate("zbig", zbig))
        got = zmq_chunks(s, 120)
        results["zmq"] = (got, time.time() - t0)
        s.close()

    bg = [threading.Thread(target=f, daemon=True) for f in (streams, probes, smalls)]
    for t in bg:
        t.start()
    time.sleep(1.0)  # streams flowing, probes answered: the baseline of this run
    n_gaps0, n_health0, n_small0 = len(gaps), len(health), len(small)
    t_big = time.time()
    work = [threading.Thread(target=big_http, args=(
                "completion1", "/v1/completions", {"prompt": big, "max_tokens": 4})),
            threading.Thread(target=big_http, args=(
                "completion2", "/v1/completions", {"prompt": big + "x", "max_tokens": 4})),
            threading.Thread(target=big_http, args=(
                "chat", "/v1/chat/completions",
                {"messages": [{"role": "user", "content": big}], "max_tokens": 4})),
            threading.Thread(target=big_zmq)]
    for t in work:
        t.start()
    time.sleep(0.3)  # the pool is busy now: a prompt over the limit must not wait for it
    over_body = json.dumps({"prompt": python_text(7 * MB), "max_tokens": 4})
    t0 = time.time()
    over = requests.post(url + "/v1/completions", timeout=60, data=over_body,
                         headers={"Content-Type": "application/json"})
    over_dt = time.time() - t0
    for t in work:
        t.join(300)
    t_done = time.time()
    time.sleep(0.3)
    stop.set()
    for t in bg:
        t.join(120)
    print(f"  big prompts answered within {t_done - t_big:.2f} s")
    for k, v in results.items():
        print(f"  {k}: {v[1:] if k != 'zmq' else v}"[:300])

    for name in ("completion1", "completion2", "chat"):
        st, text, _ = results.get(name, (0, "", 0))
        ck.ok(st == 400 and "context_length_exceeded" in text and "in the prompt" in text,
              f"{name}: the 5 MB prompt was tokenized (400 context_length_exceeded)")
    zgot = results.get("zmq", ([], 0))[0]
    ck.ok(any(ch["id"] == "zbig" and ch["code"] == 2 for ch in zgot),  # CONTEXT_TOO_LONG
          f"ZeroMQ: the 3.5 MB prompt was tokenized (CONTEXT_TOO_LONG) {zgot[:2]}")
    hl = [d for _, d in health[n_health0:]]
    sg = gaps[n_gaps0:]
    sm = [d for _, d in small[n_small0:]]
    print(f"  during the big prompts: {len(hl)} /health probes, max {max(hl or [0]):.3f} s; "
          f"{len(sg)} stream events, longest gap {max(sg or [0]):.3f} s; {len(sm)} small "
          f"completions, max {max(sm or [0]):.3f} s")
    ck.ok(len(hl) >= 5 and all(ok for ok, _ in health) and max(hl) < 0.5,
          "/health answered within 0.5 s while the big prompts were tokenized")
    gap_bound = 1.0 if slow else 0.5
    ck.ok(len(sg) >= 20 and max(sg) < gap_bound,
          f"the streams kept flowing (no gap of {gap_bound:g} s between events)")
    ck.ok(len(ends) >= 1 and all(ends), f"every stream ended with [DONE] ({len(ends)})")
    small_bound = 3.0 if slow else 1.0
    ck.ok(len(sm) >= 2 and all(ok for ok, _ in small) and max(sm) < small_bound,
          f"small completions answered within {small_bound:g} s meanwhile")
    ck.eq(errors, [], "no client error")
    ck.ok(over.status_code == 400 and "--max-prompt-mb" in over.text and
          "string_above_max_length" in over.text and over_dt < 0.5,
          f"a 7 MB prompt is refused within 0.5 s naming the limit ({over_dt:.3f} s: "
          f"{over.text[:200]})")

    r = requests.post(url + "/v1/completions", timeout=60,
                      data=json.dumps({"prompt": python_text(13 * MB)}),
                      headers={"Content-Type": "application/json"})
    ck.ok(r.status_code == 413 and str(12 * MB) in r.text,
          f"a 13 MB body gets 413 naming the body limit ({r.text[:200]})")

    # clients that leave while their prompt is in the pool
    data = json.dumps({"prompt": big, "max_tokens": 4}).encode()
    for i in range(3):
        s = socket.create_connection(("127.0.0.1", c.port), timeout=30)
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  f"\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        time.sleep(0.05 * i)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    zs = zsock()
    # the cancel right behind the request on the same socket: the router reads them in order,
    # so it arrives while the 3.5 MB prompt is queued or being tokenized (which takes far
    # longer than reading the next message), never after its result (a sleep here made that a
    # race on a busy machine)
    zs.send(zmq_generate("zcancel", zbig))
    zs.send(zmq_cancel("zcancel"))
    got = zmq_chunks(zs, 10 if not slow else 60)
    print(f"  ZeroMQ cancel while tokenizing: {got}")

    end = time.time() + (60 if slow else 20)
    vals = {}
    while time.time() < end:
        m = requests.get(url + "/metrics", timeout=10).text
        vals = {k: pc.metric(m, k) for k in ("pd_router_requests_live",
                                             "pd_router_requests_tokenizing")}
        if vals["pd_router_requests_live"] == 0 and vals["pd_router_requests_tokenizing"] == 0:
            break
        time.sleep(0.2)
    got += zmq_chunks(zs, 0.2)  # the cancelled prompt's tokens came back: still nothing
    zs.close()
    ck.ok(len(got) == 1 and got[0]["id"] == "zcancel" and got[0]["finish"] == 3,
          "ZeroMQ: a cancel while the prompt is tokenized gets one ABORT chunk, nothing more")
    ck.eq(vals.get("pd_router_requests_live"), 0.0, "the router freed every request")
    ck.eq(vals.get("pd_router_requests_tokenizing"), 0.0, "nothing is left in the worker pool")
    r = requests.post(url + "/v1/completions", timeout=60,
                      json={"prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0})
    ck.eq(r.status_code, 200, "a small completion afterwards")
    zctx.term()
    ck.ok(c.procs["router"].alive(), "the router is still running")
    ck.eq(c.down(), [], "no sanitizer report in any log")
    return ck.done()


if __name__ == "__main__":
    sys.exit(main())
