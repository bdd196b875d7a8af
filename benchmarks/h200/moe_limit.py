"""The batch-1 decode limit of an MoE model: the bytes one decode step reads, over the HBM
bandwidth measured in the same run (device-to-device copy, read + write).

A batch-1 step reads: per layer (DeepSeek's latent attention: q, kv_a, kv_b and o projections) the attention weights (qkv, o, q/k norms), the router, the
weights of the top_k experts the token is routed to (not all experts), any shared expert or
dense MLP, the two norms; then the final norm, the LM head, and one embedding row. KV-cache reads
are left out (small at batch 1 and short contexts), so the limit is a floor on the step time.

    python benchmarks/h200/moe_limit.py benchmarks/model-configs/qwen3-30b-a3b [--measured-tok-s X]

Prints one JSON line: bytes per step, bandwidth, the floor in ms/step and tok/s, and with
--measured-tok-s the fraction of the limit reached."""

from __future__ import annotations

import argparse
import json

import torch


def _deepseek_step_bytes(cfg: dict) -> dict[str, int]:
    """DeepSeek-V2/V3 (latent attention, shared experts, dense first layers), in parameters."""
    h, layers, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    nope, rope, v, lora = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    q_lora = cfg.get("q_lora_rank")
    q = h * heads * (nope + rope) if not q_lora else h * q_lora + q_lora + q_lora * heads * (nope + rope)
    attn = q + h * (lora + rope) + lora + lora * heads * (nope + v) + heads * v * h
    first_dense, freq = cfg.get("first_k_dense_replace", 0), cfg.get("moe_layer_freq", 1) or 1
    sparse = [i for i in range(layers) if i >= first_dense and i % freq == 0]
    inter, top_k = cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
    return {
        "attention": layers * attn,
        "routed_experts_active": len(sparse) * (cfg["n_routed_experts"] * h + top_k * 3 * h * inter),
        "shared_experts": len(sparse) * cfg.get("n_shared_experts", 0) * 3 * h * inter,
        "dense_mlp": (layers - len(sparse)) * 3 * h * cfg["intermediate_size"],
        "norms": layers * 2 * h + h, "lm_head": cfg["vocab_size"] * h, "embedding_row": h,
    }


def step_bytes(cfg: dict, elem: int = 2) -> dict[str, int]:
    """Parameter bytes one batch-1 decode step reads, by part."""
    if "kv_lora_rank" in cfg:
        return {k: n * elem for k, n in _deepseek_step_bytes(cfg).items()}
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or h // heads
    attn = h * (heads + 2 * kv) * hd + heads * hd * h + (2 * hd if cfg.get("model_type") == "qwen3_moe" else 0)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    top_k = cfg["num_experts_per_tok"]
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense_layers = set(cfg.get("mlp_only_layers") or [])
    sparse = [i for i in range(layers) if i not in dense_layers and (i + 1) % step == 0]
    routed = len(sparse) * (experts * h + top_k * 3 * h * inter)
    shared = len(sparse) * (3 * h * cfg.get("shared_expert_intermediate_size", 0) + h)  # + its gate
    if not cfg.get("shared_expert_intermediate_size"):
        shared = 0
    dense = (layers - len(sparse)) * 3 * h * cfg["intermediate_size"]
    parts = {
        "attention": layers * attn, "routed_experts_active": routed, "shared_experts": shared, "dense_mlp": dense,
        "norms": layers * 2 * h + h, "lm_head": cfg["vocab_size"] * h, "embedding_row": h,
    }
    return {k: v * elem for k, v in parts.items()}


def hbm_bandwidth() -> float:
    n = 2 * 1024**3
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    return 2 * n / (start.elapsed_time(end) / 1e3 / 20)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("config_dir")
    ap.add_argument("--measured-tok-s", type=float)
    ap.add_argument("--bandwidth", type=float, help="bytes/s (default: measured now)")
    args = ap.parse_args()
    cfg = json.load(open(f"{args.config_dir}/config.json"))
    parts = step_bytes(cfg)
    total = sum(parts.values())
    bw = args.bandwidth or hbm_bandwidth()
    row = {"model": args.config_dir, "bytes_per_step": total, "parts": parts, "hbm_bytes_per_s": round(bw),
           "floor_ms_per_step": round(total / bw * 1e3, 3), "limit_tok_s": round(bw / total, 1)}
    if args.measured_tok_s:
        row["measured_tok_s"] = args.measured_tok_s
        row["fraction_of_limit"] = round(args.measured_tok_s / (bw / total), 3)
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
