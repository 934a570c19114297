#!/usr/bin/env python3
"""Thousands of idle TCP connections must not lock clients out of the router (issue 22, part 6).

The router runs with --max-connections 1000 and --max-connections-per-ip 600. The test raises
its own RLIMIT_NOFILE (the router inherits it) and opens 5,000 connections that never send a
byte (fewer if the hard limit does not allow it, but always more than the table holds), half
from 127.0.0.2 and half from 127.0.0.3 (127.0.0.1 for all of them where those addresses cannot
be bound). While they are open, from 127.0.0.1:
  - GET /health and a normal /v1/completions request are answered within a second each
    (a few seconds for the completion under a sanitizer build), several times over;
  - /metrics counts evicted connections (the table filled and its oldest idle connection made
    room) and refused ones (none: an address over its limit always had an idle one to give up),
    and the open connections never exceed the table (the busy timeout, 2 s, drains it to half
    once the burst is over);
  - a flood address never holds more than its limit (each flood address is over 600, so its
    own oldest idle connections went first).
The router stays up and reports no sanitizer error."""
import os
import resource
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pdcluster as pc  # noqa: E402

pc.ensure_packages(("requests", "requests"))
import requests  # noqa: E402

MAX_CONN = 1000
PER_IP = 600
WANT = 5000


def raise_nofile(want):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def flood_sources():
    """Two extra loopback addresses, or 127.0.0.1 when they cannot be bound."""
    out = []
    for ip in ("127.0.0.2", "127.0.0.3"):
        try:
            with socket.socket() as s:
                s.bind((ip, 0))
            out.append(ip)
        except OSError:
            pass
    return out if len(out) == 2 else ["127.0.0.1"]


def open_idle(port, n, sources):
    """n non-blocking connects that never send; the kernel completes them in the background."""
    socks = []
    for i in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind((sources[i % len(sources)], 0))
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        socks.append(s)
        if i % 200 == 199:
            time.sleep(0.02)  # let the router accept: the listen backlog holds 511
    return socks


def timed(fn):
    t0 = time.time()
    try:
        ok = fn()
    except requests.RequestException as e:
        print("   ", type(e).__name__, str(e)[:200])
        ok = False
    return ok, time.time() - t0


def main():
    a = pc.args()
    ck = pc.Checks()
    limit = raise_nofile(WANT + 400)
    n = min(WANT, limit - 400)
    if n <= MAX_CONN:
        print(f"RLIMIT_NOFILE {limit} allows only {n} connections, not more than {MAX_CONN}")
        return 1
    slow = pc.sanitized(a.build)
    c = pc.Cluster(a.build, router_args=["--max-connections", str(MAX_CONN),
                                         "--max-connections-per-ip", str(PER_IP)])
    c.up(1, 1)
    sources = flood_sources()
    print(f"  opening {n} idle connections from {sources}")
    t0 = time.time()
    socks = open_idle(c.port, n, sources)
    print(f"  opened in {time.time() - t0:.1f} s")
    time.sleep(1.0)  # the router has accepted (and evicted) what it will

    health = []
    comp = []
    body = {"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}
    for i in range(5):
        ok, dt = timed(lambda: requests.get(c.url + "/health", timeout=30).status_code == 200)
        health.append((ok, dt))
        ok, dt = timed(lambda: requests.post(c.url + "/v1/completions", json=body, timeout=30)
                       .json()["choices"][0]["text"] != "")
        comp.append((ok, dt))
        # the flood goes on: more idle connections arrive between the probes
        socks += open_idle(c.port, 100, sources)
        time.sleep(0.2)
    print(f"  /health latencies {[round(d, 3) for _, d in health]} s")
    print(f"  completion latencies {[round(d, 3) for _, d in comp]} s")
    bound = 3.0 if slow else 1.0
    ck.ok(all(ok for ok, _ in health) and max(d for _, d in health) < 1.0,
          "/health is answered within a second under the idle flood")
    ck.ok(all(ok for ok, _ in comp) and max(d for _, d in comp) < bound,
          f"a completion is answered within {bound:g} s under the idle flood")

    m = requests.get(c.url + "/metrics", timeout=10).text
    evicted = pc.metric(m, "pd_router_http_connections_evicted_total") or 0
    refused = pc.metric(m, "pd_router_http_connections_refused_total")
    open_now = pc.metric(m, "pd_router_http_connections") or 0
    print(f"  metrics: open {open_now:g}, evicted {evicted:g}, refused {refused}")
    # the first burst outruns the busy timeout (2 s): each connection past the table evicted one
    ck.ok(evicted >= n - MAX_CONN - 50,
          f"idle connections were evicted to admit new ones ({evicted:g})")
    ck.eq(refused, 0.0, "no connection was refused (each address had idle ones to give up)")
    ck.ok(open_now <= MAX_CONN, f"open connections stay within the table ({open_now:g})")
    if len(sources) == 2:
        # the newest connections of each flood address are the ones still open: count them
        alive = {ip: 0 for ip in sources}
        for s in socks:
            try:
                s.setblocking(False)
                d = s.recv(1, socket.MSG_PEEK)
                if d == b"":
                    continue  # closed by the router
            except BlockingIOError:
                pass
            except OSError:
                continue
            alive[s.getsockname()[0]] += 1
        print(f"  still open per flood address: {alive}")
        ck.ok(all(v <= PER_IP for v in alive.values()),
              f"no address holds more than --max-connections-per-ip {PER_IP}")

    for s in socks:
        s.close()
    ck.ok(c.procs["router"].alive(), "the router is still running")
    ok, dt = timed(lambda: requests.get(c.url + "/health", timeout=10).status_code == 200)
    ck.ok(ok, f"/health after the flood ({dt:.3f} s)")
    ck.eq(c.down(), [], "no sanitizer report in any log")
    return ck.done()


if __name__ == "__main__":
    sys.exit(main())
