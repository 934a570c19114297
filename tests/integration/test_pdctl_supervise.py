#!/usr/bin/env python3
"""pdctl cluster up supervises: real processes on 127.0.0.1 with the bundled model.

One cluster (1 prefill, 1 decode, --restart-limit 3) goes through, in order:
  - a decode node killed with SIGKILL: the supervisor starts it again; `cluster status` shows
    restart count 1 and "killed by SIGKILL"; the router counts it again; a request succeeds;
  - `cluster restart ... prefill-0`: a new prefill process, back and counted; an unknown name
    is refused;
  - the router killed with SIGKILL: it comes back on the same HTTP, cluster and client ports,
    the nodes (not restarted) register with it by themselves, a request succeeds;
  - a node started by hand from a recorded argv shows in `status` as not on record;
  - a decode node that keeps dying (its model folder gone, so every restart exits 1): the
    supervisor gives up after the limit, `status` says so and exits 1;
  - `cluster down`: the supervisor first (nothing restarted after it), then every process: none
    is left running (/proc), no cluster.json; no sanitizer report in any log.
Every wait is bounded."""
import argparse
import json
import os
import shutil
import signal
import subprocess
import time

from test_pdctl_common import Cluster, alive, http, main, procs_in, run


def ppid(pid):
    with open("/proc/%d/stat" % pid) as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def cmdline(pid):
    with open("/proc/%d/cmdline" % pid, "rb") as f:
        return f.read().split(b"\0")


def kill9(pid):
    assert pid > 0, pid  # never kill(0): that is our own process group
    os.kill(pid, signal.SIGKILL)


