#!/usr/bin/env python3
"""Kernel times of a GPU run's forward steps, from an Nsight Systems trace.

    nsys profile --cuda-graph-trace=node -t cuda -o run actorllm bench latency ...
    nsys stats --report cuda_gpu_trace --format csv -o run run.nsys-rep
    scripts/graph_kernels.py run_cuda_gpu_trace.csv

`--cuda-graph-trace=node` makes each kernel of a replayed CUDA graph a row of its own;
the eager profile (ACTORLLM_PROFILE_KERNELS) cannot show them, and its per-operation
figures include the host's launch time. Steps are cut at each embedding kernel (the first
kernel of a forward) and grouped by their sequence of kernel names, which differs with the
batch size (cuBLAS picks its kernels by shape). Printed: one line per group, then for the
group with the most steps (or the one chosen), averaged over its steps: the span from the
first kernel's start to the last kernel's end, the time kernels ran, the gaps between
them, and per kernel name its calls, time per call and per step, and the mean gap before.

Under programmatic dependent launch (sm_90) a kernel starts while the one before it runs
and waits for it, so durations include that wait and gaps come out negative. Then read the
`µs/step` of `--ends`: per kernel name, how much each call moved the step's latest end
(end minus the latest end before it), which sums to the span: the step's critical path.

With `--by-grid NAME`, instead: the total time of the kernels whose name contains NAME over
the whole trace, per launch shape (grid x, y, z and block x; for the attention kernels
grid x is the batch's rows, so a throughput run's steps come out by graph size).
"""

import argparse
import collections
import csv
import statistics


def read_kernels(path, shapes=False):
    """(start ns, duration ns, name) of every row of the trace, in start order; with
    `shapes`, also (grid x, grid y, grid z, block x) of each kernel (None for copies)."""
    with open(path, newline="") as f:
        rows = csv.reader(f)
        header = next(r for r in rows if r and r[0].startswith("Start"))
        start, duration, name = header.index("Start (ns)"), header.index("Duration (ns)"), header.index("Name")
        dims = [header.index(c) for c in ("GrdX", "GrdY", "GrdZ", "BlkX")]
        kernels = []
        for r in rows:
            if len(r) <= name or not r[start].replace(".", "", 1).isdigit():
                continue
            k = (int(float(r[start])), int(float(r[duration])), r[name])
            if shapes:
                k += (tuple(int(r[d]) for d in dims) if r[dims[0]] else None,)
            kernels.append(k)
    return sorted(kernels)


def by_grid(path, pattern, top):
    """Prints the time of the kernels named like `pattern` per launch shape."""
    totals = collections.defaultdict(lambda: [0, 0])
    for _, duration, name, shape in read_kernels(path, shapes=True):
        if pattern in name and shape is not None:
            totals[shape][0] += 1
            totals[shape][1] += duration
    if not totals:
        raise SystemExit(f"no kernel named like {pattern!r} in the trace")
    print(f"{pattern}: {sum(t for _, t in totals.values()) / 1e9:.3f} s in {sum(c for c, _ in totals.values())} calls")
    print(f"{'grid x, y, z':>18} {'block':>6} {'calls':>7} {'ms':>9} {'µs/call':>8}")
    for (x, y, z, b), (calls, total) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{f'{x}, {y}, {z}':>18} {b:6} {calls:7} {total / 1e6:9.1f} {total / calls / 1e3:8.1f}")


def split_steps(kernels):
    """Runs of kernels, each starting at an embedding kernel."""
    steps = []
    for k in kernels:
        if k[2].startswith("embedding") or not steps:
            steps.append([])
        steps[-1].append(k)
    return steps


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", help="CSV of `nsys stats --report cuda_gpu_trace --format csv`")
    parser.add_argument("--group", type=int, help="the group to detail, by its number in the list")
    parser.add_argument("--top", type=int, default=25, help="kernel names (or shapes) to list (default 25)")
    parser.add_argument("--by-grid", metavar="NAME", help="time per launch shape of the kernels named like NAME")
    parser.add_argument("--ends", action="store_true", help="time by which each kernel moved the step's end")
    args = parser.parse_args()
    if args.by_grid:
        return by_grid(args.trace, args.by_grid, args.top)

    steps = [s for s in split_steps(read_kernels(args.trace)) if s[0][2].startswith("embedding")]
    if not steps:
        raise SystemExit("no embedding kernel in the trace: not a forward of this engine?")
    groups = collections.defaultdict(list)
    for s in steps:
        groups[tuple(name for _, _, name in s)].append(s)
    listed = sorted(groups.values(), key=len, reverse=True)
    for i, g in enumerate(listed):
        span = statistics.mean(s[-1][0] + s[-1][1] - s[0][0] for s in g)
        print(f"group {i}: {len(g)} steps of {len(g[0])} kernels, span {span / 1e3:.1f} µs")
    pick = args.group if args.group is not None else 0
    if pick >= len(listed):
        raise SystemExit(f"no group {pick}")
    chosen = listed[pick]
    count = len(chosen[0])

    spans, busies, per_name = [], [], collections.defaultdict(lambda: [0, 0, 0])
    for s in chosen:
        spans.append(s[-1][0] + s[-1][1] - s[0][0])
        busies.append(sum(d for _, d, _ in s))
        last_end = s[0][0]
        for i, (start, duration, name) in enumerate(s):
            gap = start - (s[i - 1][0] + s[i - 1][1]) if i else 0
            entry = per_name[name[:70]]
            entry[0] += 1
            entry[1] += start + duration - last_end if args.ends else duration
            entry[2] += gap
            last_end = max(last_end, start + duration)
    n = len(chosen)
    span, busy = statistics.mean(spans), statistics.mean(busies)
    print(f"group {pick}: {n} steps of {count} kernels (of {len(steps)} steps)")
    print(f"per step: span {span / 1e3:.1f} µs, kernels {busy / 1e3:.1f} µs, gaps {(span - busy) / 1e3:.1f} µs")
    print(f"{'µs/step':>9} {'calls':>6} {'µs/call':>8} {'gap µs':>7}  kernel")
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][1])
    for name, (calls, total, gaps) in ranked[: args.top]:
        print(f"{total / n / 1e3:9.1f} {calls / n:6.1f} {total / calls / 1e3:8.2f} {gaps / calls / 1e3:7.2f}  {name}")


if __name__ == "__main__":
    main()
