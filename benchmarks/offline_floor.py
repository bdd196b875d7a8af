#!/usr/bin/env python3
"""The floor of an offline run from what it moves, with the device's rates measured in the same run.

    python benchmarks/offline_floor.py --config-dir benchmarks/model-configs/llama-3.1-8b \
        --num-prompts 1000 --input-len 1024 --output-len 256 [--device cuda] [--out FILE]

Issue 18's offline target (1000 x 1024/256 on the Llama-3.1-8B shape) needs a limit stated from the
work the run really does. It has three parts that cannot hide behind each other in one forward:
- prefill: every prompt token through every linear layer (2 x the non-embedding parameters
  in FLOPs) plus causal attention over the prompt;
- decode GEMMs: every generated token through every linear layer and the LM head; at the batch
  sizes of an offline run (hundreds of rows) they are compute-bound, not weight-bound;
- decode attention: every generated token reads the KV of its whole context once per layer.
The rates are measured here, not taken from a spec sheet: bf16 GEMMs at the model's projection
shapes (prefill rows and decode rows), and device-to-device copy bandwidth. The floor is the sum
of the three parts at those rates; a run at that floor would compute and read nothing else and
overlap nothing. Prints one JSON line (and appends it to --out).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def head_dims(cfg: dict) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of an HF config."""
    heads = cfg["num_attention_heads"]
    return heads, cfg.get("num_key_value_heads", heads), cfg.get("head_dim") or cfg["hidden_size"] // heads


def linear_shapes(cfg: dict) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's projections, qkv and gate/up fused as the runtime runs them."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv, d = head_dims(cfg)
    return [(h, (heads + 2 * kv) * d), (heads * d, h), (h, 2 * inter), (inter, h)]


def gemm_tflops(rows: int, shapes: list[tuple[int, int]], device: str, dtype: torch.dtype, iters: int) -> float:
    """Achieved TFLOP/s of `rows x in @ in x out` over the layer's shapes (each timed, summed)."""
    total_flops, total_s = 0.0, 0.0
    for k, n in shapes:
        a = torch.randn(rows, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype)
        for _ in range(2):  # warm-up (cuBLAS heuristics, clocks)
            torch.nn.functional.linear(a, w)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            torch.nn.functional.linear(a, w)
        _sync(device)
        total_s += (time.perf_counter() - t0) / iters
        total_flops += 2.0 * rows * k * n
    return total_flops / total_s / 1e12


def copy_tb_s(device: str, nbytes: int, iters: int) -> float:
    """Bytes read + written per second by a device-to-device copy of `nbytes`."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        b.copy_(a)
    _sync(device)
    return 2 * nbytes / ((time.perf_counter() - t0) / iters) / 1e12


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def workload(cfg: dict, prompts: int, input_len: int, output_len: int, kv_bytes: int) -> dict:
    """FLOPs and bytes of the run (no rate involved)."""
    layers, h, vocab = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    heads, kv, d = head_dims(cfg)
    linear_params = layers * sum(k * n for k, n in linear_shapes(cfg))
    # causal attention: QK and PV, 2 FLOPs a multiply-add, query width heads*d, mean context (L+1)/2
    prefill_attn = 2 * 2 * layers * heads * d * (input_len + 1) / 2
    prefill_flops = prompts * input_len * (2 * linear_params + prefill_attn)
    generated = prompts * output_len
    decode_flops = generated * 2 * (linear_params + h * vocab)  # every generated row also runs the LM head
    mean_context = input_len + (output_len - 1) / 2  # the KV a decode step reads, on average
    kv_per_token = layers * 2 * kv * d * kv_bytes
    return {"prefill_flops": prefill_flops, "decode_gemm_flops": decode_flops,
            "decode_kv_bytes": generated * mean_context * kv_per_token,
            "total_tokens": prompts * (input_len + output_len)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config-dir", required=True)
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--prefill-rows", type=int, default=8192, help="rows of a prefill batch's GEMMs")
    ap.add_argument("--decode-rows", type=int, default=512, help="rows of a full decode batch's GEMMs")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--copy-bytes", type=int, default=2 * 1024**3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out")
    args = ap.parse_args()
    with open(f"{args.config_dir}/config.json") as f:
        cfg = json.load(f)
    dtype = torch.bfloat16
    shapes = linear_shapes(cfg)
    prefill_rate = gemm_tflops(args.prefill_rows, shapes, args.device, dtype, args.iters)
    decode_rate = gemm_tflops(args.decode_rows, shapes, args.device, dtype, args.iters)
    bandwidth = copy_tb_s(args.device, args.copy_bytes, args.iters)
    w = workload(cfg, args.num_prompts, args.input_len, args.output_len, kv_bytes=2)
    parts = {"prefill_s": w["prefill_flops"] / (prefill_rate * 1e12),
             "decode_gemm_s": w["decode_gemm_flops"] / (decode_rate * 1e12),
             "decode_kv_s": w["decode_kv_bytes"] / (bandwidth * 1e12)}
    floor_s = sum(parts.values())
    row = {
        "what": "offline floor", "config": args.config_dir, "device": torch.cuda.get_device_name()
        if args.device.startswith("cuda") else args.device,
        "workload": f"{args.num_prompts} x {args.input_len}/{args.output_len}",
        "gemm_tflops": {"prefill_rows": args.prefill_rows, "prefill": round(prefill_rate, 1),
                        "decode_rows": args.decode_rows, "decode": round(decode_rate, 1)},
        "copy_tb_s": round(bandwidth, 3),
        "pflop": {"prefill": round(w["prefill_flops"] / 1e15, 3), "decode_gemm": round(w["decode_gemm_flops"] / 1e15, 3)},
        "decode_kv_tb": round(w["decode_kv_bytes"] / 1e12, 2),
        "parts_s": {k: round(v, 2) for k, v in parts.items()},
        "floor_s": round(floor_s, 2), "floor_total_tok_s": round(w["total_tokens"] / floor_s, 1),
    }
    line = json.dumps(row)
    print(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
