#!/usr/bin/env python3
"""pdctl cluster up / status / down: real processes start and stop, pid and log files, health,
a refused second start, a startup failure that reports the log and leaves nothing behind, bad
device flags refused up front."""
import json
import os
import time

from test_pdctl_common import Cluster, alive, http, main, procs_in, run


def scenario(args):
    with Cluster(args, prefill=1, decode=1) as c:
        p = c.up()
        assert "cluster up" in p.stdout, p.stdout
        info = c.info
        procs = info["processes"]
        names = sorted(x["name"] for x in procs)
        assert names == ["decode-0", "prefill-0", "router"], names
        binaries = {"router": "pd-router", "prefill": "pd-prefill", "decode": "pd-decode"}
        for x in procs:
            pid_file = os.path.join(c.run_dir, x["name"] + ".pid")
            log = os.path.join(c.run_dir, x["name"] + ".log")
            with open(pid_file) as f:
                assert int(f.read()) == x["pid"], (pid_file, x)
            assert os.path.exists(log), log
            assert alive(x["pid"]), x
            with open("/proc/%d/cmdline" % x["pid"], "rb") as f:
                exe = f.read().split(b"\0")[0].decode()
            assert exe.endswith(binaries[x["role"]]), (exe, x)
            # a daemon: its own session, not pdctl's child any more
            assert os.getsid(x["pid"]) == x["pid"], x
        assert info["http_port"] > 0 and info["client_endpoint"].startswith("tcp://127.0.0.1:")
        st, body = http(c.url + "/health", timeout=10)
        assert st == 200, (st, body)
        h = json.loads(body)
        assert h["prefill_nodes"] == 1 and h["decode_nodes"] == 1, h

        # status: healthy, exit 0, JSON agrees with cluster.json
        s = run(args, ["cluster", "status", "--run-dir", c.run_dir], 30, check=0)
        assert "healthy" in s.stdout and "NOT" not in s.stdout, s.stdout
        s = run(args, ["cluster", "status", "--run-dir", c.run_dir, "--json"], 30, check=0)
        j = json.loads(s.stdout)
        assert j["healthy"] is True and all(x["alive"] for x in j["processes"]), j
        assert j["router_health"]["status"] == 200, j

        # a second `up` in the same run dir is refused and changes nothing
        again = run(args, ["cluster", "up", "--model", args.model, "--run-dir", c.run_dir,
                           "--port", "0"], 30)
        assert again.returncode != 0 and "already running" in again.stderr, again.stderr
        assert all(alive(x["pid"]) for x in procs)

        # down: every process ends, pid and ready files go, logs stay
        t0 = time.monotonic()
        d = run(args, ["cluster", "down", "--run-dir", c.run_dir], 60, check=0)
        assert "stopped" in d.stdout, d.stdout
        deadline = time.monotonic() + 5
        while any(alive(x["pid"]) for x in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(x["pid"]) for x in procs), "processes survived cluster down"
        print("cluster down took %.1f s" % (time.monotonic() - t0))
        left = sorted(os.listdir(c.run_dir))
        assert not [f for f in left if f.endswith((".pid", ".ready"))], left
        assert "cluster.json" not in left, left
        assert "router.log" in left, left
        st, _ = http(c.url + "/health", timeout=3)
        assert st == -1, st
        # status of a stopped cluster: exit 3 (nothing there)
        s = run(args, ["cluster", "status", "--run-dir", c.run_dir], 30)
        assert s.returncode == 3, (s.returncode, s.stdout, s.stderr)

    # a node that cannot start: `up` fails in bounded time, shows its log, leaves nothing
    with Cluster(args, node_flags=("--threads", "1", "--no-such-flag")) as c:
        p = c.up(check=1, timeout=150)
        assert "--no-such-flag" in p.stderr or "no-such-flag" in p.stderr, p.stderr
        assert "last lines of" in p.stderr, p.stderr
        time.sleep(0.2)
        assert procs_in(c.run_dir) == [], procs_in(c.run_dir)
        assert not [f for f in os.listdir(c.run_dir) if f.endswith(".pid")]

    # device flags: a bad device is refused before anything starts
    for bad in (["--device", "tpu"], ["--decode-device", "cuda:x"], ["--prefill-device", "cuda:0,"],
                ["--device", "cpu", "--gpu-memory-utilization", "1.5"]):
        with Cluster(args, extra=bad) as c:
            p = c.up(check=1, timeout=60)
            assert "pdctl:" in p.stderr and "starting" not in p.stderr, (bad, p.stderr)
            assert procs_in(c.run_dir) == [], procs_in(c.run_dir)


if __name__ == "__main__":
    main(scenario)
