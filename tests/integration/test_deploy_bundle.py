#!/usr/bin/env python3
"""deploy/bundle.sh: packs the built programs, their non-glibc libraries and a model into a
folder whose wrappers run without the build tree: every program starts (--help) with only the
bundle's libraries, no glibc or GPU-driver library was copied, binaries are stripped, and
pdctl in the bundle finds the cluster programs next to itself."""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

PROGS = [("router", "pd-router"), ("prefill-node", "pd-prefill"), ("decode-node", "pd-decode"),
         ("tools", "pdctl")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", required=True)
    ap.add_argument("--bin-dir", required=True)
    a = ap.parse_args()
    for sub, prog in PROGS:
        if not os.access(os.path.join(a.bin_dir, sub, prog), os.X_OK):
            print("%s/%s/%s is not built" % (a.bin_dir, sub, prog))
            sys.exit(1)
    errors = []
    tmp = tempfile.mkdtemp(prefix="pd-bundle-test-")
    try:
        out = os.path.join(tmp, "bundle")
        p = subprocess.run(["bash", os.path.join(a.repo, "deploy", "bundle.sh"), "--build-dir",
                            a.bin_dir, "--out", out, "--tar"], capture_output=True, text=True,
                           timeout=100)
        if p.returncode != 0:
            print("FAIL: bundle.sh exit %d\n%s%s" % (p.returncode, p.stdout, p.stderr),
                  file=sys.stderr)
            sys.exit(1)
        if not os.path.isfile(out + ".tar.gz"):
            errors.append("--tar wrote no archive")
        model = os.path.join(out, "models", "pycoder-12m")
        for f in ("config.json", "model.safetensors", "tokenizer.json"):
            if not os.path.isfile(os.path.join(model, f)):
                errors.append("model file %s missing" % f)
        libs = os.listdir(os.path.join(out, "lib"))
        if not any(l.startswith("libzmq") for l in libs):
            errors.append("libzmq not bundled: %s" % libs)
        for l in libs:
            if re.match(r"(libc|libm|libpthread|libdl|librt|ld-linux.*|libcuda)\.so", l):
                errors.append("a system library was bundled: %s" % l)
        # run each program from a scrubbed environment: only the bundle's libraries
        env = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": ""}
        for sub, prog in PROGS:
            real = os.path.join(out, "libexec", prog)
            sym = subprocess.run(["readelf", "-S", real], capture_output=True, text=True) \
                if shutil.which("readelf") else None
            if sym and sym.returncode == 0 and ".symtab" in sym.stdout:
                errors.append("%s is not stripped (.symtab present)" % prog)
            r = subprocess.run([os.path.join(out, "bin", prog), "--help"], capture_output=True,
                               text=True, timeout=20, env=env)
            if r.returncode != 0 or "usage" not in (r.stdout + r.stderr).lower():
                errors.append("bin/%s --help: exit %d: %s" % (prog, r.returncode, r.stderr[-300:]))
            ldd = subprocess.run(["ldd", real], capture_output=True, text=True,
                                 env=dict(env, LD_LIBRARY_PATH=os.path.join(out, "lib")))
            for line in ldd.stdout.splitlines():
                m = re.match(r"\s*(\S+) => (\S+)", line)
                if not m or m.group(2) == "not":
                    if m:
                        errors.append("%s: %s not found" % (prog, m.group(1)))
                    continue
                if not re.match(r"(libc|libm|libpthread|libdl|librt|libresolv)\.so", m.group(1)) \
                        and not m.group(2).startswith(os.path.join(out, "lib")):
                    errors.append("%s loads %s from outside the bundle (%s)" %
                                  (prog, m.group(1), m.group(2)))
        # the bundled pdctl finds the cluster programs next to itself
        r = subprocess.run([os.path.join(out, "bin", "pdctl"), "cluster", "up", "--model", model,
                            "--run-dir", os.path.join(tmp, "run"), "--port", "0", "--timeout",
                            "5", "--", "--threads", "1"], capture_output=True, text=True,
                           timeout=60, env=env)
        if "not found next to pdctl" in r.stderr or \
                not os.path.exists(os.path.join(tmp, "run", "router.log")):
            errors.append("bundled pdctl did not start the bundled pd-router: " + r.stderr)
        subprocess.run([os.path.join(out, "bin", "pdctl"), "cluster", "down", "--run-dir",
                        os.path.join(tmp, "run"), "--quiet"], capture_output=True, timeout=60,
                       env=env)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if errors:
        for e in errors:
            print("FAIL: " + e, file=sys.stderr)
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
