"""Gemma's RMSNorm: the checkpoint stores w and the layer scales by (1 + w), all in fp32."""

from __future__ import annotations

from typing import Any

import torch
from radixserve.layers.norm import RMSNorm
from radixserve.layers.weight_utils import set_weight_attrs


class GemmaRMSNorm(RMSNorm):
    """`forward(x)` -> norm(x) * (1 + w); `forward(x, residual)` -> (that of x + residual, x + residual).

    The weight is kept in fp32 as 1 + w (added once, at load), so the product is the one
    transformers computes: statistics and the scale multiply in fp32, one cast to x's dtype at the
    end. fp32 activations take the core RMSNorm's fused kernels (same arithmetic); other dtypes
    the torch recipe below. Inputs of any rank; the last dim is normalised."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps, params_dtype=torch.float32)
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is not None or tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(f"norm weight: expected shape {tuple(param.shape)}, got {tuple(loaded.shape)}")
        param.data.copy_(loaded.float() + 1.0)

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        shape = x.shape
        if x.dtype == torch.float32:
            flat = x.reshape(-1, shape[-1])
            if residual is None:
                return super().forward(flat).view(shape)
            out, res = super().forward(flat, residual.reshape(-1, shape[-1]))
            return out.view(shape), res.view(shape)
        if residual is None:
            return self._scaled(x)
        x = x + residual
        return self._scaled(x), x
