#!/usr/bin/env python3
"""deploy/: docker-compose.yml, the Kubernetes manifests and the Dockerfiles are checked
without Docker or a cluster: they parse, hang together (services, probes, ports, selectors),
name programs that exist and flags those programs accept (from their --help), give every
process its keys as files from secrets (compose secrets, Kubernetes Secret volumes) and no
secret in an environment value, and copy paths that exist. With --bin-dir the flag names are checked against the built binaries; the runtime
packages of the Dockerfile against the libraries the binaries load (on a Debian host)."""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys

try:
    import yaml
except ImportError:  # PyPI: pyyaml (tests/integration/requirements.txt); Debian: python3-yaml
    print("PyYAML is not installed: install tests/integration/requirements.txt (deploy/test.sh "
          "does)")
    sys.exit(1)
try:
    import kubernetes_validate
except ImportError:  # PyPI: kubernetes-validate (tests/integration/requirements.txt)
    print("kubernetes-validate is not installed: install tests/integration/requirements.txt "
          "(deploy/test.sh does)")
    sys.exit(1)

# The Kubernetes API version the manifests are validated against (the schemas bundled with the
# pinned kubernetes-validate), strictly: unknown fields are errors.
K8S_VERSION = "1.37.0"

ROLES = {"router": "pd-router", "prefill": "pd-prefill", "decode": "pd-decode"}
# What makes each process a member of an authenticated cluster: files, never values
# (docs/cluster.md, "Security").
SECURITY_FILES = {
    "router": ("PD_CURVE_SECRET_FILE", "PD_CURVE_ALLOW_FILE"),
    "prefill": ("PD_CURVE_SECRET_FILE", "PD_ROUTER_PUBLIC_KEY"),
    "decode": ("PD_CURVE_SECRET_FILE", "PD_ROUTER_PUBLIC_KEY", "PD_CURVE_ALLOW_FILE"),
}
SECRET_VALUES = ("PD_API_KEY", "PD_CURVE_SECRET_KEY")  # a secret itself: never in a manifest
errors = []


def check(cond, msg):
    if not cond:
        errors.append(msg)
    return cond


def flag_of(env):
    """PD_SOME_NAME -> --some-name (pd/opts.h)."""
    return "--" + env[3:].lower().replace("_", "-")


def help_flags(binary):
    """The --flags a binary lists in its --help (or None when it cannot be run)."""
    try:
        p = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", p.stdout + p.stderr))


def load_yaml_docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def port_of(url):
    m = re.search(r":(\d+)(/|$)", url)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------------------------------------
