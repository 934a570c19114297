#!/usr/bin/env python3
"""The CPU image and the compose cluster, built and run for real (label docker).

  1. A Docker daemon: the running one, else `dockerd` started here (root). Exits 77 (skipped)
     only where none can start.
  2. Base images without a registry: when `debian:bookworm` is not there, a minbase bookworm made
     by debootstrap from Debian's packages is imported as debian:bookworm and
     debian:bookworm-slim.
  3. deploy/Dockerfile built with the classic builder (DOCKER_BUILDKIT=0: no `# syntax` line to
     pull, no heredocs), tagged pdserve:cpu.
  4. deploy/docker-compose.yml up with an override written here: host networking and every port
     bound on 127.0.0.1 (high ports of the test's own), the secrets a `pdctl keys generate` of the
     test's own (readable by the image's user, uid 10001).
  5. Chat completions through the router's OpenAI API answer (200, text).
  6. pd-decode in the decode container killed (SIGKILL from the host): the container exits,
     Docker restarts it (restart: unless-stopped), requests sent meanwhile finish once it has
     registered again, and its restart count went up.
  7. `docker-compose down`: no container of the project is left."""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_pdctl_common import http  # noqa: E402

SKIP = 77
PROJECT = "pdtest"
PORTS = {"http": 18180, "cluster": 18560, "client": 18561, "kv": 18570, "pm": 18191, "dm": 18192}


def sh(cmd, timeout=600, check=True, env=None, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, **kw)
    if check and r.returncode != 0:
        raise RuntimeError("%s: exit %d\n%s\n%s" % (" ".join(cmd), r.returncode, r.stdout[-2000:],
                                                    r.stderr[-3000:]))
    return r


