"""A Llama decoder layer over kept GGUF blocks as one flat function (CPU, fp32).

At batch 1 the quantized GEMVs of SmolLM2 take only about half of a decode step; most of the rest
is Python: every layer makes ~10 module calls (each through `nn.Module.__call__`), ~30 module
attribute lookups and the per-call checks of the norm, activation and linear wrappers.
`FlatLayerForward` runs the same native kernels, in the same order, on the same tensors as
`PreNormDecoderLayer.forward` does for these layers (so the results are the same bits), with
the weights and sizes looked up once. It is installed per layer (the instance's `forward`) only
where the layer is exactly the plain Llama layer with kept linears and nothing else; any call it
cannot take (not an fp32 [rows, hidden] matrix) goes to the class's own forward."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
from radixserve.layers import cpu_ops
from radixserve.layers.decoder_blocks import DecoderAttention, PreNormDecoderLayer, SwiGLUMLP
from radixserve.layers.norm import RMSNorm

from radixserve_quant_gguf import kernels

logger = logging.getLogger(__name__)


def _plain(module: nn.Module, cls: type) -> bool:
    return type(module) is cls


def flattenable(layer: nn.Module) -> bool:
    """Whether `layer` is the plain Llama layer (no subclass anywhere, no biases, no q/k norm, one
    rank) whose four linears hold kept blocks: what `FlatLayerForward` computes exactly."""
    if not (_plain(layer, PreNormDecoderLayer) and layer.mlp_name == "mlp"):
        return False
    attn, mlp = layer.self_attn, layer.mlp
    if not (_plain(attn, DecoderAttention) and _plain(mlp, SwiGLUMLP) and attn._qk_norm is None):
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if not all(_plain(norm, RMSNorm) and norm.weight.dtype == torch.float32 for norm in norms):
        return False
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    return all(getattr(lin, "gguf_qtype", None) is not None and lin.bias is None and lin.tp_size == 1
               for lin in linears) and mlp.gate_up_proj.fuse_silu_and_mul


class FlatLayerForward:
    """`layer.forward` for a `flattenable` layer: same signature and results as
    `PreNormDecoderLayer.forward`. The weights are read at the first call (after loading)."""

    def __init__(self, layer: PreNormDecoderLayer) -> None:
        self.layer = layer
        self.bound: tuple | None = None

    def _bind(self) -> tuple:
        layer = self.layer
        attn, mlp = layer.self_attn, layer.mlp
        ids = {name: kernels.KEPT_TYPES[lin.gguf_qtype][0] for name, lin in
               (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj))}
        return (layer.input_layernorm.weight, layer.input_layernorm.eps, attn.qkv_proj.weight, ids["qkv"],
                [attn.q_size, attn.kv_size, attn.kv_size], attn.attn, attn.rotary_emb, attn.o_proj.weight, ids["o"],
                layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps,
                mlp.gate_up_proj.weight, ids["gate_up"], mlp.down_proj.weight, ids["down"])

    def __call__(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None, batch):
        if h.dtype != torch.float32 or h.dim() != 2 or h.stride(1) != 1:
            return PreNormDecoderLayer.forward(self.layer, positions, h, residual, batch)
        if self.bound is None:
            self.bound = self._bind()
        (w_in, eps_in, w_qkv, t_qkv, qkv_sizes, radix, rotary, w_o, t_o, w_post, eps_post, w_gu, t_gu, w_down,
         t_down) = self.bound
        ops, gemm = cpu_ops._kernels(), kernels._built or kernels._module()
        if residual is None:  # the first layer: the stream is the embedding
            residual, x = h, ops.rms_norm(h, w_in, eps_in)
        else:
            x, residual = ops.add_rms_norm(h, residual, w_in, eps_in)
        q, k, v = gemm.linear(x, w_qkv, t_qkv).split_with_sizes(qkv_sizes, dim=-1)
        h = gemm.linear(radix.forward_rotary(positions, q, k, v, rotary, batch, None), w_o, t_o)
        x, residual = ops.add_rms_norm(h, residual, w_post, eps_post)
        return gemm.linear(ops.silu_and_mul(gemm.linear(x, w_gu, t_gu)), w_down, t_down), residual


def install(model: nn.Module) -> int:
    """Give every `flattenable` layer of `model` a `FlatLayerForward`; returns how many. Nothing
    is installed without the native fp32 ops (cpu_ops), whose kernels the flat forward calls."""
    if cpu_ops._kernels() is None:
        return 0
    layers = [m for m in model.modules() if flattenable(m)]
    for layer in layers:
        layer.forward = FlatLayerForward(layer)
    if layers:
        logger.info("GGUF kept blocks: %d decoder layers run as one flat function each", len(layers))
    return len(layers)
