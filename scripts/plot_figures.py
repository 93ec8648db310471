#!/usr/bin/env python3
"""Draws the plots of docs/benchmarks.md from the JSON figures in docs/figures/.

    scripts/plot_figures.py [--figures docs/figures] [--out docs/figures]

Each JSON file (written by scripts/cpu_figures.py) holds "series": {name: {x: y}}, with
"figure", "commit", "machine" and "commands". CI runs this script on the committed files,
so a file that no longer parses, or a plot that no longer draws, fails the build.
"""

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name of the JSON file: (x label, y label, log-scaled x, y starts at zero)
PLOTS = {
    "batch": ("concurrent sequences", "decode tokens/s", True, True),
    "ttft": ("prompt tokens", "time to first token (ms)", True, True),
    "lora": ("adapters (rank 16, one per request in turn)", "% of the base model's decode tokens/s", True, False),
}


def load(path):
    with open(path) as f:
        fig = json.load(f)
    for key in ("figure", "commit", "machine", "commands", "series"):
        if key not in fig:
            raise ValueError(f"{path}: no {key!r}")
    for name, points in fig["series"].items():
        if not points:
            raise ValueError(f"{path}: series {name!r} is empty")
        if name not in fig["commands"]:
            raise ValueError(f"{path}: series {name!r} names no command")
        for x, y in points.items():
            float(x), float(y)
    return fig


def draw(fig, labels, out):
    xlabel, ylabel, logx, zero = labels
    plt.figure(figsize=(6.4, 4.0), dpi=100)
    for name, points in fig["series"].items():
        xs = sorted(points, key=float)
        plt.plot([float(x) for x in xs], [points[x] for x in xs], marker="o", label=name)
    if logx:
        plt.xscale("log", base=2)
        ticks = sorted({float(x) for s in fig["series"].values() for x in s})
        plt.xticks(ticks, [f"{t:g}" for t in ticks])
    if zero:
        plt.ylim(bottom=0)
    plt.xlabel(xlabel)
    plt.ylabel(ylabel)
    kernels = f", {fig['kernels']} kernels" if "kernels" in fig else ""
    plt.title(f"{fig['figure']}\n{fig['model']}, {fig['machine']}{kernels}, {fig['commit']}", fontsize=8)
    plt.grid(alpha=0.3)
    plt.legend(fontsize=8)
    plt.tight_layout()
    plt.savefig(out)
    plt.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--figures", default=os.path.join(ROOT, "docs/figures"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs/figures"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for name, labels in PLOTS.items():
        fig = load(os.path.join(a.figures, name + ".json"))
        out = os.path.join(a.out, name + ".png")
        draw(fig, labels, out)
        print(f"{out}: {', '.join(fig['series'])}", file=sys.stderr)


if __name__ == "__main__":
    main()