def docker_ok():
    try:
        return sh(["docker", "info"], timeout=30, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def ensure_daemon():
    if not shutil.which("docker"):
        return False
    if docker_ok():
        return True
    if os.geteuid() != 0 or not shutil.which("dockerd"):
        return False
    log = open(os.path.join(tempfile.gettempdir(), "pd-test-dockerd.log"), "ab")
    subprocess.Popen(["dockerd"], stdout=log, stderr=log, start_new_session=True)
    for _ in range(60):
        time.sleep(0.5)
        if docker_ok():
            return True
    return False


def ensure_base_images():
    if sh(["docker", "image", "inspect", "debian:bookworm"], check=False).returncode == 0:
        if sh(["docker", "image", "inspect", "debian:bookworm-slim"], check=False).returncode != 0:
            sh(["docker", "tag", "debian:bookworm", "debian:bookworm-slim"])
        return
    with tempfile.TemporaryDirectory(prefix="pd-rootfs-") as root:
        sh(["debootstrap", "--variant=minbase", "bookworm", root, "http://deb.debian.org/debian"],
           timeout=900)
        tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
        sh(["docker", "import", "-", "debian:bookworm"], stdin=tar.stdout, timeout=600)
        tar.wait()
    sh(["docker", "tag", "debian:bookworm", "debian:bookworm-slim"])


def override(secrets):
    p = PORTS
    node = {"network_mode": "host", "ports": []}

    def env(d):
        return {k: str(v) for k, v in d.items()}
    common = {"PD_ROUTER": "tcp://127.0.0.1:%d" % p["cluster"], "PD_BIND": "127.0.0.1",
              "PD_ADVERTISE_HOST": "127.0.0.1", "PD_THREADS": "1"}
    health = lambda port: {"test": ["CMD", "curl", "-fsS", "-o", "/dev/null",  # noqa: E731
                                    "http://127.0.0.1:%d/health" % port]}
    doc = {
        "secrets": {name: {"file": os.path.join(secrets, f)} for name, f in (
            ("router_key", "router.key"), ("router_pub", "router.pub"),
            ("nodes_allow", "nodes.allow"), ("prefill_key", "node-0.key"),
            ("decode_key", "node-1.key"))},
        "services": {
            "router": dict(node, environment=env({
                "PD_HOST": "127.0.0.1", "PD_PORT": p["http"], "PD_BIND": "127.0.0.1",
                "PD_CLUSTER_PORT": p["cluster"], "PD_CLIENT_PORT": p["client"]}),
                healthcheck={"test": ["CMD", "curl", "-fsS", "-o", "/dev/null",
                                      "http://127.0.0.1:%d/health" % p["http"]]}),
            "prefill": dict(node, environment=env(dict(common, PD_METRICS_PORT=p["pm"]))),
            "decode": dict(node, environment=env(dict(common, PD_METRICS_PORT=p["dm"],
                                                      PD_KV_PORT=p["kv"]))),
        },
    }
    doc["services"]["prefill"]["healthcheck"] = health(p["pm"])
    doc["services"]["decode"]["healthcheck"] = health(p["dm"])
    return doc


def chat(i):
    st, raw = http("http://127.0.0.1:%d/v1/chat/completions" % PORTS["http"],
                   {"messages": [{"role": "user", "content": "def add%d(a, b):" % i}],
                    "max_tokens": 16, "temperature": 0}, timeout=120)
    if st != 200:
        return None, "%s %s" % (st, raw[:300])
    return json.loads(raw)["choices"][0]["message"]["content"], None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", required=True)
    ap.add_argument("--pdctl", required=True)
    a = ap.parse_args()
    if not ensure_daemon():
        print("skip: no Docker daemon can start here")
        return SKIP
    failures = []

    def check(cond, what):
        print(("  ok   " if cond else "  FAIL ") + what, flush=True)
        if not cond:
            failures.append(what)

    t0 = time.monotonic()
    ensure_base_images()
    env = dict(os.environ, DOCKER_BUILDKIT="0")
    b = sh(["docker", "build", "-f", "deploy/Dockerfile", "-t", "pdserve:cpu", "."], cwd=a.repo,
           env=env, timeout=2400, check=False)
    check(b.returncode == 0, "deploy/Dockerfile builds with the classic builder (%.0f s)%s" %
          (time.monotonic() - t0, "" if b.returncode == 0 else ":\n" + b.stdout[-3000:] +
           b.stderr[-2000:]))
    if b.returncode != 0:
        return 1
    compose = ["docker-compose", "-p", PROJECT, "-f", os.path.join(a.repo, "deploy",
                                                                  "docker-compose.yml")]
    with tempfile.TemporaryDirectory(prefix="pd-compose-") as d:
        secrets = os.path.join(d, "secrets")
        sh([a.pdctl, "keys", "generate", "--out", secrets, "--nodes", "2"])
        for f in os.listdir(secrets):  # the image's user reads them (compose mounts them as is)
            os.chown(os.path.join(secrets, f), 10001, 10001)
        os.chown(secrets, 10001, 10001)
        ov = os.path.join(d, "override.yml")
        with open(ov, "w") as f:
            json.dump(override(secrets), f, indent=1)  # (JSON is YAML)
        compose += ["-f", ov]
        try:
            up = sh(compose + ["up", "-d", "--no-build"], timeout=300, check=False)
            check(up.returncode == 0, "compose up" + ("" if up.returncode == 0 else
                                                      ": " + up.stderr[-2000:]))
            healthy = False
            for _ in range(240):
                st, _ = http("http://127.0.0.1:%d/health" % PORTS["http"], timeout=5)
                if st == 200:
                    healthy = True
                    break
                time.sleep(0.5)
            check(healthy, "the router is healthy (a prefill and a decode node registered)")
            texts = [chat(i) for i in range(3)]
            check(all(t and not err for t, err in texts),
                  "chat completions answer: %s" % [t or err for t, err in texts])
            cid = sh(compose + ["ps", "-q", "decode"]).stdout.strip()
            restarts0 = int(sh(["docker", "inspect", "-f", "{{.RestartCount}}", cid]).stdout)
            top = sh(["docker", "top", cid, "-eo", "pid,comm"]).stdout.splitlines()
            pids = [int(l.split()[0]) for l in top[1:] if "pd-decode" in l]
            check(len(pids) == 1, "pd-decode runs in the decode container (%s)" % pids)
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            t_kill = time.monotonic()
            texts = [chat(10 + i) for i in range(2)]  # wait in the router for the node
            check(all(t and not err for t, err in texts),
                  "requests sent after the kill finish (%.1f s): %s" %
                  (time.monotonic() - t_kill, [t or err for t, err in texts]))
            restarts1 = int(sh(["docker", "inspect", "-f", "{{.RestartCount}}", cid]).stdout)
            check(restarts1 == restarts0 + 1, "Docker restarted the decode container (restart "
                  "count %d -> %d)" % (restarts0, restarts1))
        finally:
            if failures:
                logs = sh(compose + ["logs", "--no-color", "--tail", "30"], check=False)
                print(logs.stdout[-6000:])
            down = sh(compose + ["down", "-t", "5"], timeout=300, check=False)
            left = sh(["docker", "ps", "-aq", "--filter", "label=com.docker.compose.project=%s" %
                       PROJECT], check=False).stdout.split()
            check(down.returncode == 0 and not left, "compose down leaves no container (%s)" %
                  left)
    print("test_deploy_docker: %s" % ("all checks passed" if not failures else
                                       "%d checks failed" % len(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
