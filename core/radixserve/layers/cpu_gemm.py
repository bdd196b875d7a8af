"""fp32 CPU matmuls through weights packed once at load.

Why: batched decode and prefill GEMMs on CPU stream every weight from DRAM each step. The native
kernel (csrc/gemm.cpp, AVX2 + FMA, compiled on first use by `radixserve.native`) packs a weight
into 24-column panels and streams them in memory order with prefetch; on the 2-core CI machine,
SmolLM2 shapes, 64 rows, it takes ~20% less time than oneDNN's packed GEMM, which in turn beats
the default MKL path (~12% on the decoder linears, ~35% on the 49k-row LM head), and it is not
slower for one row. Without the native kernel (no compiler or no AVX2) oneDNN's packed copy
serves 16+ rows and MKL the rest. Either way a second copy of each weight is kept (the price)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from radixserve import native

MIN_ONEDNN_ROWS = 16  # below this the plain MKL GEMM beats oneDNN's packed one
_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "gemm.cpp"


@dataclass(frozen=True)
class PackedWeight:
    """A [out, in] fp32 weight in one packed layout: `panels` for the native kernel, or `onednn`.
    `silu_gated`: the panels interleave a [gate; up] weight for `silu_gated_linear` (out_features
    is then I, the activation's width); plain `linear` does not read them."""

    out_features: int
    panels: torch.Tensor | None = None
    onednn: torch.Tensor | None = None
    silu_gated: bool = False


def _native_gemm():
    return native.load_extension("radixserve_cpu_gemm", _SOURCE)


def _native_gemm_for_packing():
    """The native module where it can run here (built, and with AVX2); packing decides once, so
    the per-call paths only meet panels that the kernel can use."""
    module = _native_gemm()
    return module if module is not None and module.available() else None


def pack(weight: torch.Tensor) -> PackedWeight | None:
    """The packed copy of a [out, in] fp32 CPU weight; None where packing does not apply."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    gemm = _native_gemm_for_packing()
    if gemm is not None:
        return PackedWeight(weight.shape[0], panels=gemm.pack(weight.detach()))
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if not torch.backends.mkldnn.is_available() or reorder is None:
        return None
    return PackedWeight(weight.shape[0], onednn=reorder(weight.detach(), 64))  # 64: batch-size hint


def pack_silu_gated(weight: torch.Tensor) -> PackedWeight | None:
    """For a [gate; up] weight that feeds SiluAndMul: panels for `silu_gated_linear`, or else what
    `pack` gives (no native kernel)."""
    gemm = _native_gemm_for_packing() if weight.device.type == "cpu" and weight.dtype == torch.float32 else None
    if gemm is None or weight.dim() != 2 or weight.shape[0] % 2:
        return pack(weight)
    return PackedWeight(weight.shape[0] // 2, panels=gemm.pack_gated(weight.detach()), silu_gated=True)


def _applies(x: torch.Tensor, packed: PackedWeight | None) -> bool:
    return packed is not None and x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu"


def silu_gated_linear(x: torch.Tensor, packed: PackedWeight | None) -> torch.Tensor | None:
    """silu(x @ gate^T) * (x @ up^T) in one kernel (the activation applied in the GEMM epilogue);
    None when `packed` is not a silu-gated packing or x does not fit the kernel."""
    if not (_applies(x, packed) and packed.silu_gated):
        return None
    return _native_gemm().linear_silu_mul(x if x.stride(1) == 1 else x.contiguous(), packed.panels,
                                          packed.out_features)


def linear(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None, bias: torch.Tensor | None = None):
    """F.linear(x, weight, bias), through `packed` where it applies."""
    if _applies(x, packed) and not packed.silu_gated:
        if packed.panels is not None:
            y = _native_gemm().linear(x if x.stride(1) == 1 else x.contiguous(), packed.panels, packed.out_features)
            return y if bias is None else y.add_(bias)
        if packed.onednn is not None and x.shape[0] >= MIN_ONEDNN_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], "")
    return F.linear(x, weight, bias)
