#!/usr/bin/env python3
"""Where one batch-1 decode step of the SmolLM2 Q4_1 GGUF kept quantized goes (issue 14, item a).

    python benchmarks/cpu_gguf_decode_profile.py [--threads 1 2] [--steps 48] [--dequantize]

For each thread count: the median decode step of a static batch of one chat prompt; the time of
the same step's quantized GEMVs alone (every kept linear and the LM head called on a random row,
as many times as one step calls them); and cProfile's top functions by own CPU time over a few steps
(the native kernels are single built-in calls; everything else a step does is listed beside them). What is not the GEMVs is what a step could lose."""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
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
    wall, cpu = [], []
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        for x, w, q in calls:
            kernels.linear(x, w, q)
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3, len(calls)


def step_times(runner, ids, steps: int) -> tuple[float, float]:
    """Median wall and process CPU milliseconds of one decode forward (the machine is shared: CPU
    time, with one thread, is what the step costs however often it is descheduled)."""
    from radixserve.static_batch import run_static_batch

    wall, cpu, run_batch = [], [], runner.run_batch

    def timed(batch):
        t, c = time.perf_counter(), time.process_time()
        try:
            return run_batch(batch)
        finally:
            wall.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)

    runner.run_batch = timed
    try:
        run_static_batch(runner, [ids], max_new_tokens=steps)
    finally:
        runner.run_batch = run_batch
    return statistics.median(wall[1:]) * 1e3, statistics.median(cpu[1:]) * 1e3  # [0] is the prefill


def flat_ab(runner, ids, steps: int, rounds: int) -> None:
    """Step times with the layers' flat forward and with their modules, interleaved."""
    layers = [m for m in runner.model.modules() if "forward" in m.__dict__]
    flat = [m.__dict__["forward"] for m in layers]
    for r in range(rounds):
        for on in (True, False):
            for layer, forward in zip(layers, flat, strict=True):
                if on:
                    layer.forward = forward
                else:
                    del layer.forward  # back to the class's forward: the module calls
            wall, cpu = step_times(runner, ids, steps)
            print(f"  round {r}: {'flat layers' if on else 'layer modules'}: step {wall:.2f} ms wall, "
                  f"{cpu:.2f} ms CPU", flush=True)
    for layer, forward in zip(layers, flat, strict=True):
        layer.forward = forward


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--dequantize", action="store_true", help="profile the fp32 path instead")
    ap.add_argument("--flat-ab", type=int, default=0, metavar="ROUNDS",
                    help="also time the step with the flat layer forward (fast_layer.py) and with the layer "
                         "modules, interleaved, ROUNDS times (kept blocks only)")
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
        step_ms, step_cpu = step_times(runner, ids, args.steps)
        line = (f"threads {threads}: decode step median {step_ms:.2f} ms wall ({1e3 / step_ms:.1f} tok/s), "
                f"{step_cpu:.2f} ms CPU")
        if not args.dequantize:
            gemv_ms, gemv_cpu, n = gemv_only_ms(runner, 20)
            line += (f"; its {n} quantized GEMVs alone {gemv_ms:.2f} ms wall, {gemv_cpu:.2f} ms CPU "
                     f"({gemv_cpu / step_cpu:.0%} of the step's CPU time)")
        print(line, flush=True)
        if args.flat_ab and not args.dequantize:
            flat_ab(runner, ids, args.steps, args.flat_ab)
        profiler = cProfile.Profile(time.process_time)  # CPU time: the machine is shared
        profiler.enable()
        run_static_batch(runner, [ids], max_new_tokens=args.profile_steps)
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.top)
        print(f"cProfile, own CPU time, prefill + {args.profile_steps - 1} decode steps (Python time inflated "
              f"by the profiler; the native kernels are single built-in calls):\n{out.getvalue().strip()}", flush=True)


if __name__ == "__main__":
    main()
