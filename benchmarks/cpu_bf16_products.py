#!/usr/bin/env python3
"""The CPU GEMM's three products on this machine (runtime.cpu_matmul_precision, csrc/gemm.cpp):
fp32 panels (`highest`), bf16 panels by vdpbf16ps (x rounded to bf16) and bf16 panels widened to
fp32 in the kernel (x kept fp32), at SmolLM2-135M's MLP shapes and the row counts a served run
makes (16: a decode step of concurrency 16; 64; 400: a prefill batch of two 200-token prompts).

    python benchmarks/cpu_bf16_products.py [--threads 2] [--rounds 3] [--build default|avx2]

--build avx2 times the AVX2 kernel (built with RS_NO_AVX512, as AVX2-only CPUs run it: bf16 panels
widened a K block at a time into L1) on an AVX-512 machine; vdpbf16ps is left out where the build has
none (AVX2, or AVX-512 without BF16).

Each shape runs twice: with one weight (it stays in L2/L3 between calls: the kernel's compute rate)
and with 60 distinct weights in turn (~200-400 MB, past this CPU's caches: the weights stream from
DRAM as in a decode step). The instruction rates come first: `dot_to_fma_rate` (vdpbf16ps FLOPs a
second over the fp32 FMA's, on one core), which picks the medium product at load, and the nominal
peaks it implies. Kinds alternate call by call within a round; each figure is the best round."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

import torch
from radixserve.layers import cpu_gemm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--build", choices=("default", "avx2"), default="default")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.build == "avx2":
        from radixserve import native

        gemm = native.load_extension("radixserve_cpu_gemm_avx2", cpu_gemm._SOURCE, defines=("RS_NO_AVX512",))
    else:
        gemm = cpu_gemm._native_gemm()
    if gemm is None or not gemm.bf16_available():
        raise SystemExit("no native GEMM here (AVX2 and a C++ compiler): only torch's fp32 product runs")
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rate = gemm.dot_to_fma_rate()
    print(json.dumps({"cpu": cpu, "cores": os.cpu_count(), "threads": args.threads, "commit": commit,
                      "build": args.build, "panel_width": gemm.panel_width(), "dot_to_fma_rate": round(rate, 3),
                      "medium_product": "widen" if rate < 1.0 else "vdpbf16ps"}))
    gen = torch.Generator().manual_seed(0)
    for copies in (1, 60):
        for rows in (16, 64, 400):
            for n, k, name in ((3072, 576, "gate_up"), (576, 1536, "down")):
                weights = [torch.randn(n, k, generator=gen) * 0.02 for _ in range(copies)]
                fp32 = [gemm.pack(w) for w in weights]
                bf16 = [gemm.to_bf16_panels(p) for p in fp32]
                del weights
                x = torch.randn(rows, k, generator=gen)
                kinds = {"fp32": (fp32, False), "vdpbf16ps": (bf16, False), "widen": (bf16, True)}
                if not gemm.bf16_dot_available():
                    del kinds["vdpbf16ps"]
                best = dict.fromkeys(kinds, float("inf"))
                reps = max(2, 40 // copies) * copies
                for _ in range(args.rounds):
                    for kind, (panels, widen) in kinds.items():
                        gemm.linear(x, panels[-1], n, widen)  # warm-up on the weight timed last
                        t = time.perf_counter()
                        for i in range(reps):
                            gemm.linear(x, panels[i % copies], n, widen)
                        best[kind] = min(best[kind], (time.perf_counter() - t) / reps)
                flop = 2 * rows * n * k
                print(json.dumps({"shape": name, "rows": rows, "N": n, "K": k,
                                  "weights": "streamed (60)" if copies > 1 else "cached (1)",
                                  **{f"{kind}_ms": round(s * 1e3, 3) for kind, s in best.items()},
                                  **{f"{kind}_gflops": round(flop / s / 1e9, 1) for kind, s in best.items()}}))


if __name__ == "__main__":
    main()
