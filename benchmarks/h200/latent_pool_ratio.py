"""Tokens per GB of a latent (MLA) KV pool against an uncompressed pool of the same model.

Latent: one row of kv_lora_rank + qk_rope_head_dim values per token and layer. Uncompressed: the
per-head keys (qk_nope_head_dim + qk_rope_head_dim) and values (v_head_dim) a standard KV pool would
hold for the same heads. With --offline-result (an offline_throughput.py JSON line) it also reports
the slots the Engine really allocated and the memory they take.

    python benchmarks/h200/latent_pool_ratio.py benchmarks/model-configs/deepseek-v2-lite [--offline-result F]
"""

from __future__ import annotations

import argparse
import json


def bytes_per_token(cfg: dict, elem: int = 2) -> tuple[int, int]:
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    latent = layers * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * elem
    full = layers * heads * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"]) * elem
    return latent, full


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("config_dir")
    ap.add_argument("--offline-result")
    args = ap.parse_args()
    cfg = json.load(open(f"{args.config_dir}/config.json"))
    latent, full = bytes_per_token(cfg)
    row = {"model": args.config_dir, "latent_bytes_per_token": latent, "uncompressed_bytes_per_token": full,
           "latent_tokens_per_gb": round(1e9 / latent), "uncompressed_tokens_per_gb": round(1e9 / full),
           "ratio": round(full / latent, 2)}
    if args.offline_result:
        try:
            stats = json.loads(open(args.offline_result).readlines()[-1])["stats"]
            slots = int(stats["max_total_tokens"])
            row.update(engine_slots=slots, engine_pool_gb=round(slots * latent / 1e9, 2),
                       same_memory_uncompressed_slots=slots * latent // full)
        except (OSError, IndexError, KeyError, ValueError) as e:
            row["offline_result_error"] = repr(e)
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
