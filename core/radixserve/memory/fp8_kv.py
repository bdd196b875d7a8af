"""FP8 (e4m3) storage of the KV cache: the quantize and dequantize rules every backend shares.

A value x of layer l is stored as `fp8(clamp(x / scale_l, -448, 448))` and read back as
`stored.float() * scale_l`. The clamp saturates explicitly: e4m3fn has no infinity, and how a cast
treats values past its largest finite value (448) depends on the converter (saturate or NaN); a
NaN key would poison every later softmax. Added in plugin API 1.5."""

from __future__ import annotations

import re

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0

KV_CACHE_DTYPES = {"fp8_e4m3": FP8_KV_DTYPE, "bfloat16": torch.bfloat16}  # runtime.kv_cache_dtype -> pool dtype
"""`runtime.kv_cache_dtype` values other than "auto" (the model dtype) and the pool dtype they select."""


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """`x / scale`, saturated to [-448, 448], as float8_e4m3fn (computed in fp32: one rounding)."""
    y = x.float()
    if scale != 1.0:
        y = y / scale
    return y.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def dequantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """`x.float() * scale` in `dtype` (the inverse of `quantize_fp8` up to its rounding)."""
    y = x.float()
    if scale != 1.0:
        y = y * scale
    return y.to(dtype)


# Checkpoint names of per-layer KV scales (HF / vLLM fp8 checkpoints): `...layers.N.self_attn.k_scale`
# and `.v_scale` (current), `.kv_scale` (one scale for both, older), or the k/v projections'
# `output_scale` (AutoFP8-era).
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_SUFFIXES = {
    ".k_scale": ("k",), ".v_scale": ("v",), ".kv_scale": ("k", "v"),
    ".k_proj.output_scale": ("k",), ".v_proj.output_scale": ("v",),
}


def kv_scale_target(name: str) -> tuple[int, tuple[str, ...]] | None:
    """(layer index, ("k",) / ("v",) / ("k", "v")) when checkpoint tensor `name` is a KV-cache scale
    of an attention layer, else None."""
    for suffix, which in _SUFFIXES.items():
        if name.endswith(suffix) and ".self_attn." in name:
            m = _LAYER.search(name)
            if m is not None:
                return int(m.group(1)), which
    return None


class KVScaleCollector:
    """Takes the KV-cache scales out of a checkpoint's weight stream (the model has no parameter for
    them) and keeps them per layer: `filter(weights)` yields every other tensor unchanged."""

    def __init__(self) -> None:
        self.k: dict[int, float] = {}
        self.v: dict[int, float] = {}

    def filter(self, weights):
        for name, tensor in weights:
            target = kv_scale_target(name)
            if target is None:
                yield name, tensor
                continue
            layer, which = target
            if tensor.numel() != 1:
                raise ValueError(f"checkpoint tensor {name!r}: a KV-cache scale must be one value (per-tensor), got "
                                 f"shape {tuple(tensor.shape)}")
            value = float(tensor.float().reshape(()))
            if not value > 0 or value == float("inf"):
                raise ValueError(f"checkpoint tensor {name!r}: a KV-cache scale must be positive and finite, got {value}")
            for w in which:
                (self.k if w == "k" else self.v)[layer] = value

    def scales(self, num_layers: int) -> tuple[list[float], list[float]]:
        """Per-layer (k scales, v scales); 1.0 for a layer the checkpoint gives none."""
        return ([self.k.get(i, 1.0) for i in range(num_layers)], [self.v.get(i, 1.0) for i in range(num_layers)])

    def __bool__(self) -> bool:
        return bool(self.k or self.v)
