#!/usr/bin/env python3
"""bench/trace_summary.py on a synthetic kernel trace whose figures are known: the most
replayed graph is picked, replays are split where a node id repeats, durations, gaps, what runs
between replays and the host's calls there (PD_TRACE_API records) come out as built."""
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "bench", "trace_summary.py")

DURS = [5000, 2000, 3000, 1000]  # ns, nodes 10..13 of graph 7
GAP = 100                         # between a replay's kernels
PERIOD = 20000                    # from one replay's start to the next
REPLAYS = 25


def line(start, dur, kind, graph, node, name, grid=1, block=32, stream=7):
    return f"{start}\t{dur}\t{kind}\t{graph}\t{node}\t{stream}\t{grid}\t{block}\t{name}\n"


def build(path):
    recs = []
    # a graph replayed less often (another batch size), before the main one
    for r in range(3):
        recs.append(line(r * 5000, 1000, "K", 9, 1, "other_kernel(int)"))
        recs.append(line(r * 5000 + 1200, 1000, "K", 9, 2, "other_kernel2(int)"))
    t0 = 100000
    for r in range(REPLAYS):
        t = t0 + r * PERIOD
        for i, d in enumerate(DURS):
            recs.append(line(t, d, "K", 7, 10 + i, f"step_kernel_{i}(float*)", grid=4 + i))
            t += d + GAP
        end = t - GAP
        recs.append(line(end + 1000, 500, "K", 0, 0, "sample_kernel(int)"))
        recs.append(line(end + 2000, 300, "C", 0, 0, "memcpyHtoD:92"))
        recs.append(line(end + 1500, 200, "R", 0, 0, "cudaStreamSynchronize_v3020"))
        recs.append(line(end + 5000, 3000, "R", 0, 0, "cudaGraphLaunch_v10000"))
    recs.sort(key=lambda s: int(s.split("\t")[0]))
    with open(path, "w") as f:
        f.writelines(recs)


def build_layers(path):
    """Replays of embed, norm, 3 layers of (a, b, c) and a head: the layer pattern is 3 kernels
    from node 2, 3 times; b's duration differs by layer (1, 2, 3 us: median 2)."""
    recs = []
    for r in range(12):
        t = r * 100000
        seq = [("embed", 1000), ("norm", 1000)]
        for l in range(3):
            seq += [("a", 4000), ("b", 1000 * (l + 1)), ("c", 6000)]
        seq.append(("head", 9000))
        for node, (name, d) in enumerate(seq):
            recs.append(line(t, d, "K", 3, 100 + node, f"{name}_kernel(int)"))
            t += d + 200
    with open(path, "w") as f:
        f.writelines(recs)


def num(pattern, text):
    m = re.search(pattern, text)
    if not m:
        raise AssertionError(f"no match for {pattern!r} in:\n{text}")
    return [float(g) for g in m.groups()]


def main():
    fails = 0

    def check(cond, what):
        nonlocal fails
        if not cond:
            fails += 1
            print("FAIL:", what)

    with tempfile.TemporaryDirectory() as d:
        tr = os.path.join(d, "t.tsv")
        build(tr)
        out = subprocess.run([sys.executable, SCRIPT, tr, "--skip", "5", "--nodes", "4"],
                             capture_output=True, text=True, check=True).stdout
    g, reps, nodes, used = num(r"graph (\d+): (\d+) replays, (\d+) nodes each; summarising (\d+)",
                               out)
    check((g, reps, nodes, used) == (7, REPLAYS, 4, REPLAYS - 5),
          f"graph/replays/nodes/summarised {g, reps, nodes, used}")
    span, busy, gaps = num(r"replay span ([\d.]+) us .*kernels busy ([\d.]+) us, gaps between "
                           r"kernels ([\d.]+) us", out)
    check(abs(span - (sum(DURS) + 3 * GAP) / 1e3) < 1e-6, f"span {span}")
    check(abs(busy - sum(DURS) / 1e3) < 1e-6, f"busy {busy}")
    check(abs(gaps - 3 * GAP / 1e3) < 1e-6, f"gaps {gaps}")
    for i, d in enumerate(DURS):
        n, tot, mean, gp = num(rf"step_kernel_{i}\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", out)
        check(n == 1 and abs(tot - d / 1e3) < 0.05 and abs(gp - (GAP / 1e3 if i else 0)) < 0.05,
              f"kernel {i}: {n, tot, mean, gp}")
    # the first nodes in order: start offsets
    starts = [float(m.group(1)) for m in re.finditer(r"^\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+\d+ x",
                                                      out, re.M)]
    want = [0.0, 5.1, 7.2, 10.3]
    check(len(starts) == 4 and all(abs(a - b) < 0.01 for a, b in zip(starts, want)),
          f"node starts {starts}")
    (between,) = num(r"between replays: ([\d.]+) us", out)
    check(abs(between - (PERIOD - sum(DURS) - 3 * GAP) / 1e3) < 1e-6, f"between {between}")
    per, medv = num(r"sample_kernel\s+([\d.]+) a step, median\s+([\d.]+) us", out)
    check(per == 1.0 and abs(medv - 0.5) < 1e-6, f"sample between replays {per, medv}")
    check("memcpyHtoD:92" in out, "the copy between replays")
    check("cudaStreamSynchronize" not in out.split("host CUDA calls")[0],
          "API records counted as GPU work")
    st, du, gp = num(r"([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+cudaGraphLaunch", out)
    check(abs(st - 5.0) < 1e-6 and abs(du - 3.0) < 1e-6 and abs(gp - 3.3) < 1e-6,
          f"graph launch call {st, du, gp}")
    check("layer pattern" not in out, "a layer pattern in a replay without one")
    with tempfile.TemporaryDirectory() as d:
        tr = os.path.join(d, "l.tsv")
        build_layers(tr)
        out2 = subprocess.run([sys.executable, SCRIPT, tr, "--skip", "2"], capture_output=True,
                              text=True, check=True).stdout
    p, k, o = num(r"layer pattern: (\d+) kernels repeated (\d+) times from node (\d+)", out2)
    check((p, k, o) == (3, 3, 2), f"layer pattern {p, k, o}")
    durs = [float(m.group(1)) for m in re.finditer(r"^\s+([\d.]+)\s+[\d.]+\s+\d+ x\s+\d+\s+[abc]_kernel",
                                                    out2.split("layer pattern")[1], re.M)]
    check(durs == [4.0, 2.0, 6.0], f"layer pattern durations {durs}")
    (per_layer,) = num(r"([\d.]+) a layer with its gaps", out2)
    check(abs(per_layer - (4.0 + 2.0 + 6.0 + 3 * 0.2)) < 1e-6, f"per layer {per_layer}")
    if fails:
        print(out)
        print(out2)
        return 1
    print("test_trace_summary: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
