#!/usr/bin/env python3
"""A default `pdctl cluster up` cluster (1 prefill, 1 decode, an API key given in pdctl's
environment) against a stranger on the same host:

  - run folder: the keys folder is 0700, every secret file (keys/*.key, keys/api-key) 0600;
    no other file of the run folder (cluster.json, logs, ready and pid files) holds the API key
    or a secret key, before and after `cluster down` (which removes the keys);
  - no process of the cluster (router, nodes, supervisor) has the API key or a secret key in
    `ps -o args`, nor PD_API_KEY in its environment;
  - strangers cannot join or displace a member, each attempt refused and logged by the router:
    pd-decode started by hand with --insecure (no keys) under the id decode-0 and under a new
    id; pd-prefill with keys of its own (and the router's public key, which is public) under
    the id prefill-0 and a new id; a process holding a member's key (prefill-0's) under the id
    decode-0 (the id is bound to decode-0's key). Meanwhile /cluster/nodes lists exactly the two
    members, requests are answered and counted by the real decode-0;
  - a stranger cannot reach the decode KV port: a CURVE client with its own key and a plain
    client both fail the handshake (the decode node logs both), so a KvTransferHeader with a
    guessed reservation gets no answer and the node counts no KV error;
  - the client port: covered by test_pdctl_client (refused without the key, answered with it);
  - a standalone pd-router or pd-decode without keys and without --insecure refuses to start;
  - `cluster up --insecure` runs and warns (pdctl, router and node logs), its processes carry
    --insecure, and even there a KvTransferHeader with a guessed reservation is refused (the
    128-bit reservation token): "no such reservation".
Every wait is bounded; every process the test starts is stopped."""
import json
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pdcluster as pc  # noqa: E402
from test_pdctl_common import Cluster, http, main, run  # noqa: E402

pc.ensure_packages(("zmq", "pyzmq"))
import zmq  # noqa: E402

API_KEY = "sk-security-test-0123456789abcdef"
STRANGER_WAIT = 6.0  # seconds a stranger gets to try (nodes retry every 1 s, ZeroMQ backs off)


def secrets_of(keys_dir):
    """The secret-key texts of every keypair file (Z85)."""
    out = []
    for f in os.listdir(keys_dir):
        if f.endswith(".key"):
            with open(os.path.join(keys_dir, f)) as fh:
                m = re.search(r'secret-key\s*=\s*"([^"]{40})"', fh.read())
            assert m, f
            out.append(m.group(1))
    return out


def check_run_folder(c, secrets):
    keys = os.path.join(c.run_dir, "keys")
    assert stat.S_IMODE(os.stat(keys).st_mode) == 0o700, oct(os.stat(keys).st_mode)
    for f in os.listdir(keys):
        mode = stat.S_IMODE(os.stat(os.path.join(keys, f)).st_mode)
        if f.endswith(".key") or f == "api-key":
            assert mode == 0o600, (f, oct(mode))
    leaks = scan_for(c.run_dir, [API_KEY] + secrets, skip=keys)
    assert not leaks, "secrets in the run folder: %s" % leaks


def scan_for(top, needles, skip=None):
    """(file, what) for every file under top (but skip) that contains one of needles."""
    hits = []
    for d, _, files in os.walk(top):
        if skip and os.path.commonpath([d, skip]) == skip:
            continue
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                data = fh.read()
            for n in needles:
                if n.encode() in data:
                    hits.append((os.path.join(d, f), n[:6] + "..."))
    return hits


SANITIZER = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:")


def check_sanitizer(folder):
    """No log under folder holds a sanitizer report."""
    bad = [h for h in scan_for(folder, list(SANITIZER)) if h[0].endswith(".log")]
    assert not bad, "sanitizer reports: %s" % bad


def check_processes(c, secrets):
    pids = [p["pid"] for p in c.info["processes"]] + [c.info["supervisor"]["pid"]]
    for pid in pids:
        args = subprocess.run(["ps", "-o", "args=", "-p", str(pid)], capture_output=True,
                              text=True, timeout=10).stdout
        assert args.strip(), "process %d is gone" % pid
        for s in [API_KEY] + secrets:
            assert s not in args, "a secret in the arguments of %d: %s" % (pid, args)
        with open("/proc/%d/environ" % pid, "rb") as f:
            env = f.read()
        assert b"PD_API_KEY=" not in env and API_KEY.encode() not in env, \
            "the API key in the environment of %d" % pid
        assert b"PD_CURVE_SECRET_KEY=" not in env, "a secret key in the environment of %d" % pid


