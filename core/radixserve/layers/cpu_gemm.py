"""fp32 CPU matmuls through weights packed once at load.

Why: batched decode and prefill GEMMs on CPU stream every weight from DRAM each step. The native
kernel (csrc/gemm.cpp, AVX2 + FMA, compiled on first use by `radixserve.native`) packs a weight
into 24-column panels and streams them in memory order with prefetch; on the 2-core CI machine,
SmolLM2 shapes, 64 rows, it takes ~20% less time than oneDNN's packed GEMM, which in turn beats
the default MKL path (~12% on the decoder linears, ~35% on the 49k-row LM head), and it is not
slower for one row. Without the native kernel (no compiler or no AVX2) oneDNN's packed copy
serves 16+ rows and MKL the rest. Either way a second copy of each weight is kept (the price).

runtime.cpu_matmul_precision=medium (`lower_precision`): wherever the native kernel runs (AVX2 and
up) the panels are converted to bf16 once at load (half the weight bytes). Where vdpbf16ps is the
faster product (Zen 4: twice the fp32 FMA's FLOP rate) each call rounds x to bf16 and sums the bf16
products in fp32, as torch's "medium" float32 matmul precision allows; where it is the slower one
(Intel Sapphire and Emerald Rapids: half the FMA's rate) or missing (no AVX-512 BF16: Ice Lake,
Skylake-SP, AVX2-only CPUs), x stays fp32 and the weights are widened to fp32 in the kernel
(`bf16_products_widened`, measured once per process; the AVX2 kernel widens a K block at a time
into L1). The LM head's logits come from the same products (fp32 results); norms, attention, the KV cache, sampling and the greedy head's exact
argmax stay fp32.

On a CPU with AMX (bf16 tiles: Sapphire Rapids and later Xeons) the decoder's linears of `medium` run on the
tiles instead (csrc/amx_gemm.cpp, `PackedWeight.amx`): x rounded to bf16 as vdpbf16ps takes it, products summed
in fp32, fp32 results, each row in the same order whatever the batch (oneDNN's bf16 GEMM, 3.5x the panels at 512
rows here, picks its blocking by the row count, so a request's tokens would depend on its batch). The LM head
and the routed experts take tiles too (the logits the same fp32 sums; the greedy screen then keeps panels of its
own)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from radixserve import native

logger = logging.getLogger(__name__)

MIN_ONEDNN_ROWS = 16  # below this the plain MKL GEMM beats oneDNN's packed one
_AMX_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "amx_gemm.cpp"
_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "gemm.cpp"


@dataclass(frozen=True)
class PackedWeight:
    """A [out, in] fp32 weight in one packed layout: `panels` for the native kernel, or `onednn`.
    `silu_gated`: the panels interleave a [gate; up] weight for `silu_gated_linear` (out_features
    is then I, the activation's width); plain `linear` does not read them. `widen`: bf16 panels
    multiply fp32 x with the weights widened to fp32 instead of vdpbf16ps (`to_bf16`). `amx`: the weight
    as bf16 AMX tiles (`to_amx`), used instead of panels (a gated one interleaves its gate and up blocks)."""

    out_features: int
    panels: torch.Tensor | None = None  # fp32 [P, K, NR], or bf16 pairs [P, ceil(K / 2), NR, 2] as int16
    onednn: torch.Tensor | None = None
    silu_gated: bool = False
    widen: bool = False
    amx: torch.Tensor | None = None

    @property
    def bf16(self) -> bool:
        return self.amx is not None or (self.panels is not None and self.panels.dtype == torch.int16)


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


def _amx_gemm():
    return native.load_extension("radixserve_cpu_amx", _AMX_SOURCE)


def _applies(x: torch.Tensor, packed: PackedWeight | None) -> bool:
    return packed is not None and x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu"


def silu_gated_linear(x: torch.Tensor, packed: PackedWeight | None) -> torch.Tensor | None:
    """silu(x @ gate^T) * (x @ up^T) in one kernel (the activation applied in the GEMM epilogue);
    None when `packed` is not a silu-gated packing or x does not fit the kernel."""
    if not (_applies(x, packed) and packed.silu_gated):
        return None
    x = x if x.stride(1) == 1 else x.contiguous()
    if packed.amx is not None:
        return _amx_gemm().linear(x, packed.amx, packed.out_features, True)
    return _native_gemm().linear_silu_mul(x, packed.panels, packed.out_features, packed.widen)


def linear(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None, bias: torch.Tensor | None = None):
    """F.linear(x, weight, bias), through `packed` where it applies."""
    if _applies(x, packed) and not packed.silu_gated:
        if packed.amx is not None or packed.panels is not None:
            x = x if x.stride(1) == 1 else x.contiguous()
            y = (_amx_gemm().linear(x, packed.amx, packed.out_features, False) if packed.amx is not None
                 else _native_gemm().linear(x, packed.panels, packed.out_features, packed.widen))
            return y if bias is None else y.add_(bias)
        if packed.onednn is not None and x.shape[0] >= MIN_ONEDNN_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], "")
    return F.linear(x, weight, bias)


def bf16_available() -> bool:
    """Whether the native kernel here can run bf16 panels (it runs here: AVX2 and a compiler; without
    AVX-512 BF16 they are always widened)."""
    gemm = _native_gemm_for_packing()
    return gemm is not None and gemm.bf16_available()


@cache
def bf16_products_widened() -> bool:
    """Whether bf16 panels are multiplied by widening the weights to fp32 here (fp32 FMAs on fp32 x)
    rather than by vdpbf16ps on x rounded to bf16: measured once per process on this core
    (gemm.cpp's dot_to_fma_rate); vdpbf16ps where it does more FLOPs a second than the FMA, widened
    where it does fewer or the build has none (rate 0: no AVX-512 BF16)."""
    if not bf16_available():  # no native GEMM here: no bf16 panels, nothing to choose
        return False
    return _dot_to_fma_rate() < 1.0


@cache
def _dot_to_fma_rate() -> float:
    return _native_gemm().dot_to_fma_rate()


def bf16_product_description() -> str:
    """How bf16 panels are multiplied here and why, for the start-up log of runtime.cpu_matmul_precision=medium
    (the greedy screen's choice under `highest` is not worth a line: its answers are the fp32 argmax either way)."""
    if not bf16_available():
        return "no bf16 panels here (no native GEMM)"
    widened = bf16_products_widened()
    rate = _dot_to_fma_rate()
    why = (f"vdpbf16ps does {rate:.2f}x the fp32 FMA's FLOPs a second on this CPU" if rate > 0
           else "this CPU has no AVX-512 BF16 (no vdpbf16ps)")
    products = why + ", so the products " + ("widen the weights to fp32 and keep the inputs fp32 (fp32 FMAs)" if widened
                                              else "round the inputs to bf16 for vdpbf16ps (fp32 sums)")
    if amx_available():
        products += "; the linears and the LM head run on this CPU's AMX tiles (bf16 inputs, fp32 sums)"
    return products


@cache
def amx_available() -> bool:
    """Whether bf16 GEMMs run on AMX tiles here: the CPU has AMX-BF16 (Linux lists `amx_bf16`), the
    kernel was built with it and the process was granted the tile state; then `lower_precision`
    moves the decoder's linears onto the tiles."""
    if not _cpu_has_amx_bf16():
        return False
    module = _amx_gemm()
    return module is not None and module.available()


def _cpu_has_amx_bf16() -> bool:
    try:
        with open("/proc/cpuinfo", "rb") as f:
            flags = next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return False
    return b" amx_bf16" in flags and b" amx_tile" in flags


def amx_tiles(weight: torch.Tensor, silu_gated: bool = False) -> torch.Tensor | None:
    """An fp32 [N, K] weight as the AMX kernel's bf16 tiles, int16 [N/16, K/32, 16, 16, 2] (element
    [b, k, p, n, j] is W[16 b + n, 32 k + 2 p + j]); a gated [gate; up] one with gate block i and up
    block i adjacent. None where the kernel cannot take the shape (K not a multiple of 32, N of 16 or
    of 32 when gated)."""
    n, k = weight.shape
    if k % 32 or n % (32 if silu_gated else 16):
        return None
    w = weight.detach()
    if silu_gated:  # [gate; up] -> gate block 0, up block 0, gate block 1, ...
        w = w.reshape(2, n // 32, 16, k).transpose(0, 1).reshape(n, k)
    w = w.to(torch.bfloat16).view(torch.int16)
    return w.reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def to_amx(packed: PackedWeight, weight: torch.Tensor) -> PackedWeight | None:
    """`packed`'s weight (`weight`: its plain [out, in] matrix, [gate; up] when gated) on AMX tiles
    instead of panels; None where the kernel cannot take its shape (the panels stay)."""
    tiles = amx_tiles(weight, packed.silu_gated)
    return None if tiles is None else replace(packed, panels=None, onednn=None, widen=False, amx=tiles)


def to_bf16(packed: PackedWeight, widen: bool | None = None) -> PackedWeight:
    """`packed` with its fp32 panels converted to bf16 (a gated packing stays gated), multiplied
    the way `widen` says (None: `bf16_products_widened()`); anything else (oneDNN, already bf16)
    unchanged. Callers check `bf16_available` first."""
    if packed.panels is None or packed.bf16:
        return packed
    widen = bf16_products_widened() if widen is None else widen
    return replace(packed, panels=_native_gemm().to_bf16_panels(packed.panels), widen=widen)


def _screen_panels(module: torch.nn.Module, packed: PackedWeight) -> PackedWeight | None:
    """An LM head's bf16 panels, where its greedy screen (cpu_greedy_head) already holds them: the
    same bits in the same layout (bf16_panels.h), so one copy serves both."""
    screen = getattr(module, "greedy_head", None)
    fp32 = packed.panels
    if screen is None or packed.silu_gated or screen.panels.shape != (fp32.shape[0], (fp32.shape[1] + 1) // 2,
                                                                         fp32.shape[2], 2):
        return None
    return replace(packed, panels=screen.panels, widen=screen.widen)


def lower_precision(model: torch.nn.Module, amx: bool | None = None) -> int:
    """runtime.cpu_matmul_precision=medium for a loaded CPU model: every native fp32 packing held by
    its modules (`packed_weight`, and the routed experts' `packed_experts`) becomes bf16: a linear's,
    LM head's or expert's AMX tiles where `amx` (None: `amx_available()`) and its shape allows, else bf16
    panels. Returns how many weights were converted; 0, with a warning, where the native GEMM does
    not run here."""
    if not bf16_available():
        logger.warning("runtime.cpu_matmul_precision=medium: the native CPU GEMM does not run here (it needs AVX2 "
                       "and a C++ compiler; bf16 panels are its own), so the GEMMs stay fp32")
        return 0
    amx = amx_available() if amx is None else amx
    converted = 0
    for module in model.modules():
        packed = getattr(module, "packed_weight", None)
        if isinstance(packed, PackedWeight) and packed.panels is not None and not packed.bf16:
            tiles = to_amx(packed, module.weight) if amx and _takes_amx(module, packed) else None
            module.packed_weight = tiles or _screen_panels(module, packed) or to_bf16(packed)
            converted += 1
        experts = getattr(module, "packed_experts", None)
        if experts is not None:  # (gate_up packings, down packings), one per expert
            plain = (getattr(module, "w13_weight", None), getattr(module, "w2_weight", None)) if amx else (None, None)
            module.packed_experts = tuple([(w is not None and to_amx(p, w[e])) or to_bf16(p) for e, p in enumerate(group)]
                                          for group, w in zip(experts, plain, strict=True))
            converted += sum(len(group) for group in experts)
    return converted


def _takes_amx(module: torch.nn.Module, packed: PackedWeight) -> bool:
    """A linear (or LM head) whose plain weight is the packing's matrix."""
    weight = getattr(module, "weight", None)
    rows = packed.out_features * (2 if packed.silu_gated else 1)
    return (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype == torch.float32
            and weight.shape[0] == rows)