class Sup:
    """Reads the cluster's state the way an operator would: cluster.json and `cluster status`."""

    def __init__(self, args, c):
        self.args, self.c = args, c

    def info(self):
        with open(os.path.join(self.c.run_dir, "cluster.json")) as f:
            return json.load(f)

    def proc(self, name):
        return next(x for x in self.info()["processes"] if x["name"] == name)

    def status(self):
        s = run(self.args, ["cluster", "status", "--run-dir", self.c.run_dir, "--json"], 30)
        return s.returncode, json.loads(s.stdout)

    def status_text(self):
        return run(self.args, ["cluster", "status", "--run-dir", self.c.run_dir], 30)

    def wait(self, what, fn, timeout):
        end = time.monotonic() + timeout * self.args.slow
        last = None
        while time.monotonic() < end:
            try:
                last = fn()
            except (OSError, ValueError, StopIteration, KeyError) as e:
                last = e
            if last is True:
                return
            time.sleep(0.1)
        raise AssertionError("%s: not within %.0f s (last: %r)\n%s" %
                             (what, timeout * self.args.slow, last,
                              self.status_text().stdout))

    def back(self, name, old_pid):
        """A new process under name, running, its ready file written by it."""
        def check():
            p = self.proc(name)
            if p["pid"] in (0, old_pid) or p["state"] != "running" or not alive(p["pid"]):
                return p
            with open(os.path.join(self.c.run_dir, name + ".ready")) as f:
                return json.load(f)["pid"] == p["pid"] or "ready file of an older run"
        self.wait("%s back after pid %d" % (name, old_pid), check, 60)
        return self.proc(name)

    def healthy(self, timeout=60):
        def check():
            rc, j = self.status()
            h = j["router_health"]
            return (rc == 0 and j["healthy"] and h["prefill_nodes"] >= 1 and
                    h["decode_nodes"] >= 1) or (rc, h, [(x["name"], x["state"], x["alive"])
                                                     for x in j["processes"]])
        self.wait("cluster healthy", check, timeout)

    def completion(self):
        st, body = http(self.c.url + "/v1/completions",
                        {"prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0},
                        timeout=60 * self.args.slow)
        assert st == 200, (st, body)
        j = json.loads(body)
        assert j["usage"]["completion_tokens"] >= 1, j
        return j


def scenario(args):
    with Cluster(args) as c:
        # a private copy of the model: the last part takes it away from a node that restarts
        model = os.path.join(c.tmp, "model")
        shutil.copytree(args.model, model)
        margs = argparse.Namespace(**vars(args))
        margs.model = model
        c.args = margs
        c.extra = ["--restart-limit", "3", "--restart-window", "600"]
        p = c.up()
        assert "supervisor" in p.stdout, p.stdout
        s = Sup(args, c)
        info = s.info()
        sup = info["supervisor"]["pid"]
        assert alive(sup) and cmdline(sup)[1:4] == [b"cluster", b"supervise", b"--run-dir"], \
            cmdline(sup)
        assert info["supervisor"]["restart_limit"] == 3, info["supervisor"]
        with open(os.path.join(c.run_dir, "supervisor.pid")) as f:
            assert int(f.read()) == sup
        for x in info["processes"]:
            assert ppid(x["pid"]) == sup, (x["name"], ppid(x["pid"]), sup)
            assert x["restarts"] == 0 and x["state"] == "running" and x["last_exit"] == "", x
        ports = {k: info[k] for k in ("http_port", "cluster_port", "client_port")}
        assert all(v > 0 for v in ports.values()), ports
        # the recorded router argv binds the ports it got, not 0
        rargv = s.proc("router")["argv"]
        for flag, key in (("--port", "http_port"), ("--cluster-port", "cluster_port"),
                          ("--client-port", "client_port")):
            assert rargv[rargv.index(flag) + 1] == str(ports[key]), (flag, rargv)
        s.healthy()
        s.completion()

        # -- 1. a decode node killed: restarted, counted, shown -------------------------------
        d0 = s.proc("decode-0")["pid"]
        p0 = s.proc("prefill-0")["pid"]
        kill9(d0)
        d = s.back("decode-0", d0)
        assert d["restarts"] == 1 and d["last_exit"] == "killed by SIGKILL", d
        assert ppid(d["pid"]) == sup
        s.healthy()
        rc, j = s.status()
        x = next(x for x in j["processes"] if x["name"] == "decode-0")
        assert rc == 0 and x["restarts"] == 1 and x["last_exit"] == "killed by SIGKILL", x
        assert x["pid"] == d["pid"] and x["alive"], x
        t = s.status_text()
        line = next(l for l in t.stdout.splitlines() if l.strip().startswith("decode-0"))
        assert "running" in line and " 1 " in line and "killed by SIGKILL" in line, t.stdout
        assert t.returncode == 0, t.stdout
        s.completion()
        with open(os.path.join(c.run_dir, "decode-0.log")) as f:
            assert "restart 1 (killed by SIGKILL)" in f.read()

        # -- 2. cluster restart prefill-0 -----------------------------------------------------
        r = run(args, ["cluster", "restart", "--run-dir", c.run_dir, "prefill-0"], 150, check=0)
        assert "prefill-0 restarted" in r.stdout, r.stdout
        pr = s.proc("prefill-0")
        assert pr["pid"] != p0 and alive(pr["pid"]) and not alive(p0), (pr, p0)
        assert pr["restarts"] == 1 and "restart requested" in pr["last_exit"], pr
        with open(os.path.join(c.run_dir, "prefill-0.ready")) as f:
            assert json.load(f)["pid"] == pr["pid"]
        st, body = http(c.url + "/health", timeout=10)
        assert st == 200 and json.loads(body)["prefill_nodes"] == 1, (st, body)
        s.completion()
        bad = run(args, ["cluster", "restart", "--run-dir", c.run_dir, "decode-7"], 30)
        assert bad.returncode == 1 and "no process decode-7" in bad.stderr, bad.stderr
        assert s.proc("decode-0")["pid"] == d["pid"]  # nothing else was touched

        # -- 3. the router killed: same ports, nodes re-register by themselves ----------------
        r0 = s.proc("router")["pid"]
        nodes = {n: s.proc(n)["pid"] for n in ("prefill-0", "decode-0")}
        kill9(r0)
        rt = s.back("router", r0)
        assert rt["restarts"] == 1 and rt["last_exit"] == "killed by SIGKILL", rt
        cl = cmdline(rt["pid"])
        assert cl[cl.index(b"--cluster-port") + 1] == str(ports["cluster_port"]).encode(), cl
        assert cl[cl.index(b"--port") + 1] == str(ports["http_port"]).encode(), cl
        with open(os.path.join(c.run_dir, "router.ready")) as f:
            ready = json.load(f)
        assert ready["pid"] == rt["pid"] and ready["http_port"] == ports["http_port"], ready
        assert ready["cluster_endpoint"].endswith(":%d" % ports["cluster_port"]), ready
        assert ready["client_endpoint"].endswith(":%d" % ports["client_port"]), ready
        s.healthy()  # the fresh router counts 1 prefill and 1 decode node: they registered again
        after = s.info()
        assert {k: after[k] for k in ports} == ports, after
        for n, pid in nodes.items():
            assert s.proc(n)["pid"] == pid and alive(pid), (n, "was restarted")
        with open(os.path.join(c.run_dir, "decode-0.log")) as f:
            assert "registering again" in f.read()
        s.completion()

        # -- 4. a process started by hand from the record is seen, and stopped by down --------
        hand_argv = [a if a != "prefill-0" else "prefill-hand" for a in s.proc("prefill-0")["argv"]]
        hand = subprocess.Popen(hand_argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        def seen():
            _, j = s.status()
            return [x["pid"] for x in j["not_on_record"]] == [hand.pid] or j["not_on_record"]
        s.wait("the hand-started node shown as not on record", seen, 30)
        assert "not on record: pd-prefill pid %d" % hand.pid in s.status_text().stdout

        # -- 5. a node that keeps dying: given up after the limit -----------------------------
        os.rename(model, model + ".gone")  # every start of a node now exits 1
        d1 = s.proc("decode-0")["pid"]
        kill9(d1)
        def gave_up():
            x = s.proc("decode-0")
            return x["state"] == "failed" or (x["state"], x["last_exit"], x["restarts"])
        s.wait("the supervisor giving up on decode-0", gave_up, 60)
        x = s.proc("decode-0")
        # exits within the window: the first kill, this kill, then starts that exit 1
        assert x["pid"] == 0 and x["last_exit"] == "exit 1", x
        assert x["restarts"] == 3, x  # 1 (first kill) + 2 starts that failed; then the limit
        t = s.status_text()
        assert t.returncode == 1 and "NOT healthy" in t.stdout, t.stdout
        assert "GAVE UP" in t.stdout and "gave up on decode-0" in t.stdout, t.stdout
        rc, j = s.status()
        assert rc == 1 and j["healthy"] is False, j
        with open(os.path.join(c.run_dir, "supervisor.log")) as f:
            slog = f.read()
        assert "GIVING UP on decode-0: 4 exits within 600 s" in slog, slog
        time.sleep(1.5)  # given up means given up: nothing is started again
        assert s.proc("decode-0")["pid"] == 0 and s.proc("decode-0")["restarts"] == 3

        # -- 6. down: supervisor first, then everything ---------------------------------------
        running = procs_in(c.run_dir)
        assert hand.pid in running and len(running) == 3, running  # router, prefill-0, hand
        dn = run(args, ["cluster", "down", "--run-dir", c.run_dir], 60, check=0)
        assert "stopped" in dn.stdout and "supervisor" in dn.stdout, dn.stdout
        hand.wait(timeout=10)
        assert procs_in(c.run_dir) == [], procs_in(c.run_dir)
        assert not alive(sup), "the supervisor survived cluster down"
        left = os.listdir(c.run_dir)
        assert "cluster.json" not in left and "supervisor.pid" not in left, left
        assert not [f for f in left if f.endswith((".pid", ".ready", ".restart"))], left
        with open(os.path.join(c.run_dir, "supervisor.log")) as f:
            tail = f.read().split("stopped by SIGTERM", 1)
        assert len(tail) == 2 and "started again" not in tail[1], tail
        st, _ = http(c.url + "/health", timeout=3)
        assert st == -1, st
        bad = []
        for f in os.listdir(c.run_dir):
            with open(os.path.join(c.run_dir, f), errors="replace") as fh:
                text = fh.read()
            if ("ERROR: AddressSanitizer" in text or "ERROR: LeakSanitizer" in text or
                    "runtime error:" in text):
                bad.append(f)
                print("--- sanitizer report in %s ---\n%s" % (f, text[-4000:]))
        assert not bad, bad


if __name__ == "__main__":
    main(scenario)
