"""Where a batch-1 decode step's time goes on the GPU (Llama-3.1-8B shape, dummy bf16 weights).

    python benchmarks/h200/profile_decode.py [--model benchmarks/model-configs/llama-3.1-8b] [--out DIR]
        [--variants off,on]

Reports, per variant of the triton backend's decode fusions, for one runner: (1) the synchronous step
(`run_batch`, as `bench one-batch` times it), (2) the captured graph replayed back to back with no
host work between (the GPU's own time per step), (3) the top CUDA kernels of an eager step by device
time. (1) - (2) is host overhead that overlap scheduling can hide; (2) against the HBM floor is kernel
efficiency. Variants (comma-separated, measured in this order on the same weights, graphs recaptured
for each): `off` (rotary + two index_put_ KV stores), `on` (rotary fused into the KV store: the default);
`on+gemv`: `on` with the batch-1 projections whose shape `--gemv-json` (benchmarks/h200/gemv_vs_cublas.py's
output) found faster on the Triton GEMV routed to it (`radixserve.layers.triton_gemv.use_for_shapes`).
Writes profile_decode.json: {variant: row}."""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics

import torch
from radixserve.config import Config
from radixserve.model_runner import ModelRunner
from radixserve.static_batch import run_static_batch

VARIANTS = {"off": False, "on": True, "on+gemv": True}  # variant -> rotary fused with the KV store


def route_gemv(gemv_json: str | None, enable: bool) -> None:
    """Send one-row projections of the shapes where the Triton GEMV won to it (or none)."""
    from radixserve.layers import triton_gemv

    winners = {}
    if enable:
        with open(gemv_json) as f:
            rows = json.load(f)
        winners = {(r["N"], r["K"]): triton_gemv.GemvConfig(**r["best"]["config"]) for r in rows.values()
                   if isinstance(r, dict) and r.get("best") and r["best"]["us"] < r["cublas_us"]}
        print(f"    Triton GEMV for (N, K) in {sorted(winners)}")
    triton_gemv.use_for_shapes(winners)


def runner_for(model: str) -> ModelRunner:
    cfg = Config.build({
        "model": {"path": model, "load_format": "dummy", "context_length": 2048},
        "runtime": {"device": "cuda", "dtype": "bfloat16", "cuda_graph": True, "cuda_graph_max_bs": 8},
        "stack": {"attention": "triton"},
        "scheduler": {"max_running_requests": 8, "max_total_tokens": 8192},
    })
    return ModelRunner(cfg, show_progress=False)


def measure(runner: ModelRunner, prompt: list[list[int]]) -> dict:
    row: dict = {}
    run_static_batch(runner, prompt, max_new_tokens=4)
    res = run_static_batch(runner, prompt, max_new_tokens=64)
    row["sync_step_ms"] = round(statistics.median(res.decode_step_s) * 1e3, 3)
    row["output_ids"] = res.output_ids[0]  # greedy: must not depend on the variant (bit-equal kernels)
    graph = runner.graph_runner.graphs[1]
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    row["graph_replay_ms"] = round(start.elapsed_time(end) / 100, 3)

    from torch.profiler import ProfilerActivity, profile

    graphs, runner.graph_runner = runner.graph_runner, None  # eager steps for the per-kernel profile
    try:
        def device_times(n_new: int) -> tuple[dict[str, tuple[float, int]], list[float]]:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                res = run_static_batch(runner, prompt, max_new_tokens=n_new)
            times = {e.key: (e.device_time_total, e.count) for e in prof.key_averages() if e.device_time_total > 0}
            return times, res.decode_step_s

        run_static_batch(runner, prompt, max_new_tokens=4)
        prefill_only, _ = device_times(1)  # the prefill's kernels, subtracted below
        with_decode, step_s = device_times(9)  # the same prefill + 8 decode steps
    finally:
        runner.graph_runner = graphs
    row["eager_step_ms"] = round(statistics.median(step_s) * 1e3, 3)
    per_step = {
        k: ((t - prefill_only.get(k, (0.0, 0))[0]) / 1e3 / 8, (c - prefill_only.get(k, (0.0, 0))[1]) // 8)
        for k, (t, c) in with_decode.items()
    }
    top = sorted(per_step.items(), key=lambda kv: -kv[1][0])
    row["top_ops_device_ms_per_decode_step"] = [
        {"name": k[:90], "calls": c, "ms": round(ms, 4)} for k, (ms, c) in top[:30] if ms > 0
    ]
    # kernels only (no aten:: / cuLaunch rows, which double-count them): the step's device time
    row["kernel_ms_per_decode_step"] = round(sum(
        ms for k, (ms, c) in per_step.items() if ms > 0 and not k.startswith(("aten::", "cu", "Memcpy", "Memset"))), 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="benchmarks/model-configs/llama-3.1-8b")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--variants", default="off,on", help=f"comma-separated, of {sorted(VARIANTS)}")
    ap.add_argument("--gemv-json", help="gemv_vs_cublas.json, for the on+gemv variant")
    args = ap.parse_args()
    variants = args.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variant(s) {bad}; choose from {sorted(VARIANTS)}")
    if "on+gemv" in variants and not (args.gemv_json and os.path.exists(args.gemv_json)):
        print(f"skipping variant on+gemv: it needs --gemv-json (gemv_vs_cublas.json), got {args.gemv_json!r}")
        variants.remove("on+gemv")
    prompt = [[(7 * i) % 30000 + 100 for i in range(1024)]]
    runner = runner_for(args.model)
    rows: dict = {}
    for name in variants:
        rotary_store = VARIANTS[name]
        if runner.graph_runner is not None:  # release the old graphs and their padding row
            runner.req_to_token_pool.free(runner.graph_runner.dummy_row)
        runner.graph_runner = None
        gc.collect()
        torch.cuda.empty_cache()
        runner.attn_backend.set_decode_fusions(rotary_store=rotary_store)
        route_gemv(args.gemv_json, name.endswith("+gemv"))
        runner._init_cuda_graphs()  # recapture with this variant's kernels
        rows[name] = measure(runner, prompt)
        r = rows[name]
        print(f"[{name}] sync step {r['sync_step_ms']} ms, graph replay {r['graph_replay_ms']} ms, eager kernels "
              f"{r['kernel_ms_per_decode_step']} ms/step", flush=True)
        for op in r["top_ops_device_ms_per_decode_step"]:
            if not op["name"].startswith(("aten::", "cu")):
                print(f"    {op['ms']:8.4f} ms  {op['calls']:4d}x  {op['name']}")
    exact = [v for v in variants if not v.endswith("+gemv")]  # the GEMV sums in another order
    same = len({tuple(rows[v]["output_ids"]) for v in exact}) == 1
    print(f"greedy tokens (64 new, 1024-token prompt) identical across variants {exact}: {same}")
    for v in variants:
        if v.endswith("+gemv") and exact:
            agree = sum(a == b for a, b in zip(rows[v]["output_ids"], rows[exact[-1]]["output_ids"]))
            print(f"{v}: {agree}/64 greedy tokens equal to {exact[-1]}'s (dummy weights: near-ties are common)")
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk not in ("top_ops_device_ms_per_decode_step", "output_ids")}
                      for k, v in rows.items()}, indent=1))
    with open(os.path.join(args.out, "profile_decode.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
