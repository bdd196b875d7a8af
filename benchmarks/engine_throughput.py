#!/usr/bin/env python3
"""Offline throughput: RadixServe Engine.generate vs transformers' padded-batch generate, same prompts.

64 SmolLM2 chat prompts x 128 output tokens (ignore_eos, greedy, fp32) from the HF directory, by
default .models/smollm2-135m-instruct (build it with benchmarks/smollm2_hf.py).
Prints one Markdown block (machine, commit, command, figures) to paste into
benchmarks/results/cpu-engine-throughput.md.

    python benchmarks/engine_throughput.py [--model DIR] [--num-prompts 64] [--output-len 128]
        [--hf-batch-size 64] [--skip-hf] [--threads N] [--set scheduler.chunked_prefill_size=512 ...]
"""

from __future__ import annotations

import argparse
import sys
import time

from bench_env import commit, machine
from smollm2_hf import DEFAULT_OUT as SMOLLM2_HF_DIR

TOPICS = [
    "the ocean",
    "a lighthouse",
    "autumn leaves",
    "a busy city",
    "black holes",
    "bread baking",
    "chess openings",
    "honey bees",
    "the first computers",
    "volcanoes",
    "jazz music",
    "a desert night",
    "penguins",
    "glaciers",
    "the printing press",
    "coral reefs",
]
TASKS = [
    "Write a short poem about {}.",
    "Explain {} to a ten-year-old.",
    "List five surprising facts about {}.",
    "Describe {} in the style of a travel guide.",
]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    from radixserve.tokenizer import apply_chat_template

    out = []
    for i in range(n):
        msg = TASKS[i % len(TASKS)].format(TOPICS[i % len(TOPICS)])
        out.append(apply_chat_template(tokenizer, [{"role": "user", "content": msg}]))
    return out


def run_engine(model: str, prompts: list[list[int]], output_len: int, overrides: dict) -> dict:
    from radixserve.config import deep_merge
    from radixserve.engine import Engine

    sections = deep_merge(
        {"runtime": {"device": "cpu", "dtype": "float32"}, "scheduler": {"max_total_tokens": 32768}}, overrides
    )
    with Engine(model=model, **sections) as eng:
        sp = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
        eng.generate(input_ids=prompts[0], sampling_params={**sp, "max_new_tokens": 4})  # warm-up
        eng.flush_cache()
        t0 = time.perf_counter()
        outs = eng.generate(input_ids=prompts, sampling_params=sp)
        dt = time.perf_counter() - t0
        stats = eng.get_stats()
    n_out = sum(len(o["output_ids"]) for o in outs)
    assert n_out == len(prompts) * output_len, "every request must produce exactly output_len tokens"
    return {"seconds": dt, "output_tokens": n_out, "tok_s": n_out / dt, "stats": stats}


def run_hf(model: str, prompts: list[list[int]], output_len: int, batch_size: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    gen = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=tok.pad_token_id)
    with torch.inference_mode():
        warm = tok.pad({"input_ids": prompts[:1]}, return_tensors="pt")
        m.generate(**warm, **{**gen, "max_new_tokens": 4, "min_new_tokens": 4})
        t0 = time.perf_counter()
        n_out = 0
        for i in range(0, len(prompts), batch_size):
            batch = tok.pad({"input_ids": prompts[i : i + batch_size]}, return_tensors="pt")
            out = m.generate(**batch, **gen)
            n_out += (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
        dt = time.perf_counter() - t0
    return {"seconds": dt, "output_tokens": n_out, "tok_s": n_out / dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=SMOLLM2_HF_DIR)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads on both sides (default: all cores)")
    ap.add_argument("--set", nargs="*", default=[], help="config overrides, e.g. scheduler.chunked_prefill_size=512")
    args = ap.parse_args()

    import torch
    from radixserve.config import parse_dotted_overrides
    from radixserve.tokenizer import load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = parse_dotted_overrides(args.set)
    if args.threads:
        overrides.setdefault("runtime", {})["num_threads"] = args.threads
    head = machine()
    prompts = chat_prompts(load_tokenizer(args.model), args.num_prompts)
    in_tokens = sum(map(len, prompts))
    eng = run_engine(args.model, prompts, args.output_len, overrides)
    hf = None if args.skip_hf else run_hf(args.model, prompts, args.output_len, args.hf_batch_size)

    print(f"## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit()}\n")
    print(f"- Machine: {head}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"- Command: `python {' '.join(sys.argv)}`")
    print(
        f"- Workload: {len(prompts)} chat prompts ({in_tokens} prompt tokens), {args.output_len} output tokens each, "
        "greedy, ignore_eos, fp32\n"
    )
    print("| system | seconds | output tokens | output tok/s |")
    print("|---|---:|---:|---:|")
    print(f"| RadixServe Engine.generate | {eng['seconds']:.1f} | {eng['output_tokens']} | {eng['tok_s']:.1f} |")
    if hf is not None:
        print(
            f"| transformers generate (padded batch {args.hf_batch_size}) | {hf['seconds']:.1f} | "
            f"{hf['output_tokens']} | {hf['tok_s']:.1f} |"
        )
        print(f"\nRadixServe / transformers: {eng['tok_s'] / hf['tok_s']:.2f}x")
    s = eng["stats"]
    print(
        f"\nEngine counters: prefill computed {s['prefill_tokens_computed']}, cached {s['prefill_tokens_cached']}, "
        f"decode batches {s['decode_batches']}, prefill batches {s['prefill_batches']}, "
        f"retractions {s['retractions']}"
    )


if __name__ == "__main__":
    main()
