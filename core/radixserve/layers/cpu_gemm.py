"""fp32 CPU matmuls through oneDNN-packed weights.

Why: for the many-row GEMMs of batched decode and prefill, oneDNN with a weight reordered once into
its blocked layout beats the default MKL path on this project's CPUs (measured on the 2-core CI
machine, SmolLM2 shapes, 64 rows: decoder linears ~12% faster, the 49k-row LM head ~35%). For a
handful of rows MKL is faster, so both copies are kept and the row count picks one (the price is
a second copy of every linear weight in memory)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

MIN_ROWS = 16  # below this the plain MKL GEMM wins


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-packed copy of a [out, in] fp32 CPU weight; None where packing does not apply."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if reorder is None:
        return None
    return reorder(weight.detach(), 64)  # 64: the batch-size hint for the blocked layout


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None, bias: torch.Tensor | None = None):
    """F.linear(x, weight, bias), through `packed` when x has enough rows."""
    if packed is not None and x.dim() == 2 and x.shape[0] >= MIN_ROWS and x.dtype == torch.float32:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)
