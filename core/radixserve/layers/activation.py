"""Activations of gated MLPs."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from radixserve.layers import cpu_ops, triton_ops


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> silu(gate) * up (one Triton kernel for CUDA tensors,
    one C++ kernel for fp32 CPU matrices)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton_ops.available(x):
            return triton_ops.silu_and_mul(x)
        if cpu_ops.available(x):
            return cpu_ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
