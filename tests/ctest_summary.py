#!/usr/bin/env python3
"""Counts a ctest run's results from its JUnit file and fails when a test that may not skip did.

  tests/ctest_summary.py BUILD_DIR JUNIT_XML [NAME]

Prints one line, "NAME: P passed, F failed, S skipped (G gpu tests without a GPU)", and exits 1
when any test failed or when a test skipped that is not labelled `gpu` (only the gpu tests may
skip, and only where there is no GPU: every other test's dependencies are installed by the test
command, so a skip means something is missing)."""
import subprocess
import sys
import xml.etree.ElementTree as ET


def gpu_tests(build):
    out = subprocess.run(["ctest", "--test-dir", build, "-N", "-L", "gpu"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    names = set()
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("Test") and ":" in line:  # "Test  #12: test_cuda_ops"
            names.add(line.split(":", 1)[1].strip())
    return names


def main():
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    build, junit = sys.argv[1], sys.argv[2]
    what = sys.argv[3] if len(sys.argv) > 3 else build
    gpu = gpu_tests(build)
    passed, failed, skipped, bad_skips = [], [], [], []
    for tc in ET.parse(junit).getroot().iter("testcase"):
        name = tc.get("name")
        if tc.find("skipped") is not None or tc.get("status") in ("notrun", "disabled"):
            skipped.append(name)
            if name not in gpu:
                bad_skips.append(name)
        elif tc.find("failure") is not None or tc.get("status") == "fail":
            failed.append(name)
        else:
            passed.append(name)
    gpu_skipped = len(skipped) - len(bad_skips)
    print(f"{what}: {len(passed)} passed, {len(failed)} failed, {len(skipped)} skipped "
          f"({gpu_skipped} gpu tests without a GPU)")
    if failed:
        print(f"{what}: failed: {' '.join(failed)}")
    if bad_skips:
        print(f"{what}: skipped but not gpu tests (a dependency is missing): "
              f"{' '.join(bad_skips)}")
    return 1 if failed or bad_skips else 0


if __name__ == "__main__":
    sys.exit(main())