def check_compose(repo, flags):
    path = os.path.join(repo, "deploy", "docker-compose.yml")
    d = load_yaml_docs(path)[0]
    svcs = d.get("services", {})
    for s in ("router", "prefill", "decode"):
        check(s in svcs, "compose: no service %s" % s)
    ov = load_yaml_docs(os.path.join(repo, "deploy", "docker-compose.override.yml"))[0]
    check(set((ov.get("services") or {})) == {"router"},
          "compose override: only the router's published ports")
    override_ports = ((ov.get("services") or {}).get("router") or {}).get("ports") or []
    router_env = {k: str(v) for k, v in (svcs.get("router", {}).get("environment") or {}).items()}
    http_port = int(router_env.get("PD_PORT", "8000"))
    cluster_port = int(router_env.get("PD_CLUSTER_PORT", "5600"))
    for name, s in svcs.items():
        where = "compose service %s" % name
        cmd = s.get("command") or []
        role = cmd[0] if cmd else None
        check(role in ROLES, "%s: command %r does not start router/prefill/decode" % (where, cmd))
        b = s.get("build", {})
        if check(b and "dockerfile" in b, "%s: no build.dockerfile" % where):
            ctx = os.path.normpath(os.path.join(repo, "deploy", b.get("context", ".")))
            check(os.path.isfile(os.path.join(ctx, b["dockerfile"])),
                  "%s: %s does not exist" % (where, b["dockerfile"]))
        env = {k: str(v) for k, v in (s.get("environment") or {}).items()}
        for k in env:
            check(k.startswith("PD_"), "%s: environment %s is not a PD_* flag" % (where, k))
            if role in ROLES and flags.get(role) is not None:
                check(flag_of(k) in flags[role], "%s: %s (%s) is not a flag of %s" %
                      (where, k, flag_of(k), ROLES[role]))
        for a in cmd[1:]:
            if a.startswith("--") and role in ROLES and flags.get(role) is not None:
                check(a.split("=")[0] in flags[role], "%s: %s is not a flag of %s" %
                      (where, a, ROLES[role]))
        check(s.get("restart") in ("always", "unless-stopped"),
              "%s: restart policy %r: a process that exits must be started again (always or "
              "unless-stopped)" % (where, s.get("restart")))
        hc = s.get("healthcheck")
        if check(hc and hc.get("test"), "%s: no healthcheck" % where):
            test = " ".join(hc["test"])
            m = re.search(r"http://[^ ]+", test)
            if check(m, "%s: healthcheck is not an HTTP probe" % where):
                url = m.group(0)
                check(url.endswith("/health"), "%s: probes %s, not /health" % (where, url))
                want = http_port if role == "router" else int(env.get("PD_METRICS_PORT", "-1"))
                check(port_of(url) == want, "%s: healthcheck port %s, the process listens on %s"
                      % (where, port_of(url), want))
        if role in ("prefill", "decode"):
            check(port_of(env.get("PD_ROUTER", "")) == cluster_port and
                  "router" in env.get("PD_ROUTER", ""),
                  "%s: PD_ROUTER %r is not the router's cluster port %d" %
                  (where, env.get("PD_ROUTER"), cluster_port))
            check(env.get("PD_BIND") == "0.0.0.0", "%s: nodes must bind 0.0.0.0 in a container"
                  % where)
            exposed = [str(p) for p in s.get("expose", [])]
            if role == "decode":
                check(env.get("PD_KV_PORT") in exposed, "%s: KV port not exposed" % where)
            check(env.get("PD_METRICS_PORT") in exposed, "%s: metrics port not exposed" % where)
        if role == "router":  # (published by docker-compose.override.yml)
            published = [str(p) for p in s.get("ports", []) + override_ports]
            check(any(p.split(":")[-1] == str(http_port) for p in published),
                  "%s: HTTP port %d not published" % (where, http_port))
            check(str(cluster_port) in [str(p) for p in s.get("expose", [])] or
                  any(p.split(":")[-1] == str(cluster_port) for p in published),
                  "%s: cluster port %d not reachable by the nodes" % (where, cluster_port))
            check(router_env.get("PD_HOST") == "0.0.0.0" and router_env.get("PD_BIND") == "0.0.0.0",
                  "%s: the router must listen on 0.0.0.0 in a container" % where)
        if role in ROLES:
            check_compose_secrets(where, role, env, s, d.get("secrets") or {})
        if "gpu" in (s.get("profiles") or []):
            devs = (((s.get("deploy") or {}).get("resources") or {}).get("reservations")
                    or {}).get("devices") or []
            check(any(x.get("driver") == "nvidia" and "gpu" in x.get("capabilities", [])
                      for x in devs), "%s: gpu profile without an nvidia device reservation"
                  % where)
            check("cuda" in (s.get("build") or {}).get("dockerfile", "").lower(),
                  "%s: a GPU service must build deploy/Dockerfile.cuda" % where)
    check(any("gpu" in (s.get("profiles") or []) for s in svcs.values()),
          "compose: no gpu profile")


def check_compose_secrets(where, role, env, svc, top):
    """Keys reach the service as compose secrets (files under /run/secrets) defined from files
    in deploy/secrets/, which git ignores; no secret value and no --insecure in its
    environment."""
    for k in SECRET_VALUES + ("PD_INSECURE",):
        check(k not in env, "%s: %s in the environment (secrets come from files)" % (where, k))
    mounted = [x if isinstance(x, str) else x.get("source") for x in svc.get("secrets") or []]
    for k in SECURITY_FILES[role]:
        m = re.match(r"/run/secrets/([\w.-]+)$", env.get(k, ""))
        if not check(m, "%s: %s must name a file in /run/secrets, got %r" % (where, k,
                                                                              env.get(k))):
            continue
        name = m.group(1)
        check(name in mounted, "%s: %s names secret %s, which the service does not mount" %
              (where, k, name))
        f = (top.get(name) or {}).get("file", "")
        check(f.startswith("./secrets/"), "%s: secret %s is not a file of deploy/secrets (%r)" %
              (where, name, f))


