"""Helpers for the cluster integration tests: real pd-router / pd-prefill / pd-decode processes
on 127.0.0.1 with free ports, every network call with a timeout, and every process killed at
the end whatever happens (atexit, signals, and PR_SET_PDEATHSIG so that even a SIGKILL of the
test takes its children along).

Exit codes follow ctest: 0 pass, 1 fail (a missing Python package too), 77 skip (only the gpu
tests, where there is no GPU).
"""
import argparse
import atexit
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(REPO, "tests", "data", "models", "pycoder-12m")
SKIP = 77


def ensure_packages(*mods):
    """Makes sure the modules can be imported (they are not imported here: locust, for one,
    must not share a process with code that imported ssl first). The test command installs them
    (tests/integration/requirements.txt, pinned); a missing one fails the test: a test that
    skipped for want of its client would pass with the cluster untested."""
    import importlib.util
    missing = [pkg for mod, pkg in mods if importlib.util.find_spec(mod) is None]
    if missing:
        print(f"missing Python packages {missing}: install tests/integration/requirements.txt "
              f"(deploy/test.sh does)")
        sys.exit(1)


def args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True, help="the CMake build folder")
    return ap.parse_args()


def sanitized(build):
    """Whether the build folder was configured with PD_SANITIZE (timing bounds scale up)."""
    try:
        with open(os.path.join(build, "CMakeCache.txt")) as f:
            for line in f:
                if line.startswith("PD_SANITIZE:"):
                    return bool(line.split("=", 1)[1].strip())
    except OSError:
        pass
    return False


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent():
    _libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


_all_procs = []


def _kill_all():
    for p in _all_procs:
        if p.poll() is None:
            try:
                p.kill()
            except OSError:
                pass
    for p in _all_procs:
        try:
            p.wait(timeout=5)
        except Exception:  # noqa: BLE001
            pass


atexit.register(_kill_all)


def _on_signal(sig, frame):
    _kill_all()
    sys.exit(1)


signal.signal(signal.SIGTERM, _on_signal)
signal.signal(signal.SIGINT, _on_signal)


