#!/usr/bin/env python3
"""A dead device under `pdctl cluster up`: the cluster is back at full strength by itself.

`pdctl cluster up` (1 prefill, 2 decode nodes) with --decode-args "--fail-device-after 24": each
decode node's device fails after 24 steps (the CPU backend's recorded fault; on a GPU it is a
trapping kernel), as a real device fault would. Under load both fail in turn; each logs the
failure, deregisters and exits with status 3, and the supervisor starts it again. Checks:
  - `cluster status` shows each decode node restarted (restarts >= 1) with last exit "exit 3",
    and its log says why ("the device failed");
  - the router's /health counts one prefill and two decode nodes again, within seconds;
  - requests sent while that happens either complete or end with a defined error (no hang),
    and once the cluster is whole again a request is answered;
  - `cluster down` leaves no process behind.
Every wait is bounded."""
import concurrent.futures as cf
import json
import os
import time

from test_pdctl_common import Cluster, alive, http, main, procs_in, run


def status(args, c):
    s = run(args, ["cluster", "status", "--run-dir", c.run_dir, "--json"], 30)
    return s.returncode, json.loads(s.stdout)


def complete(c, args, prompt, max_tokens):
    return http(c.url + "/v1/completions",
                {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                timeout=60 * args.slow)


def scenario(args):
    with Cluster(args, decode=2,
                 extra=["--decode-args", "--fail-device-after 24", "--restart-limit", "10",
                        "--restart-window", "600"]) as c:
        c.up()
        # load: enough decode steps on both nodes for both devices to fail
        prompts = ["def f%d(x):" % i for i in range(24)]
        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(8) as ex:
            codes = list(ex.map(lambda p: complete(c, args, p, 16)[0], prompts))
        took = time.monotonic() - t0
        print("  load: %d requests in %.1f s, statuses %s" % (len(codes), took, sorted(codes)))
        assert all(code in (200, 502, 503) for code in codes), codes
        # both decode nodes failed, exited 3 and were started again
        end = time.monotonic() + 60 * args.slow
        last = None
        while time.monotonic() < end:
            rc, j = status(args, c)
            dec = [x for x in j["processes"] if x["role"] == "decode"]
            h = j.get("router_health") or {}
            last = (rc, [(x["name"], x["restarts"], x["last_exit"], x["state"]) for x in dec], h)
            if (rc == 0 and all(x["restarts"] >= 1 and x["last_exit"] == "exit 3" and
                                x["state"] == "running" and alive(x["pid"]) for x in dec) and
                    h.get("decode_nodes") == 2 and h.get("prefill_nodes") == 1):
                break
            # decode work until each node's device has failed once (the restarted ones fail
            # again after 24 more steps: none is sent once every node has restarted)
            if not all(x["restarts"] >= 1 for x in dec):
                complete(c, args, "def g(y):", 8)
            time.sleep(0.2)
        else:
            raise AssertionError("the cluster did not come back whole: %r" % (last,))
        print("  back at full strength: %r" % (last,))
        for n in ("decode-0", "decode-1"):
            with open(os.path.join(c.run_dir, n + ".log")) as f:
                log = f.read()
            assert "the device failed" in log and "leaving the cluster" in log, n
        st, body = complete(c, args, "def add(a, b):", 4)
        assert st == 200, (st, body)
        run_dir = c.run_dir
    left = procs_in(run_dir)
    assert not left, "processes left after down: %s" % left


if __name__ == "__main__":
    main(scenario)
