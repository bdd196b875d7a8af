"""The native kernels over GGUF blocks kept as they are in the file (csrc/gguf_blocks.cpp).

A block weight is a uint8 tensor [rows, K / 32 * block bytes]: each row the file's bytes for that
row, unchanged. `linear` computes x @ W^T with the activation quantized to int8 or int16 per
32-block (AVX-512 VNNI or AVX2 integer dot products, chosen when the kernel is compiled for this CPU);
`embedding` and `dequantize` expand rows to fp32 exactly as `gguf.quants.dequantize` does.
Compiled on first use through `radixserve.native` (None when no compiler: callers dequantize)."""

from __future__ import annotations

from pathlib import Path

import torch
from radixserve import native

_SOURCE = Path(__file__).resolve().parent / "csrc" / "gguf_blocks.cpp"

# GGML type name -> (type id, bytes per 32-input block): the formats the kernels keep quantized
KEPT_TYPES = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}
BLOCK = 32


def load():
    """The compiled module, or None (no compiler, or RADIXSERVE_NATIVE=0)."""
    return native.load_extension("radixserve_gguf_blocks", _SOURCE)


_built = None  # the module once loaded (the per-call path skips the loader)


def _module():
    global _built
    if _built is not None:
        return _built
    module = load()
    if module is None:
        raise RuntimeError("the GGUF block kernels are not available (no C++ compiler, or RADIXSERVE_NATIVE=0); "
                           "serve with model.weight_source_options: {dequantize: true}")
    _built = module
    return module


def row_bytes(qtype: str, in_features: int) -> int:
    """Bytes of one weight row of `in_features` inputs in GGML type `qtype` (Q4_0, Q4_1, Q8_0)."""
    if qtype not in KEPT_TYPES:
        raise ValueError(f"GGML type {qtype!r} is not kept quantized (supported: {', '.join(KEPT_TYPES)})")
    if in_features % BLOCK:
        raise ValueError(f"{in_features} inputs are not a whole number of {BLOCK}-input blocks")
    return in_features // BLOCK * KEPT_TYPES[qtype][1]


ACTIVATION_BITS = {"int8": 8, "int16": 16}  # `activations` option -> the kernel's act_bits


def linear(x: torch.Tensor, blocks: torch.Tensor, qtype: str, act_bits: int = 8) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype, W the [N, K] weight held as `blocks` (uint8
    [N, K / 32 * block bytes]). Accumulates in fp32 over activations quantized per 32-block to
    `act_bits` (8 or 16): within that rounding of x (int8: about 0.4% of each block's largest
    value; int16: about 0.002%) of the fp32 product."""
    module = _built or _module()
    if x.dtype == torch.float32:  # the CPU serving path: no conversions (the kernel reshapes)
        return module.linear(x, blocks, KEPT_TYPES[qtype][0], act_bits)
    return module.linear(x.to(torch.float32), blocks, KEPT_TYPES[qtype][0], act_bits).to(x.dtype)


def dequantize(blocks: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """fp32 [N, in_features], equal bit for bit to gguf.quants.dequantize of the same bytes."""
    return _module().dequantize(blocks, KEPT_TYPES[qtype][0], in_features)


def embedding(ids: torch.Tensor, blocks: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """fp32 [*ids.shape, in_features]: the rows `ids` of the block weight, dequantized."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = _module().embedding(flat, blocks, KEPT_TYPES[qtype][0], in_features)
    return out.reshape(*ids.shape, in_features)


def isa() -> str:
    """The integer dot products of this build: "avx512_vnni", "avx2" or "scalar"."""
    return _module().isa()
