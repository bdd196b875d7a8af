#!/usr/bin/env python3
"""The cpu_batched decode attention op alone (issue 12), at the served SmolLM2 shapes: 9 query heads,
3 KV heads, head dim 64, fp32, `--batch` rows at context `--context`, 30 layers of KV (so each
layer's K/V comes from DRAM, as in the model's step). Slots are laid out as the server lays them
out: each row's prompt in one run of slots, then one slot per row per decode step (interleaved).

    python benchmarks/cpu_decode_attention.py [--batch 16] [--context 260] [--prompt 200]
        [--threads 1] [--steps 6] [--rounds 4] [--baseline OLD.cpp] [--kv-dtype bfloat16 [--bf16-products]]

With --baseline, the kernel built from OLD.cpp (e.g. `git show REV:plugins/.../attention.cpp`) runs
in the same process, round by round alternating with the current one, and the outputs of the two
are compared (--bf16-products applies to each kernel that has the option; one from before it runs
its exact products). Reports the calling thread's CPU ms per layer (with --threads 1: the op's own cost
even on a shared machine) and wall ms; one JSON line per round."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_env import commit, machine  # noqa: E402

HQ, HKV, D = 9, 3, 64


def layout(batch: int, context: int, prompt: int) -> torch.Tensor:
    """[batch, context] slot table: prompts in runs, then decode slots interleaved across rows."""
    table = torch.empty(batch, context, dtype=torch.int64)
    nxt = 1  # slot 0 is the pad slot
    for b in range(batch):
        table[b, :prompt] = torch.arange(nxt, nxt + prompt)
        nxt += prompt
    for t in range(prompt, context):
        table[:, t] = torch.arange(nxt, nxt + batch)
        nxt += batch
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=260)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6, help="passes over all layers per round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--layers", type=int, default=30, help="KV buffers cycled through (1: KV stays in cache)")
    ap.add_argument("--baseline", default=None, help="an older attention.cpp to A/B against")
    ap.add_argument("--kv-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the pool's dtype (bfloat16: runtime.kv_cache_dtype=bfloat16)")
    ap.add_argument("--bf16-products", action="store_true",
                    help="bf16 pool: bf16-rounded query and weights in the products (cpu_matmul_precision=medium)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from radixserve import native
    from radixserve_attention_cpu_batched.backend import load_kernels

    kernels = {"current": load_kernels()}
    if args.baseline:
        kernels["baseline"] = native.load_extension("radixserve_cpu_attention_baseline", args.baseline)
    print(f"== {machine()}; commit {commit()}", flush=True)
    gen = torch.Generator().manual_seed(0)
    table = layout(args.batch, args.context, min(args.prompt, args.context))
    slots = int(table.max()) + 1
    kv_dtype = getattr(torch, args.kv_dtype)
    k_bufs = [torch.randn(slots, HKV, D, generator=gen).to(kv_dtype) for _ in range(args.layers)]
    v_bufs = [torch.randn(slots, HKV, D, generator=gen).to(kv_dtype) for _ in range(args.layers)]
    q = torch.randn(args.batch, HQ * D, generator=gen)
    rows = torch.arange(args.batch)
    seq_lens = torch.full((args.batch,), args.context)
    loc = table[:, -1].contiguous()
    k_new = k_bufs[0][loc].reshape(args.batch, -1).float()
    v_new = v_bufs[0][loc].reshape(args.batch, -1).float()

    def call(mod, layer: int) -> torch.Tensor:
        # a kernel built before the bf16 products option takes no flag
        flag = (args.bf16_products,) if hasattr(mod, "bf16_products_available") else ()
        return mod.decode_attention(q, k_new, v_new, loc, k_bufs[layer], v_bufs[layer], table, rows, seq_lens,
                                    D**-0.5, 0, 0.0, *flag)

    if len(kernels) == 2:
        a, b = (call(m, 0) for m in kernels.values())
        print(json.dumps({"max_abs_diff_vs_baseline": (a - b).abs().max().item()}), flush=True)
    results: dict[str, list[float]] = {name: [] for name in kernels}
    for rnd in range(args.rounds):
        for name, mod in (kernels.items() if rnd % 2 == 0 else reversed(kernels.items())):
            call(mod, 0)
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(args.steps):
                for layer in range(args.layers):
                    call(mod, layer)
            n = args.steps * args.layers
            cpu_ms, wall_ms = (time.thread_time() - c0) / n * 1e3, (time.perf_counter() - t0) / n * 1e3
            results[name].append(cpu_ms)
            print(json.dumps({"round": rnd, "kernel": name, "cpu_ms_per_layer": round(cpu_ms, 3),
                              "wall_ms_per_layer": round(wall_ms, 3), "load_avg": os.getloadavg()[0]}), flush=True)
    print(json.dumps({"what": "median cpu ms per layer", **{k: round(statistics.median(v), 3) for k, v in results.items()},
                      "batch": args.batch, "context": args.context, "threads": args.threads, "layers": args.layers}), flush=True)


if __name__ == "__main__":
    main()