class Proc:
    def __init__(self, name, argv, logdir):
        self.name = name
        self.argv = argv
        self.log_path = os.path.join(logdir, name + ".log")
        self.log = open(self.log_path, "wb")
        self.p = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        _all_procs.append(self.p)

    def alive(self):
        return self.p.poll() is None

    def kill(self, sig=signal.SIGKILL):
        if self.alive():
            os.kill(self.p.pid, sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            try:
                self.p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(timeout=5)

    def tail(self, n=40):
        try:
            with open(self.log_path, "rb") as f:
                lines = f.read().decode("utf-8", "replace").splitlines()
            return "\n".join(lines[-n:])
        except OSError:
            return ""


class Cluster:
    """A router and its nodes. Node processes are named p0, p1, ... and d0, d1, ...

    Authenticated like a production cluster: `pdctl keys generate` writes the keypairs into the
    cluster's folder; the router admits the listed node keys (prefill nodes share node-0.key,
    decode nodes node-1.key); decode KV ports admit the same keys; the API key (api_key) reaches
    the router in a file. secure=False runs every process with --insecure instead (a test that
    brings its own CURVE flags)."""

    def __init__(self, build, router_args=(), node_args=(), prefill_args=(), decode_args=(),
                 api_key=None, model=MODEL,
                 base_node_args=("--threads", "1", "--kv-cache-mb", "64"), node_wrap=(),
                 secure=True):
        """model: the model folder of every process; base_node_args: the nodes' resource flags
        (CPU defaults; a GPU test gives --device ...); node_wrap: a command the node binaries
        run under (e.g. compute-sanitizer)."""
        self.build = build
        self.model = model
        self.node_wrap = list(node_wrap)
        self.dir = tempfile.mkdtemp(prefix="pdcluster-")
        self.keys = os.path.join(self.dir, "keys") if secure else None
        if self.keys:
            subprocess.run([os.path.join(build, "tools", "pdctl"), "keys", "generate", "--out",
                            self.keys, "--nodes", "2"], check=True, capture_output=True,
                           timeout=60)
        self.port = free_port()
        self.cluster_port = free_port()
        self.client_port = free_port()
        self.api_key = api_key
        self.router_args = list(router_args)
        self.node_args = list(base_node_args) + list(node_args)
        self.prefill_args = list(prefill_args)
        self.decode_args = list(decode_args)
        self.procs = {}
        self.counter = {"p": 0, "d": 0}

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def key(self, name):
        """A file of the cluster's keys folder (router.key, router.pub, node-0.key, ...)."""
        return os.path.join(self.keys, name)

    def zmq_curve(self, sock):
        """Makes a pyzmq socket a CURVE client of this router's client port (a fresh keypair of
        its own); a no-op for a cluster without keys."""
        if not self.keys:
            return sock
        import re
        import zmq
        with open(self.key("router.pub")) as f:
            server = re.search(r'public-key\s*=\s*"([^"]{40})"', f.read()).group(1)
        public, secret = zmq.curve_keypair()
        sock.curve_serverkey = server.encode()
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        return sock

    def client_args(self):
        """Flags of `pdctl client` for this router's client port (its CURVE key)."""
        return ["--server-key", self.key("router.pub")] if self.keys else []

    def security_args(self, role):
        """The flags that make a process of this role a member of the cluster."""
        if not self.keys:
            return ["--insecure"]
        if role == "router":
            return ["--curve-secret-file", self.key("router.key"),
                    "--curve-allow-file", self.key("nodes.allow")]
        args = ["--curve-secret-file", self.key("node-0.key" if role == "prefill" else
                                                "node-1.key"),
                "--router-public-key", self.key("router.pub")]
        if role == "decode":
            args += ["--curve-allow-file", self.key("nodes.allow")]
        return args

    def headers(self):
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def start_router(self):
        argv = [os.path.join(self.build, "router", "pd-router"), "--model", self.model,
                "--port", str(self.port), "--cluster-port", str(self.cluster_port),
                "--client-port", str(self.client_port),
                "--ready-file", os.path.join(self.dir, "router.ready")] + self.router_args
        argv += self.security_args("router")
        if self.api_key:
            path = os.path.join(self.dir, "api-key")
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                f.write(self.api_key + "\n")
            argv += ["--api-key-file", path]
        name = "router" if "router" not in self.procs else f"router{len(self.procs)}"
        self.procs["router"] = Proc(name, argv, self.dir)
        self._wait_file(os.path.join(self.dir, "router.ready"), self.procs["router"], 20)
        return self.procs["router"]

    def start_node(self, role, extra=()):
        k = "p" if role == "prefill" else "d"
        name = f"{k}{self.counter[k]}"
        self.counter[k] += 1
        binary = os.path.join(self.build, f"{role}-node", f"pd-{role}")
        ready = os.path.join(self.dir, name + ".ready")
        argv = self.node_wrap + [binary, "--model", self.model, "--router",
                                 f"tcp://127.0.0.1:{self.cluster_port}", "--node-id", name,
                                 "--ready-file", ready] + self.security_args(role) + self.node_args
        argv += self.prefill_args if role == "prefill" else self.decode_args
        argv += list(extra)
        self.procs[name] = Proc(name, argv, self.dir)
        return name

    def wait_node_ready(self, name, timeout=60):
        self._wait_file(os.path.join(self.dir, name + ".ready"), self.procs[name], timeout)
        with open(os.path.join(self.dir, name + ".ready")) as f:
            return json.load(f)

    def _wait_file(self, path, proc, timeout):
        end = time.time() + timeout
        while time.time() < end:
            if os.path.exists(path):
                return
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited early:\n{proc.tail()}")
            time.sleep(0.05)
        raise RuntimeError(f"{proc.name} not ready after {timeout} s:\n{proc.tail()}")

    def health(self):
        import requests
        try:
            r = requests.get(self.url + "/health", timeout=5)
            return r.status_code, r.json()
        except Exception:  # noqa: BLE001
            return 0, {}

    def wait_health(self, n_prefill, n_decode, timeout=60):
        end = time.time() + timeout
        last = None
        while time.time() < end:
            code, body = self.health()
            last = (code, body)
            if (code == 200 and body.get("prefill_nodes") == n_prefill and
                    body.get("decode_nodes") == n_decode):
                return
            time.sleep(0.1)
        raise RuntimeError(f"cluster not healthy ({n_prefill}P/{n_decode}D) after {timeout} s: "
                           f"{last}\n" + self.logs())

    def up(self, n_prefill=1, n_decode=1):
        self.start_router()
        names = [self.start_node("prefill") for _ in range(n_prefill)]
        names += [self.start_node("decode") for _ in range(n_decode)]
        for n in names:
            self.wait_node_ready(n)
        self.wait_health(n_prefill, n_decode)
        return self

    def node_metrics_port(self, name):
        with open(os.path.join(self.dir, name + ".ready")) as f:
            return json.load(f)["metrics_port"]

    def logs(self, n=30):
        return "\n".join(f"--- {k} ---\n{p.tail(n)}" for k, p in self.procs.items())

    def down(self):
        """Stops every process (SIGTERM, so sanitizer builds report leaks at exit, then
        SIGKILL) and returns the names of logs holding a sanitizer report."""
        for p in self.procs.values():
            if p.alive():
                try:
                    os.kill(p.p.pid, signal.SIGCONT)  # a stopped process cannot exit
                except OSError:
                    pass
                p.kill(signal.SIGTERM)
        for p in self.procs.values():
            p.kill()
        bad = []
        for name, p in self.procs.items():
            try:
                with open(p.log_path, "rb") as f:
                    text = f.read().decode("utf-8", "replace")
            except OSError:
                continue
            if ("ERROR: AddressSanitizer" in text or "ERROR: LeakSanitizer" in text or
                    "runtime error:" in text or "ThreadSanitizer" in text):
                bad.append(name)
                print(f"--- sanitizer report in {name} ---\n{p.tail(60)}")
        for p in self.procs.values():
            p.log.close()
        if not bad and not os.environ.get("PD_KEEP_LOGS"):
            import shutil
            shutil.rmtree(self.dir, ignore_errors=True)
        return bad


def run_checks(cluster, checks, chk, name="", n_prefill=1, n_decode=1):
    """Starts cluster (n_prefill prefill and n_decode decode nodes), runs checks(cluster, chk)
    (an exception is a failed check), prints the logs when a check failed, stops the cluster
    and checks its logs for sanitizer reports."""
    label = f"{name}: " if name else ""
    try:
        cluster.up(n_prefill, n_decode)
        checks(cluster, chk)
    except Exception as e:  # noqa: BLE001
        import traceback
        traceback.print_exc()
        chk.ok(False, f"{label}exception: {e!r}")
    if chk.failures:
        print(cluster.logs())
    chk.eq(cluster.down(), [], f"{label}no sanitizer reports")


# ---- a few lines of protobuf (proto/pd.proto), for tests that speak the wire themselves ----

PROTOCOL_VERSION = 2  # Envelope.version (pd/wire.h PD_PROTOCOL_VERSION)

def pb_varint(v):
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def pb_field(num, v):
    """One field: an int as a varint, str/bytes length-delimited."""
    if isinstance(v, int):
        return pb_varint(num << 3) + pb_varint(v)
    if isinstance(v, str):
        v = v.encode()
    return pb_varint(num << 3 | 2) + pb_varint(len(v)) + v


def pb_decode(b):
    """{field number: [values]} of one message (varints as ints, the rest as bytes)."""
    out, i = {}, 0

    def rd(i):
        v, s = 0, 0
        while True:
            c = b[i]
            i += 1
            v |= (c & 0x7F) << s
            s += 7
            if not c & 0x80:
                return v, i
    while i < len(b):
        key, i = rd(i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = rd(i)
        elif wt == 2:
            n, i = rd(i)
            v, i = b[i:i + n], i + n
        elif wt == 5:
            v, i = b[i:i + 4], i + 4
        else:
            v, i = b[i:i + 8], i + 8
        out.setdefault(num, []).append(v)
    return out


def metric(text, name, labels=None):
    """Sum of the samples of a series in Prometheus text (labels: dict subset to match)."""
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, _, val = line.rpartition(" ")
        base, _, lab = key.partition("{")
        if base != name:
            continue
        if labels and not all(f'{k}="{v}"' in lab for k, v in labels.items()):
            continue
        total += float(val)
        found = True
    return total if found else None


def sse_events(response):
    """The events of a streamed OpenAI response (requests, stream=True): each `data:` line's
    JSON object, and "[DONE]" for the end marker."""
    import json as _json
    for line in response.iter_lines():
        if not line.startswith(b"data: "):
            continue
        d = line[6:]
        yield "[DONE]" if d == b"[DONE]" else _json.loads(d)


def stream_completion(url, body, on_chunk=None, timeout=60):
    """Streams a completion from the router at url; returns (text, finish_reason, error_event,
    done, seconds). on_chunk(n) is called after each chunk with choices."""
    import requests
    t0 = time.time()
    body = dict(body, stream=True)
    text, finish, err, done, n = "", None, None, False, 0
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=timeout) as r:
        if r.status_code != 200:
            return None, None, {"status": r.status_code, "body": r.text}, False, time.time() - t0
        for o in sse_events(r):
            if o == "[DONE]":
                done = True
                break
            if "error" in o:
                err = o["error"]
                continue
            for ch in o["choices"]:
                text += ch["text"]
                finish = ch.get("finish_reason") or finish
            n += 1
            if on_chunk:
                on_chunk(n)
    return text, finish, err, done, time.time() - t0


def pdctl_generate(build, prompt=None, chat=None, max_tokens=32, extra=()):
    argv = [os.path.join(build, "tools", "pdctl"), "generate", "--model", MODEL,
            "--max-tokens", str(max_tokens), "--temperature", "0", "--json", "--threads", "1"]
    argv += ["--prompt", prompt] if prompt is not None else ["--chat", chat]
    argv += list(extra)
    out = subprocess.run(argv, capture_output=True, timeout=120, check=True)
    return json.loads(out.stdout)


class Checks:
    """Collects failures instead of stopping at the first, then reports."""

    def __init__(self):
        self.failures = []
        self.n = 0

    def ok(self, cond, what):
        self.n += 1
        if cond:
            print(f"  ok   {what}")
        else:
            print(f"  FAIL {what}")
            self.failures.append(what)
        return cond

    def eq(self, a, b, what):
        good = a == b
        if not good:
            what = f"{what}: {a!r} != {b!r}"
        return self.ok(good, what)

    def done(self, cluster=None):
        if self.failures:
            print(f"{len(self.failures)} of {self.n} checks failed")
            if cluster:
                print(cluster.logs())
            return 1
        print(f"all {self.n} checks passed")
        return 0
