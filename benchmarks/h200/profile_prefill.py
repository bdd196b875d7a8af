"""Where an offline prefill chunk's time goes (issue 18's offline gap: session 26 measured the 8B prefill at
39-42k prompt tok/s on an H100 against a floor of 54.6k from the GEMM rate measured in the same call).

    python benchmarks/h200/profile_prefill.py [--model benchmarks/model-configs/llama-3.1-8b] [--prompts 8]
        [--input-len 1024] [--attention triton,flashinfer] [--device cuda] [--out DIR]

For each attention backend: one runner (dummy bf16 weights, no CUDA graphs), a prefill of `prompts` x
`input-len` fresh tokens (the offline run's 8192-token chunk: 8 prompts of 1024), timed three times after a
warm-up on other ids, then once under torch's profiler. The kernels' device time is split by kind (GEMM,
attention, norm, rotary + KV store, activation, elementwise / copy, other) with `kernel_kind`; the chunk's GEMM
FLOPs (every projection of every layer for every token, the LM head for each prompt's last token) over the
GEMM kernels' time gives their rate, printed beside the bf16 GEMM rate measured here at the same rows and
shapes (`offline_floor.gemm_tflops`). The distance to the floor is then either the GEMMs' own (rate below
the measured one) or the other kinds' time. One JSON line per backend; profile_prefill.json under --out.
`triton:per-request` in --attention: the triton backend with one SDPA call per fresh prompt instead of one
varlen call a layer. `--device cpu` with a tiny checkpoint checks the script itself (CPU op times then, no kernels)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import statistics
import sys
from pathlib import Path

import torch

# ordered: the first kind whose pattern a kernel's name matches (lower-cased)
KINDS = [
    ("attention", r"attn|attention|flash|batchprefill|prefill_kernel|extend|fmha|fwd_kernel"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|s16816|sm90_|matmul|_mm_|linear|addmm"),
    ("norm", r"norm"),
    ("rotary_kv_store", r"rotary|rope|kv_store|store_kv|index_put|scatter"),
    ("activation", r"silu|gelu|act_and_mul|swiglu|_mul_kernel"),
    ("elementwise_copy", r"elementwise|copy|fill|cat_|vectorized|memcpy|memset|add_kernel|embedding|index_select"),
]


def kernel_kind(name: str) -> str:
    """The kind of a kernel (or CPU op) by its name: one of KINDS' names, else "other"."""
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "other"


def _floor_module():
    spec = importlib.util.spec_from_file_location("offline_floor", Path(__file__).resolve().parents[1] / "offline_floor.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def kernel_times(prof, device: str, per: int = 1) -> tuple[dict[str, float], list[tuple[float, str]]]:
    """A torch profile's device time (CPU op time off CUDA) in ms, divided by `per` (e.g. the steps
    profiled): by `kernel_kind`, and (ms, name) of every kernel."""
    by_kind: dict[str, float] = {}
    top: list[tuple[float, str]] = []
    for ev in prof.key_averages():
        us = ev.device_time_total if device == "cuda" else ev.self_cpu_time_total
        if us <= 0 or (device == "cuda" and ev.device_type != torch.autograd.DeviceType.CUDA):
            continue
        by_kind[kernel_kind(ev.key)] = by_kind.get(kernel_kind(ev.key), 0.0) + us / 1e3 / per
        top.append((us / 1e3 / per, ev.key))
    return by_kind, top


def profile_each(attentions: str, profile_one, rows: dict, out_path: str) -> dict:
    """`profile_one(attention)` for each comma-separated backend, one JSON line each (a backend that fails,
    e.g. not installed, is an error row: the others still run); all rows written to `out_path`."""
    for attention in attentions.split(","):
        try:
            rows[attention] = profile_one(attention)
        except Exception as e:
            rows[attention] = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps({attention: rows[attention]}), flush=True)
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(rows, f, indent=1)
    return rows


