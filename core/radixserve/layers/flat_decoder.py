"""A plain Llama decoder layer as one flat function on the CPU in fp32 (issue 12).

At SmolLM2 sizes the Python around the native kernels is a visible share of a CPU decode step:
each layer makes ~10 module calls (each through `nn.Module.__call__`), ~30 module attribute
lookups and the per-call checks of the norm, activation and linear wrappers. `FlatDecoderLayer`
runs the same kernels, in the same order, on the same tensors as `PreNormDecoderLayer.forward`
does for a `flattenable` layer (so the results are the same bits), with the weights and sizes
looked up once. Its four linears come from a `BindLinear` given to it: `fp32_linear` for the
core's packed fp32 weights (what `UnquantizedMethod.apply` / `cpu_gemm` run), a plugin's own for
its weights (the GGUF kept blocks). It is installed per layer (the instance's `forward`) by
`install`; any call it cannot take (not an fp32 [rows, hidden] CPU matrix, or a linear the binder
declines) goes to the class's own forward."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn as nn

from radixserve.layers import cpu_gemm, cpu_ops
from radixserve.layers.attention import RadixAttention
from radixserve.layers.decoder_blocks import DecoderAttention, PreNormDecoderLayer, SwiGLUMLP
from radixserve.layers.norm import RMSNorm
from radixserve.layers.quant_unquantized import UnquantizedMethod

logger = logging.getLogger(__name__)

# a linear as one call: y = kernel(x, *args), x an fp32 [rows, in] matrix with contiguous rows
LinearCall = tuple[Callable[..., torch.Tensor], tuple]
# (linear module, silu_gated) -> its LinearCall, or None where this binder cannot compute it
# exactly as the module does; silu_gated: the call returns silu(gate) * up of a [gate; up] linear
BindLinear = Callable[[nn.Module, bool], LinearCall | None]


def flattenable(layer: nn.Module) -> bool:
    """Whether `layer` is the plain Llama layer `FlatDecoderLayer` computes: no subclass anywhere,
    fp32 RMSNorms, no q/k norm, no biases, one rank, no batch-1 GEMV tiles, the gate/up projection
    marked for the fused SiLU. Whether the linears' weights can be computed is the binder's part."""
    if not (type(layer) is PreNormDecoderLayer and layer.mlp_name == "mlp"):
        return False
    attn, mlp = layer.self_attn, layer.mlp
    if not (type(attn) is DecoderAttention and type(mlp) is SwiGLUMLP and attn._qk_norm is None
            and type(attn.attn) is RadixAttention):
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if not all(type(norm) is RMSNorm and norm.weight.dtype == torch.float32 for norm in norms):
        return False
    return all(lin.bias is None and lin.tp_size == 1 and getattr(lin, "gemv_config", None) is None
               and getattr(lin, "gemv_gated_config", None) is None for lin in _linears(layer)) \
        and mlp.gate_up_proj.fuse_silu_and_mul and not attn.qkv_proj.gather_output


def _linears(layer: PreNormDecoderLayer) -> tuple[nn.Module, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def fp32_linear(linear: nn.Module, silu_gated: bool) -> LinearCall | None:
    """The core's fp32 linear as one native call: what `cpu_gemm.linear` (or, silu-gated,
    `cpu_gemm.silu_gated_linear`) runs for an fp32 CPU matrix with the linear's packed panels.
    None where the module would take another path (no panels: oneDNN or MKL, a GEMV tile)."""
    packed = getattr(linear, "packed_weight", None)
    if (packed is None or (packed.panels is None and packed.amx is None) or packed.silu_gated != silu_gated
            or getattr(linear, "gemv_config", None) is not None):
        return None
    if packed.amx is not None:  # AMX tiles (medium precision on a CPU with AMX): what cpu_gemm calls
        return cpu_gemm._amx_gemm().linear, (packed.amx, packed.out_features, silu_gated)
    gemm = cpu_gemm._native_gemm()
    return (gemm.linear_silu_mul if silu_gated else gemm.linear), (packed.panels, packed.out_features, packed.widen)


class FlatDecoderLayer:
    """`layer.forward` for a `flattenable` layer: same signature and results as
    `PreNormDecoderLayer.forward`. The linears are bound at the first call (after loading and the
    runner's set-up); where `bind_linear` declines one, every call takes the class's forward."""

    def __init__(self, layer: PreNormDecoderLayer, bind_linear: BindLinear) -> None:
        self.layer = layer
        self.bind_linear = bind_linear
        self.bound: tuple | bool | None = None  # None: not yet; False: the binder declined

    def _bind(self) -> tuple | bool:
        layer = self.layer
        attn, mlp = layer.self_attn, layer.mlp
        calls = (self.bind_linear(attn.qkv_proj, False), self.bind_linear(attn.o_proj, False),
                 self.bind_linear(mlp.gate_up_proj, True), self.bind_linear(mlp.down_proj, False))
        if any(call is None for call in calls) or not flattenable(layer):
            return False
        (qkv, qkv_args), (o, o_args), (gate_up, gate_up_args), (down, down_args) = calls
        inorm, pnorm = layer.input_layernorm, layer.post_attention_layernorm
        return (cpu_ops._kernels(), inorm.weight, inorm.eps, qkv, qkv_args, [attn.q_size, attn.kv_size, attn.kv_size],
                attn.attn, attn.rotary_emb, o, o_args, pnorm.weight, pnorm.eps, gate_up, gate_up_args, down, down_args)

    def __call__(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None, batch):
        bound = self.bound
        if bound is None:
            bound = self.bound = self._bind()
        if (bound is False or h.dtype != torch.float32 or h.dim() != 2 or h.stride(1) != 1 or not h.is_cpu
                or (residual is not None and residual.stride(1) != 1)):
            return PreNormDecoderLayer.forward(self.layer, positions, h, residual, batch)
        (ops, w_in, eps_in, qkv, qkv_args, qkv_sizes, radix, rotary, o, o_args, w_post, eps_post,
         gate_up, gate_up_args, down, down_args) = bound
        if residual is None:  # the first layer: the stream is the embedding
            residual, x = h, ops.rms_norm(h, w_in, eps_in)
        else:
            x, residual = ops.add_rms_norm(h, residual, w_in, eps_in)
        q, k, v = qkv(x, *qkv_args).split_with_sizes(qkv_sizes, dim=-1)
        a = radix.forward_rotary(positions, q, k, v, rotary, batch, None)
        h = o(a if a.stride(1) == 1 else a.contiguous(), *o_args)  # as cpu_gemm.linear hands it over
        x, residual = ops.add_rms_norm(h, residual, w_post, eps_post)
        return down(gate_up(x, *gate_up_args), *down_args), residual


def install(model: nn.Module, bind_linear: BindLinear, accept: Callable[[nn.Module], bool] = lambda layer: True) -> int:
    """Give every `flattenable` layer of `model` that `accept`s it and has no flat forward yet a
    `FlatDecoderLayer` over `bind_linear`; returns how many. Nothing is installed without the
    native fp32 ops (cpu_ops), whose kernels the flat forward calls."""
    if cpu_ops._kernels() is None:
        return 0
    layers = [m for m in model.modules()
              if flattenable(m) and "forward" not in m.__dict__ and accept(m)]
    for layer in layers:
        layer.forward = FlatDecoderLayer(layer, bind_linear)
    return len(layers)


def _plain_fp32(layer: PreNormDecoderLayer) -> bool:
    return all(type(lin.quant_method) is UnquantizedMethod for lin in _linears(layer))


def install_fp32(model: nn.Module) -> int:
    """`install` for the core's plain fp32 linears (the CPU model after packing); logs the count."""
    n = install(model, fp32_linear, _plain_fp32)
    if n:
        logger.info("%d fp32 decoder layers run as one flat function each on the CPU", n)
    return n
