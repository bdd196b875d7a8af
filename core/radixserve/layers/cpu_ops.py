"""Fused fp32 CPU kernels for the per-token layers (csrc/cpu_ops.cpp): the CPU counterpart of
`triton_ops`. RMSNorm (+ residual add), SiLU-and-mul and rotary, each one pass over its rows
instead of a chain of small torch ops; and the greedy sampler's row-wise argmax (both cores).

The layers call in here when `available(...)` says every tensor is an fp32 CPU matrix with
contiguous rows and the extension is built (compiled on first use by `radixserve.native`; without
a compiler, or with RADIXSERVE_NATIVE=0, the layers keep their torch code). Outputs are fresh
tensors, never views of the inputs."""

from __future__ import annotations

from pathlib import Path

import torch

from radixserve import native

_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "cpu_ops.cpp"


def _kernels():
    return native.load_extension("radixserve_cpu_ops", _SOURCE)


def available(*tensors: torch.Tensor) -> bool:
    """True when every tensor is an fp32 CPU [rows, cols] matrix with contiguous rows and the
    kernels are built (the first call on a machine compiles them)."""
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != torch.float32 or t.dim() != 2 or t.stride(1) != 1:
            return False
    return _kernels() is not None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """norm(x), or (norm(x + residual), x + residual), as `RMSNorm.forward`."""
    if residual is None:
        return _kernels().rms_norm(x, weight, eps)
    return _kernels().add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] -> silu(gate) * up."""
    return _kernels().silu_and_mul(x)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for a [rows, cols] matrix (first index of the max; NaN wins)."""
    return _kernels().argmax_rows(x)


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           head_dim: int, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) with the first `rotary_dim` dims of every head rotated (neox), as
    `RotaryEmbedding._rotate`; cos/sin are the fp32 [max_position, rotary_dim] tables."""
    return _kernels().rotary(q, k, positions, cos, sin, head_dim, rotary_dim)
