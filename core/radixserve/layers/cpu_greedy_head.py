"""Greedy next tokens from an fp32 output projection without the full fp32 logits (CPU).

Why: in batched CPU decode the LM head is the largest GEMM (a fifth of a SmolLM2 step), and a
greedy row only needs argmax(x @ W^T). Where the CPU has AVX-512, csrc/greedy_head.cpp runs
the head over bf16 weights (half the bytes; products as cpu_gemm's bf16 panels: vdpbf16ps or the
weights widened to fp32, whichever is faster here; widened without AVX-512 BF16), proves which
vocabulary rows can still be the maximum (an error bound per row, see the C++ file), and computes only those in fp32: the token
is the fp32 argmax, first index on ties, as torch.argmax of fp32 logits (which differ from these
only by fp32 rounding order, like any two fp32 GEMMs). Elsewhere `pack` returns None and callers
compute logits as before. Costs a bf16 copy of the weight (half its fp32 size)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from radixserve import native
from radixserve.layers import cpu_gemm

_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "greedy_head.cpp"


@dataclass(frozen=True)
class GreedyHead:
    """The bf16 panels and fp32 row norms of one [vocab, hidden] weight, for `argmax`; `widen`: the
    screen widens the weights to fp32 instead of vdpbf16ps (cpu_gemm.bf16_products_widened)."""

    panels: torch.Tensor
    row_norms: torch.Tensor
    widen: bool = False


def _module():
    module = native.load_extension("radixserve_cpu_greedy_head", _SOURCE)
    return module if module is not None and module.available() else None


def pack(weight: torch.Tensor, widen: bool | None = None) -> GreedyHead | None:
    """The screening copy of a [vocab, hidden] fp32 CPU weight with finite values, screened the way
    `widen` says (None: cpu_gemm.bf16_products_widened()); None where the kernel cannot run here
    (no AVX-512, no compiler, another dtype or device)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    if not bool(torch.isfinite(weight).all()):
        return None
    module = _module()
    if module is None:
        return None
    panels, norms = module.pack(weight.detach())
    if widen is None:  # this process's choice; a build without vdpbf16ps can only widen (even with no native GEMM)
        widen = cpu_gemm.bf16_products_widened() or not module.dot_available()
    return GreedyHead(panels, norms, widen)


def argmax(x: torch.Tensor, weight: torch.Tensor, head: GreedyHead) -> torch.Tensor | None:
    """torch.argmax(x @ weight^T, dim=-1) for fp32 CPU rows x [rows, hidden] (int64 [rows]);
    None when x does not fit the kernel."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or not weight.is_contiguous():
        return None
    return _module().argmax(x if x.stride(1) == 1 else x.contiguous(), head.panels, head.row_norms, weight, head.widen)
