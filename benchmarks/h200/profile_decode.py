"""Where a batch-1 decode step's time goes on the GPU (Llama-3.1-8B shape, dummy bf16 weights).

    python benchmarks/h200/profile_decode.py [--model benchmarks/model-configs/llama-3.1-8b] [--out DIR]

Reports, for the same runner: (1) the synchronous step (`run_batch`, as `bench one-batch` times it),
(2) the captured graph replayed back to back with no host work between (the GPU's own time per step),
(3) the top CUDA kernels of an eager step by device time. (1) - (2) is host overhead that overlap
scheduling can hide; (2) against the HBM floor is kernel efficiency."""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from radixserve.config import Config
from radixserve.model_runner import ModelRunner
from radixserve.static_batch import run_static_batch


def runner_for(model: str, graphs: bool) -> ModelRunner:
    cfg = Config.build({
        "model": {"path": model, "load_format": "dummy", "context_length": 2048},
        "runtime": {"device": "cuda", "dtype": "bfloat16", "cuda_graph": graphs, "cuda_graph_max_bs": 8},
        "stack": {"attention": "triton"},
        "scheduler": {"max_running_requests": 8, "max_total_tokens": 8192},
    })
    return ModelRunner(cfg, show_progress=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="benchmarks/model-configs/llama-3.1-8b")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    prompt = [[(7 * i) % 30000 + 100 for i in range(1024)]]
    row: dict = {}

    runner = runner_for(args.model, graphs=True)
    run_static_batch(runner, prompt, max_new_tokens=4)
    res = run_static_batch(runner, prompt, max_new_tokens=64)
    row["sync_step_ms"] = round(statistics.median(res.decode_step_s) * 1e3, 3)
    gr = runner.graph_runner
    graph = gr.graphs[1]
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
    del runner, gr, graph
    torch.cuda.empty_cache()

    runner = runner_for(args.model, graphs=False)
    run_static_batch(runner, prompt, max_new_tokens=4)
    from torch.profiler import ProfilerActivity, profile

    def device_times(n_new: int) -> tuple[dict[str, tuple[float, int]], list[float]]:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            res = run_static_batch(runner, prompt, max_new_tokens=n_new)
        times = {e.key: (e.device_time_total, e.count) for e in prof.key_averages() if e.device_time_total > 0}
        return times, res.decode_step_s

    prefill_only, _ = device_times(1)  # the prefill's kernels, subtracted below
    with_decode, step_s = device_times(9)  # the same prefill + 8 decode steps
    row["eager_step_ms"] = round(statistics.median(step_s) * 1e3, 3)
    per_step = {
        k: ((t - prefill_only.get(k, (0.0, 0))[0]) / 1e3 / 8, (c - prefill_only.get(k, (0.0, 0))[1]) // 8)
        for k, (t, c) in with_decode.items()
    }
    top = sorted(per_step.items(), key=lambda kv: -kv[1][0])
    row["top_ops_device_ms_per_decode_step"] = [
        {"name": k[:90], "calls": c, "ms": round(ms, 4)} for k, (ms, c) in top[:25] if ms > 0
    ]
    print(json.dumps(row, indent=1))
    with open(os.path.join(args.out, "profile_decode.json"), "w") as f:
        json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
