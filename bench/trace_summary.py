#!/usr/bin/env python3
"""Summarises a kernel timeline written by libpd-cupti-trace.so (kernels/bench/cupti_trace.c).

    python3 bench/trace_summary.py trace.tsv [--skip N] [--nodes K]

For the CUDA graph replayed most often (a decode step's graph) it prints, over its replays
after the first N (default 20):
  - the replay's span, the sum of its kernels' durations and of the gaps between them;
  - per kernel name: count per replay, median duration, median gap before it;
  - the first K nodes of the median replay in order (start, duration, gap);
  - the layers: the shortest run of kernels that repeats 3+ times, position by position;
  - what runs between replays (the host's gap, the kernels and copies outside the graph).
Times are medians over the replays, in microseconds.
"""
import argparse
import collections
import statistics


def load(path):
    recs = []
    with open(path) as f:
        for line in f:
            p = line.rstrip("\n").split("\t")
            if len(p) < 9:
                continue
            recs.append(dict(start=int(p[0]), dur=int(p[1]), kind=p[2], graph=int(p[3]),
                             node=int(p[4]), stream=int(p[5]), grid=int(p[6]),
                             block=int(p[7]), name=p[8]))
    return recs


def short(name, n=60):
    name = name.split("(")[0]
    return name if len(name) <= n else name[: n - 3] + "..."


def replays_of(recs):
    """Splits each graph's records (sorted by start) into replays: a node id seen again starts
    a new replay."""
    by_graph = collections.defaultdict(list)
    for r in recs:
        if r["graph"]:
            by_graph[r["graph"]].append(r)
    out = {}
    for g, rs in by_graph.items():
        reps, cur, seen = [], [], set()
        for r in rs:
            if r["node"] in seen:
                reps.append(cur)
                cur, seen = [], set()
            cur.append(r)
            seen.add(r["node"])
        if cur:
            reps.append(cur)
        out[g] = reps
    return out


def med(xs):
    return statistics.median(xs) if xs else 0.0