# ---------------------------------------------------------------------------------------------
def check_k8s(repo, flags):
    base = os.path.join(repo, "deploy", "k8s")
    files = sorted(glob.glob(os.path.join(base, "**", "*.yaml"), recursive=True))
    check(files, "k8s: no manifests")
    objs = []
    for f in files:
        for d in load_yaml_docs(f):
            rel = os.path.relpath(f, repo)
            check(isinstance(d, dict) and "apiVersion" in d and "kind" in d,
                  "%s: a document without apiVersion/kind" % rel)
            if d.get("kind") != "Kustomization":  # (kustomize's own file, no API object)
                try:
                    kubernetes_validate.validate(d, K8S_VERSION, strict=True)
                except (kubernetes_validate.ValidationError,
                        kubernetes_validate.SchemaNotFoundError,
                        kubernetes_validate.InvalidSchemaError) as e:
                    check(False, "%s: %s %s does not validate against Kubernetes %s: %s" %
                          (rel, d.get("kind"), (d.get("metadata") or {}).get("name"),
                           K8S_VERSION, getattr(e, "message", e)))
            if d.get("kind") == "Kustomization":
                for r in d.get("resources", []):
                    check(os.path.exists(os.path.normpath(os.path.join(os.path.dirname(f), r))),
                          "%s: resource %s does not exist" % (rel, r))
                continue
            check(d.get("metadata", {}).get("name"), "%s: %s without metadata.name" %
                  (rel, d.get("kind")))
            objs.append((rel, d))
    deps = {d["metadata"]["name"]: (rel, d) for rel, d in objs if d["kind"] == "Deployment"}
    svcs = {d["metadata"]["name"]: (rel, d) for rel, d in objs if d["kind"] == "Service"}
    cms = {d["metadata"]["name"]: d for rel, d in objs if d["kind"] == "ConfigMap"}
    roles_seen = set()
    cluster_port = None
    for name, (rel, d) in deps.items():
        spec = d["spec"]
        tmpl = spec["template"]
        labels = tmpl["metadata"].get("labels", {})
        sel = spec["selector"]["matchLabels"]
        check(all(labels.get(k) == v for k, v in sel.items()),
              "%s: selector %s does not match the pod labels %s" % (rel, sel, labels))
        check(tmpl["spec"].get("restartPolicy") == "Always",
              "%s: restartPolicy %r: a process that exits must be started again (Always)" %
              (rel, tmpl["spec"].get("restartPolicy")))
        for c in tmpl["spec"]["containers"]:
            where = "%s container %s" % (rel, c["name"])
            args = c.get("args") or []
            role = args[0] if args else None
            if not check(role in ROLES, "%s: args %r do not start router/prefill/decode" %
                         (where, args)):
                continue
            roles_seen.add(role)
            check(c.get("image"), "%s: no image" % where)
            ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            for k in env:
                if flags.get(role) is not None:
                    check(flag_of(k) in flags[role], "%s: %s (%s) is not a flag of %s" %
                          (where, k, flag_of(k), ROLES[role]))
            for ef in c.get("envFrom", []):
                ref = ef.get("configMapRef", {}).get("name")
                check(ref in cms, "%s: envFrom ConfigMap %s does not exist" % (where, ref))
            # readiness: /health (router: nodes registered; node: registered and acknowledged).
            # liveness: /live, the process's own state whatever the others do (/health depends
            # on other processes, and restarting this one would not mend them): a node's main
            # loop came round lately; the router's event loop answers.
            # startup (nodes): /live, once the model load, which can take minutes, is done.
            want_path = {"readinessProbe": "/health", "livenessProbe": "/live",
                         "startupProbe": "/live"}
            probes = ["readinessProbe", "livenessProbe"]
            if role in ("prefill", "decode"):
                probes.append("startupProbe")
                sp = c.get("startupProbe") or {}
                check(sp.get("periodSeconds", 10) * sp.get("failureThreshold", 3) >= 300,
                      "%s: startupProbe allows under 300 s to load a model" % where)
            for probe in probes:
                p = c.get(probe)
                if not check(p and "httpGet" in p, "%s: no HTTP %s" % (where, probe)):
                    continue
                check(p["httpGet"]["path"] == want_path[probe], "%s: %s on %s, not %s" %
                      (where, probe, p["httpGet"]["path"], want_path[probe]))
                g = p["httpGet"]
                check(g["path"] in ("/health", "/metrics", "/live"), "%s: %s path %s" %
                      (where, probe, g["path"]))
                port = ports.get(g["port"]) if isinstance(g["port"], str) else g["port"]
                check(port in ports.values(), "%s: %s port %s is not a container port" %
                      (where, probe, g["port"]))
                want = env.get("PD_PORT") if role == "router" else env.get("PD_METRICS_PORT")
                check(want is not None and str(port) == str(want),
                      "%s: %s probes port %s, the process listens on %s" %
                      (where, probe, port, want))
            if role == "router":
                cluster_port = env.get("PD_CLUSTER_PORT")
                check(str(ports.get("cluster")) == str(cluster_port),
                      "%s: cluster containerPort != PD_CLUSTER_PORT" % where)
            if role == "decode":
                check(str(ports.get("kv")) == str(env.get("PD_KV_PORT")),
                      "%s: kv containerPort != PD_KV_PORT" % where)
            if role in ("prefill", "decode"):
                names = {e["name"] for e in c.get("env", [])}
                check({"PD_NODE_ID", "PD_ADVERTISE_HOST"} <= names,
                      "%s: nodes need a unique PD_NODE_ID and their PD_ADVERTISE_HOST" % where)
            check_k8s_secrets(where, role, c, tmpl["spec"])
    check(roles_seen == set(ROLES), "k8s: Deployments for %s missing" %
          sorted(set(ROLES) - roles_seen))
    # ConfigMap keys are flags of some program that reads them
    for name, cm in cms.items():
        for k in SECRET_VALUES + ("PD_INSECURE",):
            check(k not in cm.get("data", {}), "ConfigMap %s: %s (secrets come from files)" %
                  (name, k))
        for k in cm.get("data", {}):
            known = [f for f in flags.values() if f is not None]
            if len(known) == len(ROLES):  # all three programs' flags are known
                check(any(flag_of(k) in f for f in known), "ConfigMap %s: %s (%s) is no flag of "
                      "any program" % (name, k, flag_of(k)))
        rt = cm.get("data", {}).get("PD_ROUTER")
        if rt:
            m = re.match(r"tcp://([a-z0-9-]+):(\d+)$", rt)
            if check(m, "ConfigMap %s: PD_ROUTER %r is not tcp://service:port" % (name, rt)):
                svc = svcs.get(m.group(1))
                if check(svc, "ConfigMap %s: PD_ROUTER names no Service %s" % (name, m.group(1))):
                    sp = svc[1]["spec"]
                    check(any(str(p["port"]) == m.group(2) for p in sp["ports"]),
                          "Service %s has no port %s" % (m.group(1), m.group(2)))
                    check(sp.get("publishNotReadyAddresses") is True,
                          "Service %s: nodes must reach a router that is not ready yet "
                          "(publishNotReadyAddresses)" % m.group(1))
                    check(cluster_port is not None and m.group(2) == str(cluster_port),
                          "PD_ROUTER port %s != the router's PD_CLUSTER_PORT %s" %
                          (m.group(2), cluster_port))
    # every Service selects a Deployment's pods and targets ports they have
    for name, (rel, s) in svcs.items():
        sel = s["spec"].get("selector", {})
        match = [d for _, d in deps.values()
                 if all(d["spec"]["template"]["metadata"]["labels"].get(k) == v
                        for k, v in sel.items())]
        if check(match, "%s: Service %s selects no Deployment" % (rel, name)):
            cports = {}
            for c in match[0]["spec"]["template"]["spec"]["containers"]:
                for p in c.get("ports", []):
                    cports[p.get("name")] = p["containerPort"]
            for p in s["spec"]["ports"]:
                t = p.get("targetPort", p["port"])
                check(t in cports or t in cports.values(),
                      "%s: Service %s targets port %s that the pods do not have" % (rel, name, t))
    check("pdserve" in svcs, "k8s: no Service for the router's HTTP API")


