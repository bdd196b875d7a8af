#!/usr/bin/env python3
"""Where one batch-1 decode step of the SmolLM2 Q4_1 GGUF kept quantized goes (issue 14, item a).

    python benchmarks/cpu_gguf_decode_profile.py [--threads 1 2] [--steps 48] [--dequantize]

For each thread count: the median decode step of a static batch of one chat prompt; the time of
the same step's quantized GEMVs alone (every kept linear and the LM head called on a random row,
as many times as one step calls them); and torch.profiler's top operators by own CPU time over a
few steps (the native kernels are single operators; everything else a step does is listed beside
them). What is not the GEMVs is what a step could lose."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_env import commit, machine
from cpu_gguf_quantized import PROMPTS, smollm2_path


def gemv_only_ms(runner, reps: int) -> float:
    """Milliseconds one decode step spends in the kept linears and head, each called alone."""
    from radixserve_quant_gguf import kernels

    calls = []
    for module in runner.model.modules():
        qtype = getattr(module, "gguf_qtype", None) or (getattr(module, "qtype", None)
                                                        if hasattr(module, "compute_logits") else None)
        if qtype is not None:
            k = module.weight.shape[1] // kernels.KEPT_TYPES[qtype][1] * kernels.BLOCK
            calls.append((torch.randn(1, k), module.weight, qtype))
    for x, w, q in calls:  # warm
        kernels.linear(x, w, q)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for x, w, q in calls:
            kernels.linear(x, w, q)
        best = min(best, time.perf_counter() - t)
    return best * 1e3, len(calls)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--dequantize", action="store_true", help="profile the fp32 path instead")
    args = ap.parse_args()
    from radixserve.config import Config
    from radixserve.model_runner import ModelRunner
    from radixserve.static_batch import run_static_batch
    from radixserve.tokenizer import apply_chat_template

    cfg = Config.build({"model": {"path": args.model or smollm2_path(),
                                  "weight_source_options": {"dequantize": args.dequantize}},
                        "runtime": {"device": "cpu", "dtype": "float32", "num_threads": max(args.threads)},
                        "scheduler": {"max_total_tokens": 4096, "max_running_requests": 4}})
    runner = ModelRunner(cfg, show_progress=False)
    ids = apply_chat_template(runner.tokenizer, [{"role": "user", "content": PROMPTS[0]}])
    print(f"# batch-1 decode profile, {machine()}, commit {commit()}, kept={not args.dequantize}", flush=True)
    for threads in args.threads:
        torch.set_num_threads(threads)
        run_static_batch(runner, [ids], max_new_tokens=8)  # warm-up
        steps = run_static_batch(runner, [ids], max_new_tokens=args.steps).decode_step_s
        step_ms = statistics.median(steps) * 1e3
        line = f"threads {threads}: decode step median {step_ms:.2f} ms ({1e3 / step_ms:.1f} tok/s)"
        if not args.dequantize:
            gemv_ms, n = gemv_only_ms(runner, 20)
            line += f"; its {n} quantized GEMVs alone {gemv_ms:.2f} ms ({gemv_ms / step_ms:.0%})"
        print(line, flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run_static_batch(runner, [ids], max_new_tokens=args.profile_steps)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
        print(f"(the table covers the prefill and {args.profile_steps - 1} decode steps)", flush=True)


if __name__ == "__main__":
    main()