def layer_pattern(names, max_period=64):
    """The repeating run of kernels in one replay (a model's layers): (offset, period, count)
    for the shortest period whose names repeat for at least 3 periods, or None."""
    n = len(names)
    best = None
    for p in range(2, min(max_period, n // 3) + 1):
        for o in range(0, n - 3 * p + 1):
            k = 0
            while o + (k + 1) * p <= n and names[o + k * p:o + (k + 1) * p] == names[o:o + p]:
                k += 1
            if k >= 3 and (best is None or k * p > best[1] * best[2]):
                best = (o, p, k)
            if k >= 3:
                break
        if best:
            return best
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--skip", type=int, default=20)
    ap.add_argument("--nodes", type=int, default=14)
    a = ap.parse_args()
    recs = load(a.trace)
    reps = replays_of(recs)
    if not reps:
        print("no graph replays in the trace")
        return
    g = max(reps, key=lambda k: len(reps[k]))
    rs = [r for r in reps[g][a.skip:] if len(r) == len(reps[g][a.skip])] or reps[g]
    print(f"graph {g}: {len(reps[g])} replays, {len(rs[0])} nodes each; "
          f"summarising {len(rs)} (first {a.skip} skipped)")
    spans, busy, gaps = [], [], []
    for r in rs:
        spans.append((r[-1]["start"] + r[-1]["dur"] - r[0]["start"]) / 1e3)
        busy.append(sum(x["dur"] for x in r) / 1e3)
        gaps.append(sum(max(0, r[i]["start"] - (r[i - 1]["start"] + r[i - 1]["dur"]))
                        for i in range(1, len(r))) / 1e3)
    print(f"replay span {med(spans):.1f} us (min {min(spans):.1f}), kernels busy "
          f"{med(busy):.1f} us, gaps between kernels {med(gaps):.1f} us")
    # per name
    per = collections.defaultdict(lambda: [[], [], 0])
    for r in rs:
        acc = collections.defaultdict(lambda: [0, 0, 0])
        for i, x in enumerate(r):
            gap = 0 if i == 0 else max(0, x["start"] - (r[i - 1]["start"] + r[i - 1]["dur"]))
            k = short(x["name"])
            acc[k][0] += x["dur"]
            acc[k][1] += gap
            acc[k][2] += 1
        for k, (d, gp, c) in acc.items():
            per[k][0].append(d / 1e3)
            per[k][1].append(gp / 1e3)
            per[k][2] = c
    print(f"\n{'kernel':60s} {'n':>4s} {'sum us':>9s} {'mean us':>8s} {'gaps us':>8s}")
    for k, (d, gp, c) in sorted(per.items(), key=lambda kv: -med(kv[1][0])):
        print(f"{k:60s} {c:4d} {med(d):9.1f} {med(d) / c:8.2f} {med(gp):8.1f}")
    # one replay's first nodes, position by position (median over replays)
    n = min(a.nodes, len(rs[0]))
    print(f"\nfirst {n} nodes (median over replays): start, duration, gap before; grid x block")
    for i in range(n):
        st = med([(r[i]["start"] - r[0]["start"]) / 1e3 for r in rs])
        du = med([r[i]["dur"] / 1e3 for r in rs])
        gp = 0 if i == 0 else med([(r[i]["start"] - r[i - 1]["start"] - r[i - 1]["dur"]) / 1e3
                                   for r in rs])
        x = rs[0][i]
        print(f"  {st:9.2f} {du:8.2f} {gp:6.2f}  {x['grid']:6d} x {x['block']:4d}  "
              f"{short(x['name'], 70)}")
    # the layers: the repeating run of kernels, position by position (median over the run's
    # repetitions and the replays)
    pat = layer_pattern([short(x["name"], 200) for x in rs[0]])
    if pat:
        o, p, k = pat
        print(f"\nlayer pattern: {p} kernels repeated {k} times from node {o} (median over layers "
              f"and replays): duration, gap before")
        tot = 0.0
        for j in range(p):
            du = med([r[o + l * p + j]["dur"] / 1e3 for r in rs for l in range(k)])
            gp = med([(r[o + l * p + j]["start"] - r[o + l * p + j - 1]["start"]
                       - r[o + l * p + j - 1]["dur"]) / 1e3
                      for r in rs for l in range(k) if o + l * p + j > 0])
            tot += du + gp
            x = rs[0][o + j]
            print(f"  {du:8.2f} {gp:6.2f}  {x['grid']:6d} x {x['block']:4d}  {short(x['name'], 70)}")
        print(f"  {tot:8.2f} a layer with its gaps, {k * tot:.1f} for the {k}")
    # between replays
    allr = reps[g]
    between = collections.defaultdict(list)
    hostgap = []
    starts = [r[0]["start"] for r in allr]
    ends = [r[-1]["start"] + r[-1]["dur"] for r in allr]
    outside = [x for x in recs if not x["graph"] and x["kind"] != "R"]
    api = [x for x in recs if x["kind"] == "R"]
    j = 0
    for i in range(a.skip, len(allr) - 1):
        lo, hi = ends[i], starts[i + 1]
        hostgap.append((hi - lo) / 1e3)
        while j < len(outside) and outside[j]["start"] < lo:
            j += 1
        k = j
        while k < len(outside) and outside[k]["start"] < hi:
            between[short(outside[k]["name"], 40)].append(outside[k]["dur"] / 1e3)
            k += 1
    if hostgap:
        print(f"\nbetween replays: {med(hostgap):.1f} us from one replay's end to the next's "
              f"start (min {min(hostgap):.1f}); per step in that window:")
        steps = len(hostgap)
        for k, v in sorted(between.items(), key=lambda kv: -sum(kv[1])):
            print(f"  {k:40s} {len(v) / steps:5.2f} a step, median {med(v):7.2f} us")
    if api and hostgap:
        # the host's API calls from the end of one replay to the launch of the next (PD_TRACE_API;
        # calls still running at the replay's end included):
        # median start (from the replay's end) and duration of each call, in order, and the
        # host time between calls
        seqs = []
        k = 0
        api.sort(key=lambda x: x["start"])
        for i in range(a.skip, len(allr) - 1):
            lo, hi = ends[i], starts[i + 1]
            # the calls running at the replay's end (the wait for it) or begun before the next
            while k < len(api) and api[k]["start"] + api[k]["dur"] < lo and api[k]["start"] < hi:
                k += 1
            seq = []
            for x in api[k:]:
                if x["start"] >= hi:
                    break
                if x["start"] + x["dur"] >= lo:
                    seq.append(x)
            seqs.append([(x["name"], (x["start"] - lo) / 1e3, x["dur"] / 1e3) for x in seq])
        n = collections.Counter(len(s) for s in seqs).most_common(1)[0][0]
        same = [s for s in seqs if len(s) == n]
        print(f"\nhost CUDA calls around a replay's end (t = 0; {len(same)} of {len(seqs)} steps "
              f"with {n} calls; medians): start, duration, host time since the previous call")
        for j in range(n):
            st = med([s[j][1] for s in same])
            du = med([s[j][2] for s in same])
            gp = 0 if j == 0 else med([s[j][1] - s[j - 1][1] - s[j - 1][2] for s in same])
            print(f"  {st:9.1f} {du:8.1f} {gp:8.1f}  {same[0][j][0]}")


if __name__ == "__main__":
    main()
