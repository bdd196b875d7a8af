"""LongRoPE (Phi-3's "longrope", formerly "su"): per-frequency rescaling with a short and a long
factor list, and one attention factor on cos/sin.

transformers switches the whole sequence to the long factors once it grows past
`original_max_position_embeddings` (so one sequence's early keys were rotated with the short factors
and later ones with the long). Here the choice is per position, fixed for the cache: positions below
the original length use the short factors, the rest the long ones (vLLM's and SGLang's choice). Up
to the original length both agree exactly."""

from __future__ import annotations

import math
from typing import Any

import torch
from radixserve.layers.rotary import RotaryEmbedding


def _scaled_inv_freq(base: float, dim: int, factors: list[float]) -> torch.Tensor:
    if len(factors) != dim // 2:
        raise ValueError(f"longrope factor list has {len(factors)} entries; the rotary dim {dim} needs {dim // 2}")
    ext = torch.tensor(factors, dtype=torch.float32)
    return 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


class LongRoPE(RotaryEmbedding):
    """`RotaryEmbedding` with LongRoPE frequencies; `params` is the config's rope_parameters."""

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, params: dict[str, Any],
                 original_max_position: int) -> None:
        base = float(params["rope_theta"])
        super().__init__(head_dim, rotary_dim, max_position, {"rope_type": "default", "rope_theta": base})
        self.original_max_position = int(original_max_position)
        self.inv_freq.copy_(_scaled_inv_freq(base, rotary_dim, params["short_factor"]))
        self.register_buffer("long_inv_freq", _scaled_inv_freq(base, rotary_dim, params["long_factor"]), persistent=False)
        factor = params.get("factor") or max_position / self.original_max_position
        scaling = params.get("attention_factor")
        if scaling is None:
            scaling = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(self.original_max_position))
        self.attention_scaling = float(scaling)

    def _build(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(n, dtype=torch.float32, device=device)[:, None]
        short = t * self.inv_freq.to(device, torch.float32)[None, :]
        long = t * self.long_inv_freq.to(device, torch.float32)[None, :]
        freqs = torch.where(t < self.original_max_position, short, long)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def reserve(self, n: int, device: torch.device, shared: dict | None = None) -> None:
        # the shared-cache key covers the short frequencies only: keep LongRoPE caches apart
        key = ("longrope", self.original_max_position, tuple(self.long_inv_freq.tolist()))
        super().reserve(n, device, None if shared is None else shared.setdefault(key, {}))