def chunk_gemm_flops(cfg: dict, prompts: int, input_len: int) -> float:
    """The chunk's GEMM FLOPs: every projection for every token, the LM head for each last token."""
    floor = _floor_module()
    per_token = sum(2 * i * o for i, o in floor.linear_shapes(cfg)) * cfg["num_hidden_layers"]
    return per_token * prompts * input_len + 2 * cfg["hidden_size"] * cfg["vocab_size"] * prompts


def _runner(model: str, device: str, attention: str, context: int):
    from radixserve.config import Config
    from radixserve.model_runner import ModelRunner

    dummy = os.path.isdir(model) and not any(f.endswith(".safetensors") for f in os.listdir(model))
    cfg = Config.build({
        "model": {"path": model, "load_format": "dummy" if dummy else "auto", "context_length": context},
        "runtime": {"device": device, "dtype": "bfloat16" if device == "cuda" else "float32", "cuda_graph": False},
        "stack": {"attention": attention},
        "scheduler": {"max_running_requests": 64, "max_total_tokens": 4 * context * 16},
    })
    return ModelRunner(cfg, show_progress=False)


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def profile_backend(args: argparse.Namespace, attention: str, cfg: dict) -> dict:
    """One row; `attention` is a stack name, or `triton:per-request` for the triton backend with its
    fresh prompts as one SDPA call each instead of one varlen call a layer (the A/B of `prefill_varlen`)."""
    from radixserve.static_batch import run_static_batch

    name, _, variant = attention.partition(":")
    runner = _runner(args.model, args.device, name, args.input_len + 16)
    if variant == "per-request":
        runner.attn_backend.prefill_varlen = False
    elif variant:
        raise ValueError(f"unknown variant {variant!r} of {name} (known: per-request)")
    varlen = getattr(runner.attn_backend, "prefill_varlen", None)
    vocab = cfg["vocab_size"]
    run_static_batch(runner, _prompts(args.prompts, args.input_len, vocab, seed=1), max_new_tokens=1)  # warm-up
    times = [run_static_batch(runner, _prompts(args.prompts, args.input_len, vocab, seed=2 + k), max_new_tokens=1)
             .prefill_s for k in range(3)]
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        run_static_batch(runner, _prompts(args.prompts, args.input_len, vocab, seed=9), max_new_tokens=1)
    by_kind, top = kernel_times(prof, args.device)
    tokens = args.prompts * args.input_len
    flops = chunk_gemm_flops(cfg, args.prompts, args.input_len)
    gemm_ms = by_kind.get("gemm", 0.0)
    row = {
        "attention": attention, "prefill_varlen": varlen, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "chunk_tokens": tokens, "prefill_ms": round(statistics.median(times) * 1e3, 2),
        "prompt_tok_s": round(tokens / statistics.median(times)),
        "kernel_ms_by_kind": {k: round(v, 2) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "kernel_ms_total": round(sum(by_kind.values()), 2),
        "gemm_tflops_in_chunk": round(flops / (gemm_ms / 1e3) / 1e12, 1) if gemm_ms else None,
        "top_kernels_ms": [[round(ms, 2), name[:90]] for ms, name in sorted(top, reverse=True)[:12]],
    }
    del runner
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="benchmarks/model-configs/llama-3.1-8b")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--attention", default="triton,flashinfer")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    with open(os.path.join(args.model, "config.json")) as f:
        cfg = json.load(f)
    rows = {}
    if args.device == "cuda":  # the GEMM rate at this chunk's rows and shapes, measured here
        floor = _floor_module()
        rate = floor.gemm_tflops(args.prompts * args.input_len, floor.linear_shapes(cfg), "cuda", torch.bfloat16, 20)
        rows["measured_gemm_tflops"] = round(rate, 1)
        print(json.dumps({"measured_gemm_tflops": rows["measured_gemm_tflops"]}), flush=True)
    profile_each(args.attention, lambda attention: profile_backend(args, attention, cfg), rows,
                 os.path.join(args.out, "profile_prefill.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