def proc_info(c, name):
    return next(p for p in c.info["processes"] if p["name"] == name)


def node_metric(c, name, series, labels=None):
    st, body = http("http://127.0.0.1:%d/metrics" % proc_info(c, name)["metrics_port"],
                    timeout=10)
    assert st == 200, st
    return pc.metric(body.decode(), series, labels) or 0.0


def nodes_listed(c):
    st, body = http(c.url + "/cluster/nodes", headers={"Authorization": "Bearer " + API_KEY},
                    timeout=10)
    assert st == 200, (st, body)
    return sorted((n["node_id"], n["state"]) for n in json.loads(body)["nodes"])


def complete(c, prompt="def add(a, b):"):
    st, body = http(c.url + "/v1/completions", {"prompt": prompt, "max_tokens": 8,
                                                "temperature": 0},
                    timeout=60, headers={"Authorization": "Bearer " + API_KEY})
    assert st == 200, (st, body)
    return json.loads(body)["choices"][0]["text"]


def log_of(c, name):
    with open(os.path.join(c.run_dir, name + ".log"), errors="replace") as f:
        return f.read()


def wait_for(what, cond, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError("timed out waiting for " + what)


class Strangers:
    """Node processes started by hand; all stopped at the end."""

    def __init__(self, args, tmp):
        here = os.path.dirname(os.path.abspath(args.pdctl))
        self.bin = {r: os.path.join(here, "..", r + "-node", "pd-" + r)
                    for r in ("prefill", "decode")}
        self.tmp, self.args, self.procs = tmp, args, []

    def start(self, role, node_id, flags):
        tag = "%s-%s-%d" % (role, node_id, len(self.procs))
        ready = os.path.join(self.tmp, tag + ".ready")
        log = open(os.path.join(self.tmp, tag + ".log"), "wb")
        argv = [self.bin[role], "--model", self.args.model, "--node-id", node_id,
                "--ready-file", ready, "--threads", "1", "--kv-cache-mb", "32"] + flags
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                             stderr=subprocess.STDOUT)
        self.procs.append((p, ready, log, tag))
        return len(self.procs) - 1

    def registered(self, i):
        return os.path.exists(self.procs[i][1])

    def alive(self, i):
        return self.procs[i][0].poll() is None

    def log(self, i):
        with open(os.path.join(self.tmp, self.procs[i][3] + ".log"), errors="replace") as f:
            return f.read()

    def stop(self):
        for p, _, log, _ in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p, _, log, _ in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
            log.close()


# The bundled model's KV geometry on a CPU node: 6 layers, 2 KV heads of 64, blocks of 16, f32.
LAYER_BYTES = 2 * 2 * 16 * 64 * 4  # (K, V) x 2 heads x 16 tokens x 64 x f32, one block


def kv_header(request_id, reservation_id, token):
    """An Envelope{KvTransferHeader} for layer 0 of block 0, valid for the bundled model's
    cache (so that on a node without CURVE it reaches the reservation check), and its payload
    frame."""
    h = (pc.pb_field(1, request_id) + pc.pb_field(2, reservation_id) + pc.pb_field(5, 0) +
         pc.pb_field(6, 1) + pc.pb_field(7, 0) + pc.pb_field(8, 2) + pc.pb_field(9, 6) +
         pc.pb_field(10, 16) + pc.pb_field(11, 64) + pc.pb_field(12, 1) +
         pc.pb_field(13, pc.pb_varint(0)) + pc.pb_field(15, pc.pb_varint(LAYER_BYTES)) +
         pc.pb_field(17, token))
    env = pc.pb_field(1, pc.PROTOCOL_VERSION) + pc.pb_field(2, "stranger") + pc.pb_field(34, h)
    return [env, b"\0" * LAYER_BYTES]