def check_k8s_secrets(where, role, c, pod):
    """Keys reach the container as files of a Secret volume (items it mounts); no secret value
    (value or valueFrom) and no --insecure in its environment."""
    env = {e["name"]: e for e in c.get("env", [])}
    for k in SECRET_VALUES + ("PD_INSECURE",):
        check(k not in env, "%s: %s in the environment (secrets come from files)" % (where, k))
    vols = {v["name"]: v for v in pod.get("volumes") or []}
    mounts = c.get("volumeMounts") or []
    for k in SECURITY_FILES[role]:
        path = (env.get(k) or {}).get("value") or ""
        if not check(path.startswith("/"), "%s: %s must be a file path, got %r" % (where, k, path)):
            continue
        mount = next((m for m in mounts if path.startswith(m["mountPath"].rstrip("/") + "/")),
                     None)
        if not check(mount, "%s: %s (%s) is on no volume mount" % (where, k, path)):
            continue
        sec = (vols.get(mount["name"]) or {}).get("secret")
        if not check(sec, "%s: %s is not on a Secret volume" % (where, k)):
            continue
        rel = path[len(mount["mountPath"].rstrip("/")) + 1:]
        items = sec.get("items")
        check(not items or rel in [i["path"] for i in items],
              "%s: %s: the Secret volume has no item %s" % (where, k, rel))
        check(sec.get("defaultMode", 0o644) & 0o007 == 0,
              "%s: the Secret volume's files are readable by everyone" % where)


