"""FP8 KV cache on the H200 (issue 14): run by benchmarks/h200/s5_fp8kv.sh, one JSON line per measurement.

    python benchmarks/h200/fp8kv.py tiny OUT_DIR
        greedy agreement, fp8 vs bf16 KV, on a tiny random Llama (head_dim 64, scales in the
        checkpoint) through the ModelRunner with the triton backend and decode CUDA graphs
    python benchmarks/h200/fp8kv.py llama {auto|fp8_e4m3} OUT_DIR
        Llama-3.1-8B shape (dummy bf16 weights): the KV pool's token capacity at mem_fraction 0.85,
        then batch-64 decode step time at 4k context (prefilled in 1024-token chunks)
Each `llama` call is its own process so the pool is sized from a fresh GPU."""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time

import torch

M = "benchmarks/model-configs/llama-3.1-8b"


def emit(out_dir: str, row: dict) -> None:
    print(json.dumps(row), flush=True)
    with open(os.path.join(out_dir, "fp8kv.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


def tiny(out_dir: str) -> None:
    from radixserve.config import Config
    from radixserve.model_runner import ModelRunner
    from radixserve.state import SamplingParams
    from radixserve.static_batch import run_static_batch
    from radixserve.testing import tiny_checkpoint
    from safetensors.torch import load_file, save_file

    path = tiny_checkpoint("llama", "/tmp/fp8kv-tiny", 0, head_dim=64, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=1024)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    # scales as an fp8 checkpoint ships them (~amax / 448: k, v reach ~7.5 here), read by the fp8 runner
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.02)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.02)
    save_file(tensors, file, metadata={"format": "pt"})
    rng = random.Random(0)
    # 257..320 tokens in 128-token chunks: 3 chunks each (a static batch's rule); chunks 2 and 3 read the
    # fp8 prefix through the extend kernel
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(257, 321))] for _ in range(16)]
    results = {}
    for kv in ("auto", "fp8_e4m3"):
        cfg = Config.build({"model": {"path": path}, "stack": {"attention": "triton"},
                            "runtime": {"device": "cuda", "dtype": "bfloat16", "kv_cache_dtype": kv},
                            "scheduler": {"max_total_tokens": 16384, "max_running_requests": 16}})
        runner = ModelRunner(cfg, show_progress=False)
        assert runner.kv_pool.dtype == (torch.float8_e4m3fn if kv != "auto" else torch.bfloat16)
        res = run_static_batch(runner, prompts, SamplingParams(temperature=0.0, ignore_eos=True), 32, keep_logits=True,
                               prefill_chunk=128)
        results[kv] = res
        emit(out_dir, {"test": "tiny_runner", "kv": kv, "scales": runner.kv_pool.k_scales[:2] + runner.kv_pool.v_scales[:2],
                       "used_cuda_graph": res.used_cuda_graph})
        del runner
        torch.cuda.empty_cache()
    same = top5 = 0
    first_diff = []
    for i in range(len(prompts)):
        a, b = results["fp8_e4m3"].output_ids[i], results["auto"].output_ids[i]
        la, lb = results["fp8_e4m3"].logits[i], results["auto"].logits[i]
        first_diff.append((la[0] - lb[0]).abs().max().item())
        j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if j is None:
            same += 1
            top5 += 1
        elif a[j] in lb[j].topk(5).indices.tolist() and b[j] in la[j].topk(5).indices.tolist():
            top5 += 1
    emit(out_dir, {"test": "tiny_greedy_fp8_vs_bf16", "prompts": len(prompts), "identical": same,
                   "top5_rule_holds": top5, "first_step_logit_maxdiff_max": round(max(first_diff), 4),
                   "first_step_logit_std": round(results["auto"].logits[0][0].std().item(), 3),
                   "pass": top5 == len(prompts)})


def llama(kv: str, out_dir: str) -> None:
    from radixserve.config import Config
    from radixserve.model_runner import ModelRunner
    from radixserve.state import SamplingParams
    from radixserve.static_batch import run_static_batch

    t0 = time.perf_counter()
    cfg = Config.build({"model": {"path": M, "load_format": "dummy", "context_length": 8192},
                        "stack": {"attention": "triton"},
                        "runtime": {"device": "cuda", "dtype": "bfloat16", "kv_cache_dtype": kv, "cuda_graph_max_bs": 64},
                        "scheduler": {"mem_fraction": 0.85, "max_running_requests": 64}})
    runner = ModelRunner(cfg, show_progress=False)
    emit(out_dir, {"test": "llama8b_kv_capacity", "kv": kv, "max_total_tokens": runner.max_total_tokens,
                   "kv_bytes_per_token": runner.kv_bytes_per_token(), "pool_gib": round(runner.kv_pool.nbytes() / 2**30, 2),
                   "startup_s": round(time.perf_counter() - t0, 1)})
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 30000) for _ in range(4096)] for _ in range(64)]
    res = run_static_batch(runner, prompts, SamplingParams(temperature=0.0, ignore_eos=True), 40, prefill_chunk=1024)
    steps = res.decode_step_s[8:]  # the first steps include one-time work
    emit(out_dir, {"test": "llama8b_decode_bs64_ctx4k", "kv": kv, "used_cuda_graph": res.used_cuda_graph,
                   "step_ms_median": round(1e3 * statistics.median(steps), 3), "step_ms_min": round(1e3 * min(steps), 3),
                   "prefill_s": round(res.prefill_s, 2), "steps": len(steps)})


if __name__ == "__main__":
    if sys.argv[1] == "tiny":
        tiny(sys.argv[2])
    else:
        llama(sys.argv[2], sys.argv[3])
