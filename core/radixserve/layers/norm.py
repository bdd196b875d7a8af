"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
import torch.nn as nn

from radixserve.layers import cpu_ops, triton_ops


class RMSNorm(nn.Module):
    """`forward(x)` -> norm(x); `forward(x, residual)` -> (norm(x + residual), x + residual).

    Statistics are computed in fp32 and the result is cast back to x's dtype before the weight
    multiply, matching HF Llama so fp32/bf16 outputs agree with transformers. CUDA tensors take one
    fused Triton kernel with the same recipe (`triton_ops.rmsnorm`); fp32 CPU matrices one fused C++
    kernel (`cpu_ops.rmsnorm`); anything else the torch code below."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=params_dtype or torch.get_default_dtype()), requires_grad=False
        )

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        var = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(var + self.eps)).to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if triton_ops.available(x) and (residual is None or residual.dtype == x.dtype):
            return triton_ops.rmsnorm(x, self.weight, self.eps, residual)
        if self.weight.dtype == torch.float32 and cpu_ops.available(x, *(() if residual is None else (residual,))):
            return cpu_ops.rmsnorm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