# ---------------------------------------------------------------------------------------------
def dockerfile_stages(text):
    stages, cur = [], None
    for line in text.splitlines():
        m = re.match(r"\s*FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.I)
        if m:
            cur = {"image": m.group(1), "name": m.group(2), "lines": []}
            stages.append(cur)
        elif cur is not None:
            cur["lines"].append(line)
    return stages


def check_dockerfiles(repo, bin_dir):
    for fname in ("Dockerfile", "Dockerfile.cuda"):
        path = os.path.join(repo, "deploy", fname)
        if not check(os.path.isfile(path), "deploy/%s missing" % fname):
            continue
        text = open(path).read()
        stages = dockerfile_stages(text)
        check(len(stages) >= 2, "%s: not a multi-stage build" % fname)
        names = {s["name"] for s in stages if s["name"]}
        for m in re.finditer(r"^\s*COPY\s+(.*)$", text, re.M):
            parts = m.group(1).split()
            if parts and parts[0].startswith("--from="):
                check(parts[0][7:] in names, "%s: COPY --from=%s: no such stage" %
                      (fname, parts[0][7:]))
                continue
            srcs = [p for p in parts[:-1] if not p.startswith("--")]
            for s in srcs:
                check(os.path.exists(os.path.join(repo, s)), "%s: COPY %s: no such path in the "
                      "repository" % (fname, s))
        # the programs the build stage copies out are the ones CMake builds, where it builds them
        for sub, prog in (("router", "pd-router"), ("prefill-node", "pd-prefill"),
                          ("decode-node", "pd-decode"), ("tools", "pdctl")):
            check("build/%s/%s" % (sub, prog) in text, "%s: does not copy build/%s/%s" %
                  (fname, sub, prog))
            cm = os.path.join(repo, sub, "CMakeLists.txt")
            check(os.path.isfile(cm) and re.search(r"add_executable\(\s*%s\b" % re.escape(prog),
                                                   open(cm).read()),
                  "%s: %s/CMakeLists.txt does not build %s" % (fname, sub, prog))
            if bin_dir and os.path.isfile(os.path.join(bin_dir, "router", "pd-router")):
                check(os.path.isfile(os.path.join(bin_dir, sub, prog)),
                      "%s: %s/%s/%s was not built there" % (fname, bin_dir, sub, prog))
        # the entrypoint is a file of the repository (no heredoc), and no `# syntax` line: the
        # classic builder takes it as BuildKit does, and nothing must be pulled to parse it
        check("COPY deploy/pd-entrypoint /usr/local/bin/pd-entrypoint" in text,
              "%s: does not copy deploy/pd-entrypoint" % fname)
        check(not re.search(r"<<-?\s*['\"]?\w+", text), "%s: a heredoc (the classic builder "
              "has none)" % fname)
        check(not re.match(r"\s*#\s*syntax\s*=", text), "%s: a # syntax line (pulls a frontend)"
              % fname)
        ep = open(os.path.join(repo, "deploy", "pd-entrypoint")).read()
        for role in ROLES:
            check(re.search(r"\b%s\|" % role, ep), "deploy/pd-entrypoint does not know %s" % role)
        check("ENTRYPOINT" in text, "%s: no ENTRYPOINT" % fname)
        if fname == "Dockerfile":
            check(stages[0]["image"].startswith("debian:bookworm") and
                  stages[-1]["image"] == "debian:bookworm-slim",
                  "Dockerfile: build on debian:bookworm, run on debian:bookworm-slim")
            check("-DPD_CUDA=OFF" in text, "Dockerfile: the CPU image builds with -DPD_CUDA=OFF")
            check_runtime_packages(stages[-1], bin_dir)
        else:
            check("-devel" in stages[0]["image"] and "-runtime" in stages[-1]["image"] and
                  stages[0]["image"].startswith("nvidia/cuda"),
                  "Dockerfile.cuda: nvidia/cuda devel -> runtime")
            check("-DPD_CUDA=ON" in text, "Dockerfile.cuda: builds with -DPD_CUDA=ON")


def check_runtime_packages(stage, bin_dir):
    """On a Debian bookworm host (the image's base), the packages that own the libraries the
    built programs link must be installed in the runtime stage."""
    if not bin_dir or not shutil.which("dpkg") or not shutil.which("readelf"):
        return
    try:
        osr = open("/etc/os-release").read()
    except OSError:
        return
    if "bookworm" not in osr:
        return
    body = " ".join(stage["lines"])
    base = {"libc6", "libgcc-s1", "libstdc++6"}  # in every Debian image
    for sub, prog in (("router", "pd-router"), ("prefill-node", "pd-prefill"),
                      ("decode-node", "pd-decode"), ("tools", "pdctl")):
        b = os.path.join(bin_dir, sub, prog)
        if not os.path.isfile(b):
            continue
        out = subprocess.run(["readelf", "-d", b], capture_output=True, text=True).stdout
        needed = re.findall(r"\(NEEDED\).*\[(.+)\]", out)
        ldd = subprocess.run(["ldd", b], capture_output=True, text=True).stdout
        for lib in needed:
            m = re.search(r"^\s*%s => (\S+)" % re.escape(lib), ldd, re.M)
            if not m:
                continue
            q = subprocess.run(["dpkg", "-S", m.group(1)], capture_output=True, text=True)
            if q.returncode != 0:
                q = subprocess.run(["dpkg", "-S", os.path.realpath(m.group(1))],
                                   capture_output=True, text=True)
            if q.returncode != 0:
                continue
            pkg = q.stdout.split(":")[0]
            if re.match(r"lib(a|t|l|ub)san\d*$", pkg):  # a sanitizer build's runtime, not shipped
                continue
            check(pkg in base or re.search(r"\b%s\b" % re.escape(pkg), body),
                  "Dockerfile: runtime stage lacks %s (%s, needed by %s)" % (pkg, lib, prog))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", required=True)
    ap.add_argument("--bin-dir", help="the build folder (checks flags against --help)")
    a = ap.parse_args()
    flags = {}
    if a.bin_dir:
        for role, sub in (("router", "router"), ("prefill", "prefill-node"),
                          ("decode", "decode-node")):
            b = os.path.join(a.bin_dir, sub, ROLES[role])
            flags[role] = help_flags(b) if os.access(b, os.X_OK) else None
            check(flags[role] is None or "--model" in flags[role],
                  "%s --help lists no --model: cannot read its flags" % b)
    missing = [r for r in ROLES if flags.get(r) is None]
    if missing:
        print("note: flag names not checked for %s (not built)" % ", ".join(missing))
    check_compose(a.repo, flags)
    try:
        ignored = open(os.path.join(a.repo, "deploy", ".gitignore")).read().split()
    except OSError:
        ignored = []
    check("secrets/" in ignored, "deploy/.gitignore must keep deploy/secrets/ (keys) out of git")
    check_k8s(a.repo, flags)
    check_dockerfiles(a.repo, a.bin_dir)
    if errors:
        for e in errors:
            print("FAIL: " + e, file=sys.stderr)
        sys.exit(1)
    print("ok: docker-compose.yml, %d k8s files, 2 Dockerfiles" %
          len(glob.glob(os.path.join(a.repo, "deploy", "k8s", "**", "*.yaml"), recursive=True)))


if __name__ == "__main__":
    main()
