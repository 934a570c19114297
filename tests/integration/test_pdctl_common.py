"""Shared helpers of the pdctl integration tests (test_pdctl_*.py): run pdctl with a bound,
start a cluster in a private run directory, and always clean up.

Not a test itself. Every wait has a timeout; every process a test starts is stopped in a
`finally`, first with `pdctl cluster down`, then by pid for anything whose command line still
names the test's private run directory (so only our own processes are ever signalled)."""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

SKIP = 77


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pdctl", required=True)
    ap.add_argument("--repo", required=True)
    ap.add_argument("--slow", type=float, default=1.0,
                    help="timeout multiplier (sanitizer builds are slower)")
    a = ap.parse_args()
    if not os.access(a.pdctl, os.X_OK):
        print("%s is not built" % a.pdctl)
        sys.exit(1)
    here = os.path.dirname(os.path.abspath(a.pdctl))
    for sub, name in (("router", "pd-router"), ("prefill-node", "pd-prefill"),
                      ("decode-node", "pd-decode")):
        if not os.access(os.path.join(here, "..", sub, name), os.X_OK):
            print("%s is not built next to pdctl" % name)
            sys.exit(1)
    a.model = os.path.join(a.repo, "tests", "data", "models", "pycoder-12m")
    return a


def run(args, cmd, timeout, check=None, env=None):
    """Runs pdctl with cmd (a list), returns CompletedProcess; fails the test on a timeout."""
    full = [args.pdctl] + cmd
    t0 = time.monotonic()
    try:
        p = subprocess.run(full, capture_output=True, text=True, timeout=timeout * args.slow,
                           env=env)
    except subprocess.TimeoutExpired as e:
        raise AssertionError("timed out after %.0f s: %s\nstdout: %s\nstderr: %s" %
                             (timeout * args.slow, " ".join(full), e.stdout, e.stderr))
    p.elapsed = time.monotonic() - t0
    if check is not None and p.returncode != check:
        raise AssertionError("%s: exit %d (expected %d)\nstdout: %s\nstderr: %s" %
                             (" ".join(full), p.returncode, check, p.stdout, p.stderr))
    return p


def http(url, body=None, timeout=30, headers=None):
    """(status, bytes) of one HTTP exchange; status -1 when there was no answer."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=dict(headers or {}))
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError):
        return -1, b""


def alive(pid):
    """Whether pid runs (a zombie does not)."""
    if pid <= 0:
        return False
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def procs_in(run_dir):
    """Pids of live processes whose command line mentions run_dir (our cluster's processes:
    each gets its ready-file path inside run_dir)."""
    pids = []
    me = os.getpid()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            with open("/proc/%s/cmdline" % d, "rb") as f:
                cl = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open("/proc/%s/stat" % d) as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if run_dir in cl and "pdctl" not in cl.split(" ")[0] and state not in ("Z", "X"):
            pids.append(int(d))
    return pids


class Cluster:
    """`pdctl cluster up` in a fresh run directory; use as a context manager."""

    def __init__(self, args, prefill=1, decode=1, extra=None, node_flags=("--threads", "1")):
        self.args = args
        self.tmp = tempfile.mkdtemp(prefix="pdctl-test-")
        self.run_dir = os.path.join(self.tmp, "run")
        self.prefill, self.decode = prefill, decode
        self.extra = list(extra or [])
        self.node_flags = list(node_flags)
        self.info = None

    def up(self, check=0, timeout=150):
        cmd = ["cluster", "up", "--model", self.args.model, "--prefill", str(self.prefill),
               "--decode", str(self.decode), "--port", "0", "--run-dir", self.run_dir,
               "--timeout", str(int(120 * self.args.slow))] + self.extra
        if self.node_flags:
            cmd += ["--"] + self.node_flags
        p = run(self.args, cmd, timeout, check=check)
        if p.returncode == 0:
            with open(os.path.join(self.run_dir, "cluster.json")) as f:
                self.info = json.load(f)
        return p

    @property
    def url(self):
        return "http://127.0.0.1:%d" % self.info["http_port"]

    def keys_file(self, name):
        """A file of the cluster's keys folder (router.pub, node-0.key, api-key, ...)."""
        return os.path.join(self.run_dir, "keys", name)

    def client_args(self):
        """`pdctl client` flags for this cluster's client port: its endpoint, the router's
        CURVE key (none with --insecure) and the API key file when there is one."""
        sec = self.info.get("security", {})
        a = ["--endpoint", self.info["client_endpoint"]]
        if not sec.get("insecure"):
            a += ["--server-key", os.path.join(sec["keys_dir"], "router.pub")]
        if sec.get("api_key_file"):
            a += ["--api-key-file", sec["api_key_file"]]
        return a

    def down(self):
        if os.path.isdir(self.run_dir):
            try:
                run(self.args, ["cluster", "down", "--run-dir", self.run_dir, "--timeout", "10",
                                "--quiet"], 60)
            except AssertionError as e:
                print("cleanup: %s" % e, file=sys.stderr)
        # anything still alive that carries our run dir is ours: stop it by pid
        deadline = time.monotonic() + 5
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in procs_in(self.run_dir):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            while procs_in(self.run_dir) and time.monotonic() < deadline:
                time.sleep(0.1)
            deadline = time.monotonic() + 5

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.down()
        return False


def main(fn):
    """Runs fn(args) and turns an AssertionError into exit status 1 with its message."""
    args = parse_args()
    t0 = time.monotonic()
    try:
        fn(args)
    except AssertionError as e:
        print("FAIL: %s" % e, file=sys.stderr)
        sys.exit(1)
    print("ok (%.1f s)" % (time.monotonic() - t0))
    sys.exit(0)