def kv_attempt(ctx, endpoint, server_key=None, wait_s=3.0):
    """Connects a DEALER to a decode KV port (CURVE with a fresh key of its own when server_key
    is given), sends a KvTransferHeader with a guessed reservation; returns (handshake events,
    replies received)."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if server_key:
        pub, sec = zmq.curve_keypair()
        s.curve_serverkey, s.curve_publickey, s.curve_secretkey = server_key.encode(), pub, sec
    mon = s.get_monitor_socket()
    s.connect(endpoint)
    s.send_multipart(kv_header("0123456789abcdef0123456789abcdef.0.0", 1, b"\0" * 16))
    events, replies = set(), []
    end = time.monotonic() + wait_s
    poller = zmq.Poller()
    poller.register(s, zmq.POLLIN)
    poller.register(mon, zmq.POLLIN)
    while time.monotonic() < end:
        for sock, _ in poller.poll(100):
            if sock is s:
                replies.append(s.recv_multipart())
            else:
                from zmq.utils.monitor import recv_monitor_message
                events.add(recv_monitor_message(mon)["event"])
    s.disable_monitor()
    mon.close()
    s.close()
    return events, replies


def public_key(path):
    with open(path) as f:
        return re.search(r'public-key\s*=\s*"([^"]{40})"', f.read()).group(1)


def scenario(args):
    tmp = tempfile.mkdtemp(prefix="pd-security-")
    strangers = Strangers(args, tmp)
    ctx = zmq.Context()
    try:
        secure(args, tmp, strangers, ctx)
        strangers.stop()
        standalone(args)
        insecure(args, ctx)
    finally:
        strangers.stop()
        ctx.term()


def secure(args, tmp, strangers, ctx):
    # the API key only in pdctl's environment: it must reach the router as a file
    env = dict(os.environ, PD_API_KEY=API_KEY)
    with Cluster(args) as c:
        p = run(args, ["cluster", "up", "--model", args.model, "--port", "0", "--run-dir",
                       c.run_dir, "--timeout", str(int(120 * args.slow)), "--", "--threads", "1"],
                150, check=0, env=env)
        with open(os.path.join(c.run_dir, "cluster.json")) as f:
            c.info = json.load(f)
        keys = c.info["security"]["keys_dir"]
        assert keys == os.path.join(c.run_dir, "keys") and not c.info["security"]["insecure"]
        secrets = secrets_of(keys)
        assert len(secrets) == 3, secrets  # router, node-0, node-1
        complete(c)
        check_run_folder(c, secrets)
        check_processes(c, secrets)
        members = [("decode-0", "alive"), ("prefill-0", "alive")]
        assert nodes_listed(c) == members, nodes_listed(c)
        served0 = node_metric(c, "decode-0", "pd_node_requests_total")

        # strangers: no keys (--insecure), keys of their own, and a member's key
        cluster = ["--router", c.info["cluster_endpoint"]]
        own = os.path.join(tmp, "stranger-keys")
        run(args, ["keys", "generate", "--out", own, "--nodes", "1"], 30, check=0)
        router_pub = os.path.join(keys, "router.pub")
        mine = ["--curve-secret-file", os.path.join(own, "node-0.key"),
                "--router-public-key", router_pub]
        tries = [
            strangers.start("decode", "decode-0", cluster + ["--insecure"]),
            strangers.start("decode", "evil-decode", cluster + ["--insecure"]),
            strangers.start("prefill", "prefill-0", cluster + mine),
            strangers.start("prefill", "evil-prefill", cluster + mine),
            # prefill-0's own key, claiming decode-0's id
            strangers.start("decode", "decode-0", cluster + [
                "--curve-secret-file", os.path.join(keys, "node-0.key"),
                "--router-public-key", router_pub,
                "--curve-allow-file", os.path.join(keys, "nodes.allow")]),
        ]
        stranger_key = public_key(os.path.join(own, "node-0.pub"))
        member_key = public_key(os.path.join(keys, "node-0.pub"))
        rlog = lambda: log_of(c, "router")  # noqa: E731
        # a peer without keys: logged from the handshake's failure, whichever side saw the
        # mechanism mismatch first ("offered no CURVE keys" / "did not complete")
        refusals = ["refused a connection to the cluster port: ",
                    "CURVE key %s): key not allowed" % stranger_key,
                    "refused node decode-0 (CURVE key %s): the id is registered with another key"
                    % member_key]
        try:
            wait_for("the router to log each kind of refusal",
                     lambda: all(x in rlog() for x in refusals), 20 * args.slow)
        except AssertionError:
            print("missing: %s\n--- router log ---\n%s" % (
                [x for x in refusals if x not in rlog()], rlog()[-3000:]))
            for i in tries:
                print("--- stranger %d ---\n%s" % (i, strangers.log(i)[-1500:]))
            raise
        t_end = time.monotonic() + STRANGER_WAIT
        texts = []
        while time.monotonic() < t_end:  # the cluster serves while the strangers keep trying
            texts.append(complete(c))
            assert nodes_listed(c) == members, nodes_listed(c)
        for i in tries:
            assert strangers.alive(i), "stranger %d exited:\n%s" % (i, strangers.log(i))
            assert not strangers.registered(i), "stranger %d registered:\n%s" % (
                i, strangers.log(i))
        assert "the id is registered with another key" in strangers.log(tries[4]), \
            strangers.log(tries[4])
        assert len(set(texts)) == 1, texts  # greedy: the real nodes answered every time
        served = node_metric(c, "decode-0", "pd_node_requests_total")
        assert served >= served0 + len(texts), (served0, served, len(texts))
        assert "removed" not in rlog(), rlog()  # no member was displaced or dropped
        strangers.stop()

        # the KV port: a stranger fails the handshake with a key of its own and without one
        d0 = proc_info(c, "decode-0")
        kv_key = public_key(os.path.join(keys, "node-1.pub"))  # decode-0 is node 1
        errs0 = node_metric(c, "decode-0", "pd_node_errors_total", {"kind": "kv_transfer"})
        ev_curve, rep_curve = kv_attempt(ctx, d0["kv_endpoint"], kv_key)
        ev_plain, rep_plain = kv_attempt(ctx, d0["kv_endpoint"])
        ok = zmq.EVENT_HANDSHAKE_SUCCEEDED
        assert ok not in ev_curve and not rep_curve, (ev_curve, rep_curve)
        assert ok not in ev_plain and not rep_plain, (ev_plain, rep_plain)
        assert ev_curve & {zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                           zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL}, ev_curve
        dlog = lambda: log_of(c, "decode-0")  # noqa: E731
        wait_for("decode-0 to log the refused KV connections", lambda: (
            "refused a connection to the KV port from 127.0.0.1" in dlog() and
            "key not allowed" in dlog() and "refused a connection to the KV port: " in dlog()),
            10 * args.slow)
        errs = node_metric(c, "decode-0", "pd_node_errors_total", {"kind": "kv_transfer"})
        assert errs == errs0, (errs0, errs)
        complete(c)  # still serving

        run_dir = c.run_dir
        check_run_folder(c, secrets)
        check_processes(c, secrets)
    # after down: the keys are gone, the logs stay and hold no secret
    assert not os.path.exists(os.path.join(run_dir, "keys")), os.listdir(run_dir)
    assert os.path.exists(os.path.join(run_dir, "router.log"))
    assert not scan_for(run_dir, [API_KEY] + secrets)
    check_sanitizer(run_dir)
    strangers.stop()
    check_sanitizer(tmp)  # the strangers' logs


def standalone(args):
    here = os.path.dirname(os.path.abspath(args.pdctl))
    for prog, argv in (("pd-router", [os.path.join(here, "..", "router", "pd-router"),
                                      "--port", "0", "--cluster-port", "0", "--client-port",
                                      "0"]),
                       ("pd-decode", [os.path.join(here, "..", "decode-node", "pd-decode")])):
        p = subprocess.run(argv + ["--model", args.model], capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 1 and "refusing to start" in p.stderr and \
            "--insecure" in p.stderr, (prog, p.returncode, p.stderr)


def insecure(args, ctx):
    with Cluster(args, extra=["--insecure"]) as c:
        p = c.up()
        assert "--insecure" in p.stderr and "warning" in p.stderr, p.stderr
        assert c.info["security"]["insecure"] is True, c.info["security"]
        assert not os.path.exists(os.path.join(c.run_dir, "keys")), os.listdir(c.run_dir)
        for x in c.info["processes"]:
            assert "--insecure" in x["argv"], x["argv"]
            assert "WARN --insecure" in log_of(c, x["name"]), x["name"]
        st, body = http(c.url + "/v1/completions", {"prompt": "x", "max_tokens": 2}, timeout=60)
        assert st == 200, (st, body)
        # no CURVE here, but a reservation still cannot be guessed: its token is 128 bits
        d0 = proc_info(c, "decode-0")
        events, replies = kv_attempt(ctx, d0["kv_endpoint"])
        assert zmq.EVENT_HANDSHAKE_SUCCEEDED in events, events
        assert replies, "no answer to a KV header on an insecure cluster"
        ack = pc.pb_decode(pc.pb_decode(replies[0][0])[36][0])  # Envelope.kv_ack
        err = pc.pb_decode(ack[4][0])
        assert 3 not in ack or not ack[3][0], ack  # ok == false
        assert b"no such reservation" in err[2][0], err
        run_dir = c.run_dir
    check_sanitizer(run_dir)


if __name__ == "__main__":
    main(scenario)
