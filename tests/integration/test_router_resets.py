#!/usr/bin/env python3
"""Clients that go away at every point of a response, under load: the router must survive,
keep serving everyone else, and free every request.

Sixteen client threads for a bounded time (--seconds, 60 by default), each looping over:
  - a streamed completion (max_tokens 8) read for k Server-Sent Events, then closed with a TCP
    reset (SO_LINGER 0), k walking 0..12 so that the reset lands before the first token, on
    every token, just before and just after the last token, after the finish chunk, after
    [DONE] and after the terminating chunk;
  - the same with a stop string that ends the stream early on the router, and for a streamed
    chat completion with n = 2 and usage;
  - a non-streamed request reset after a random delay;
  - a request reset before its body is complete, and one reset right after it is sent;
  - a streamed completion read to the end, which must end with [DONE] (the other clients'
    resets must not cut it).
Afterwards: the router is the same process, answers a request, holds no request
(pd_router_requests_live 0, nothing queued or running) and the nodes' KV blocks are all free;
under a sanitizer build the logs hold no report."""
import os
import random
import socket
import struct
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pdcluster as pc  # noqa: E402

pc.ensure_packages(("requests", "requests"))
import requests  # noqa: E402

import json  # noqa: E402


def connect(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def reset(s):
    """Closes with a reset instead of a FIN."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    s.close()


def request_bytes(path, body):
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    return head + data


class Reader:
    """Reads a chunked SSE response incrementally and counts its events."""

    def __init__(self, s):
        self.s = s
        self.buf = b""
        self.events = 0
        self.done = False
        self.eof = False

    def more(self):
        d = self.s.recv(65536)
        if not d:
            self.eof = True
            return False
        self.buf += d
        n = self.buf.count(b"\n\n")
        # the chunk framing never contains a blank line; each SSE event ends with one
        self.events = n
        if b"data: [DONE]" in self.buf:
            self.done = True
        return True

    def ended(self):
        return self.buf.endswith(b"\r\n0\r\n\r\n")

    def until_events(self, k):
        while self.events < k and not self.eof and not self.ended():
            if not self.more():
                break

    def until_end(self):
        while not self.ended() and not self.eof:
            if not self.more():
                break
        return self.buf


def stream_reset(port, path, body, k):
    s = connect(port)
    try:
        s.sendall(request_bytes(path, body))
        r = Reader(s)
        r.until_events(k)
        if k >= 13:
            r.until_end()
    finally:
        reset(s)


def main():
    seconds = 60.0
    if "--seconds" in sys.argv:
        i = sys.argv.index("--seconds")
        seconds = float(sys.argv[i + 1])
        del sys.argv[i:i + 2]
    a = pc.args()
    ck = pc.Checks()
    c = pc.Cluster(a.build)
    c.up(1, 1)
    router_pid = c.procs["router"].p.pid
    port = c.port
    stop_at = time.time() + seconds
    stats = {"resets": 0, "full": 0, "full_bad": 0, "errors": 0}
    bad = []
    lock = threading.Lock()

    def worker(wid):
        rnd = random.Random(wid)
        k = wid % 13
        while time.time() < stop_at:
            kind = rnd.randrange(8)
            try:
                if kind <= 2:
                    body = {"prompt": "def add(a, b):", "max_tokens": 8, "stream": True,
                            "temperature": 0}
                    if kind == 2:  # a stop string ends it early, on the router
                        body.update(temperature=1.0, seed=rnd.randrange(1 << 30),
                                    stop=["e", "\n"])
                    stream_reset(port, "/v1/completions", body, k)
                    k = (k + 1) % 14
                elif kind == 3:
                    stream_reset(port, "/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": "sort a list"}],
                                  "max_tokens": 6, "n": 2, "stream": True,
                                  "stream_options": {"include_usage": True}}, k)
                    k = (k + 1) % 14
                elif kind == 4:
                    s = connect(port)
                    s.sendall(request_bytes("/v1/completions",
                                            {"prompt": "import os", "max_tokens": 8}))
                    time.sleep(rnd.random() * 0.3)
                    reset(s)
                elif kind == 5:
                    s = connect(port)
                    data = request_bytes("/v1/completions", {"prompt": "x = 1", "max_tokens": 4})
                    s.sendall(data[:len(data) - 3])
                    time.sleep(rnd.random() * 0.05)
                    reset(s)
                elif kind == 6:
                    s = connect(port)
                    s.sendall(request_bytes("/v1/completions",
                                            {"prompt": "class A:", "max_tokens": 8,
                                             "stream": True}))
                    reset(s)
                else:
                    s = connect(port)
                    try:
                        s.sendall(request_bytes("/v1/completions",
                                                {"prompt": "for i in range(3):", "max_tokens": 8,
                                                 "stream": True, "temperature": 0}))
                        body = Reader(s).until_end()
                    finally:
                        s.close()
                    with lock:
                        stats["full"] += 1
                        if b"data: [DONE]" not in body or b'"error"' in body:
                            stats["full_bad"] += 1
                            if len(bad) < 3:
                                bad.append(body[-400:])
                    continue
                with lock:
                    stats["resets"] += 1
            except OSError as e:
                with lock:
                    stats["errors"] += 1
                    if len(bad) < 3:
                        bad.append(repr(e).encode())

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 120)
    print(f"  {stats}")
    for b in bad:
        print("  sample:", b)
    ck.ok(c.procs["router"].alive() and c.procs["router"].p.pid == router_pid,
          "the router survived the resets")
    ck.ok(stats["resets"] > 200, f"clients reset their connections ({stats['resets']})")
    ck.ok(stats["full"] > 10 and stats["full_bad"] == 0,
          f"streams read to the end all ended with [DONE] ({stats['full']} streams, "
          f"{stats['full_bad']} cut)")
    ck.eq(stats["errors"], 0, "no client saw a connection error")
    try:
        r = requests.post(c.url + "/v1/completions", timeout=60,
                          json={"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0})
        answered = r.status_code == 200 and bool(r.json()["choices"][0]["text"])
    except requests.RequestException as e:
        answered = False
        print("  after the resets:", e)
    if not ck.ok(answered, "a request after the resets is answered"):
        c.down()
        return ck.done(c)

    def settled():
        m = requests.get(c.url + "/metrics", timeout=10).text
        vals = {k: pc.metric(m, k) for k in ("pd_router_requests_live", "pd_router_queue_length",
                                             "pd_router_requests_running")}
        for name in ("p0", "d0"):
            nm = requests.get(f"http://127.0.0.1:{c.node_metrics_port(name)}/metrics",
                              timeout=10).text
            vals[name + "_free"] = pc.metric(nm, "pd_node_kv_blocks_free")
            vals[name + "_total"] = pc.metric(nm, "pd_node_kv_blocks_capacity")
        return vals

    end = time.time() + 30
    vals = settled()
    while time.time() < end:
        vals = settled()
        if (vals["pd_router_requests_live"] == 0 and vals["pd_router_queue_length"] == 0 and
                vals["pd_router_requests_running"] == 0 and
                vals["p0_free"] == vals["p0_total"] and vals["d0_free"] == vals["d0_total"]):
            break
        time.sleep(0.2)
    ck.eq(vals["pd_router_requests_live"], 0, "the router freed every request")
    ck.eq(vals["pd_router_queue_length"], 0, "nothing is queued")
    ck.eq(vals["pd_router_requests_running"], 0, "nothing is running")
    ck.eq(vals["d0_free"], vals["d0_total"], "the decode node's KV blocks are all free")
    ck.eq(vals["p0_free"], vals["p0_total"], "the prefill node's KV blocks are all free")
    bad_logs = c.down()
    ck.eq(bad_logs, [], "no sanitizer report in any log")
    return ck.done()


if __name__ == "__main__":
    sys.exit(main())
