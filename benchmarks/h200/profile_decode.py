"""Where a batch-1 decode step's time goes on the GPU (Llama-3.1-8B shape, dummy bf16 weights).

    python benchmarks/h200/profile_decode.py [--model benchmarks/model-configs/llama-3.1-8b] [--out DIR]
        [--variants off,on]

Reports, per variant of the triton backend's decode fusions, for one runner: (1) the synchronous step
(`run_batch`, as `bench one-batch` times it), (2) the captured graph replayed back to back with no
host work between (the GPU's own time per step), (3) the top CUDA kernels of an eager step by device
time. (1) - (2) is host overhead that overlap scheduling can hide; (2) against the HBM floor is kernel
efficiency. Variants (comma-separated, measured in this order on the same weights, graphs recaptured
for each): `off` (rotary + two index_put_ KV stores), `on` (rotary fused into the KV store: the
default; `rotary` is the same); `<variant>+gemv`: with runtime.batch1_gemv=auto's per-layer Triton GEMV
tiles (radixserve.layers.gemv_selection); the variants without `+gemv` run with it off (cuBLAS);
`<variant>+gemv+pdl`: those tiles with programmatic dependent launch (GemvConfig.pdl);
`<variant>+gemv+norm`: the tiles with the RMSNorm fused into the qkv / gate_up GEMV
(runtime.batch1_gemv_fuse_norm, radixserve.layers.norm_gemv).
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

VARIANTS = {"off": False, "on": True, "rotary": True, "off+gemv": False, "on+gemv": True, "rotary+gemv": True,
            "on+gemv+pdl": True, "rotary+gemv+pdl": True, "on+gemv+norm": True,
            "rotary+gemv+norm": True}  # variant -> rotary fused with the KV store


def route_gemv(runner: ModelRunner, enable: bool, pdl: bool, fuse_norm: bool = False) -> None:
    """runtime.batch1_gemv on this runner's layers: `auto` (the default) or `off`; `pdl`: its tiles
    with programmatic dependent launch; `fuse_norm`: the norms in the qkv / gate_up GEMVs."""
    from radixserve.layers.gemv_selection import attach_batch1_gemv

    n = attach_batch1_gemv(runner.model, "auto" if enable else "off", runner.device, pdl=pdl, fuse_norm=fuse_norm)
    print(f"    batch-1 Triton GEMV on {n} linear layers", flush=True)


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
    args = ap.parse_args()
    variants = args.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variant(s) {bad}; choose from {sorted(VARIANTS)}")
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
        try:
            route_gemv(runner, "+gemv" in name, name.endswith("+pdl"), name.endswith("+norm"))
            runner._init_cuda_graphs()  # recapture with this variant's kernels
            rows[name] = measure(runner, prompt)
        except Exception as e:  # e.g. an opt-in variant's capture failing: keep the others' rows
            print(f"[{name}] failed: {e!r}"[:300], flush=True)
            variants = [v for v in variants if v != name]
            continue
        r = rows[name]
        print(f"[{name}] sync step {r['sync_step_ms']} ms, graph replay {r['graph_replay_ms']} ms, eager kernels "
              f"{r['kernel_ms_per_decode_step']} ms/step", flush=True)
        for op in r["top_ops_device_ms_per_decode_step"]:
            if not op["name"].startswith(("aten::", "cu")):
                print(f"    {op['ms']:8.4f} ms  {op['calls']:4d}x  {op['name']}")
    exact = [v for v in variants if "+gemv" not in v]  # the GEMV sums in another order
    same = len({tuple(rows[v]["output_ids"]) for v in exact}) == 1
    print(f"greedy tokens (64 new, 1024-token prompt) identical across variants {exact}: {same}")
    for v in variants:
        if "+gemv" in v and exact:
            agree = sum(a == b for a, b in zip(rows[v]["output_ids"], rows[exact[-1]]["output_ids"]))
            print(f"{v}: {agree}/64 greedy tokens equal to {exact[-1]}'s (dummy weights: near-ties are common)")
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk not in ("top_ops_device_ms_per_decode_step", "output_ids")}
                      for k, v in rows.items()}, indent=1))
    with open(os.path.join(args.out, "profile_decode.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
