"""The GGUF linears for the core's flat decoder layer (radixserve.layers.flat_decoder).

At batch 1 the quantized GEMVs of SmolLM2 take only about half of a decode step; most of the rest
is Python around them. The core runs a plain Llama layer as one flat function over the kernels its
linears name; this module names them for GGUF layers: the block kernel for kept blocks (the
gate/up projection followed by the fused silu-and-mul kernel, as `MergedColumnParallelLinear.
forward_silu_and_mul` runs it without packed panels), the core's packed fp32 linear for a
dequantized file. Same kernels, same order, same bits as the module calls."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
from radixserve.layers import cpu_ops, flat_decoder

from radixserve_quant_gguf import kernels

logger = logging.getLogger(__name__)


def _blocks_silu_and_mul(x: torch.Tensor, gemm, ops, blocks: torch.Tensor, type_id: int, act_bits: int) -> torch.Tensor:
    return ops.silu_and_mul(gemm.linear(x, blocks, type_id, act_bits))


def gguf_linear(linear: nn.Module, silu_gated: bool) -> flat_decoder.LinearCall | None:
    """A `flat_decoder.BindLinear` for the GGUF method's linears: kept blocks through the block
    kernel, dequantized weights as the core's fp32 linears."""
    if getattr(linear, "gguf_qtype", None) is None:  # dequantized at load: the core's plain fp32 path
        return flat_decoder.fp32_linear(linear, silu_gated)
    gemm, type_id = kernels._built or kernels._module(), kernels.KEPT_TYPES[linear.gguf_qtype][0]
    if silu_gated:
        return _blocks_silu_and_mul, (gemm, cpu_ops._kernels(), linear.weight, type_id, linear.gguf_act_bits)
    return gemm.linear, (linear.weight, type_id, linear.gguf_act_bits)


def install(model: nn.Module) -> int:
    """Give every flattenable layer of `model` the core's flat forward over `gguf_linear`; returns
    how many (the linears are bound at the first call, after loading)."""
    n = flat_decoder.install(model, gguf_linear)
    if n:
        logger.info("GGUF: %d decoder layers run as one flat function each", n)
    return n
