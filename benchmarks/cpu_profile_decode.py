#!/usr/bin/env python3
"""Where a batched CPU decode step's time goes: SmolLM2 (HF directory), the 64 chat prompts of
engine_throughput.py, static batch (no scheduler), fp32.

    python benchmarks/cpu_profile_decode.py [--model DIR] [--batch 64] [--steps 48] [--profile-steps 6]

Prints the median decode step and, for `--profile-steps` steps in the middle of the run, the
functions with the most own time (cProfile: the native kernels and GEMMs appear as single built-in
calls, so their share is exact; Python time is inflated by the profiler). Run it with
RADIXSERVE_NATIVE=0 for the plain-torch paths."""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys

import torch
from bench_env import commit, machine
from engine_throughput import chat_prompts
from smollm2_hf import DEFAULT_OUT as SMOLLM2_HF_DIR


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=SMOLLM2_HF_DIR)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--profile-steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from radixserve.config import Config
    from radixserve.model_runner import ModelRunner
    from radixserve.static_batch import run_static_batch

    cfg = Config.build({
        "model": {"path": args.model},
        "runtime": {"device": "cpu", "dtype": "float32", "num_threads": args.threads},
        "scheduler": {"max_total_tokens": 32768, "max_running_requests": args.batch},
    })
    runner = ModelRunner(cfg, show_progress=False)
    prompts = chat_prompts(runner.tokenizer, args.batch)
    profiler, calls = cProfile.Profile(), [0]
    first = max(1, args.steps - args.profile_steps - 2)
    run_batch = runner.run_batch

    def profiled(sb):  # the prefill is call 0; profile a window of decode steps
        calls[0] += 1
        on = first <= calls[0] < first + args.profile_steps
        if on:
            profiler.enable()
        try:
            return run_batch(sb)
        finally:
            if on:
                profiler.disable()

    runner.run_batch = profiled
    res = run_static_batch(runner, prompts, max_new_tokens=args.steps)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(15)
    print(f"## CPU decode profile, {machine()}, commit {commit()}\n")
    print(f"- Command: `python {' '.join(sys.argv)}`")
    print(f"- attention backend {runner.attn_backend_name}, batch {args.batch}, prefill {res.prefill_s:.2f} s, "
          f"decode step median {statistics.median(res.decode_step_s) * 1e3:.1f} ms over {args.steps - 1} steps")
    print(f"- per step below: divide by {args.profile_steps}\n\n```\n{out.getvalue().strip()}\n```")


if __name__ == "__main__":
    main()
