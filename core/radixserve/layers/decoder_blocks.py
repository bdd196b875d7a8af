"""The pieces most HF decoder layers are made of, for `DecoderOnlyCausalLM.build_layer`:
`DecoderAttention` (fused q/k/v, optional per-head q/k norm, rotary, `RadixAttention`, output
projection), `SwiGLUMLP` (fused gate/up, silu-and-mul, down) and `PreNormDecoderLayer` (the
Llama layer around them). Parameter names are HF's after the q/k/v and gate/up fusion
(`self_attn.qkv_proj`, `self_attn.o_proj`, `self_attn.q_norm`, `mlp.gate_up_proj`, ...).

Added in plugin API 1.4."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from radixserve.interfaces.model import head_dim_of  # re-exported here, where plugin API 1.4 added it
from radixserve.interfaces.quantization import QuantMethod
from radixserve.layers import triton_gemv
from radixserve.layers.activation import SiluAndMul
from radixserve.layers.attention import QKNorm, RadixAttention
from radixserve.layers.distributed import TPGroup
from radixserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from radixserve.layers.norm_gemv import norm_linear, norm_linear_fusable
from radixserve.layers.rotary import get_rope
from radixserve.state import ForwardBatch


def check_silu(config, family: str) -> None:
    """Raise ValueError naming `config.hidden_act` unless it is silu (or absent): what
    `SwiGLUMLP` computes. Added in plugin API 1.4."""
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config.hidden_act!r} for {family} (only silu)")


class DecoderAttention(nn.Module):
    """Self-attention of a decoder layer, called as `(positions, h, batch) -> [n, hidden]`:
    `qkv_proj` -> per-head `q_norm`/`k_norm` (when `qk_norm` is given) -> `rotary_emb` ->
    `RadixAttention` -> `o_proj`.

    :param config: the HF config (`hidden_size`, `num_attention_heads`, `num_key_value_heads`,
        `head_dim` or `hidden_size // num_attention_heads`).
    :param layer_id: the layer's index (its KV buffers).
    :param quant_method: / `tp`: passed to both projections (`tp` None: one rank).
    :param qkv_bias: / `o_bias`: biases of the projections.
    :param qk_norm: `qk_norm(head_dim) -> norm module` for Qwen3/Gemma 3-style RMSNorm over each
        head of q and k before rotary; None: no such norm.
    :param rotary_emb: the rotary embedding (default `get_rope(config, head_dim)`).
    :param scaling: the softmax scale (default `head_dim ** -0.5`).
    :param sliding_window: / `logit_cap`: passed to `RadixAttention` (None: full attention,
        no soft-capping).

    Added in plugin API 1.4.
    """

    def __init__(self, config, layer_id: int, quant_method: QuantMethod | None = None, tp: TPGroup | None = None,
                 *, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm: Callable[[int], nn.Module] | None = None, rotary_emb: nn.Module | None = None,
                 scaling: float | None = None, sliding_window: int | None = None,
                 logit_cap: float | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=qkv_bias, quant_method=quant_method,
                                          tp_group=tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=o_bias,
                                        quant_method=quant_method, tp_group=tp)
        self.qk_norm = qk_norm is not None
        self._qk_norm = None
        if qk_norm is not None:
            self.q_norm = qk_norm(self.head_dim)
            self.k_norm = qk_norm(self.head_dim)
            self._qk_norm = QKNorm(self.q_norm, self.k_norm, self.head_dim)  # may run in the rotary kernel
        self.rotary_emb = rotary_emb if rotary_emb is not None else get_rope(config, self.head_dim)
        self.attn = RadixAttention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.head_dim**-0.5 if scaling is None else scaling,
                                   sliding_window=sliding_window, logit_cap=logit_cap)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.forward_qkv(positions, self.qkv_proj(h), batch)

    def forward_qkv(self, positions: torch.Tensor, qkv: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """`forward` from the output of `qkv_proj` (a caller that fused the norm into it)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # q/k norms over each head, rotary, then attention; a backend may fuse the norms and the
        # rotation into its KV store (decode)
        return self.o_proj(self.attn.forward_rotary(positions, q, k, v, self.rotary_emb, batch, self._qk_norm))


class SwiGLUMLP(nn.Module):
    """`down_proj(silu(gate_proj(x)) * up_proj(x))`, gate and up fused in `gate_up_proj`.

    :param hidden_size: / `intermediate_size`: the MLP's sizes (the full ones; `tp` shards them).
    :param quant_method: / `tp`: passed to both projections. `bias`: biases on both.

    Added in plugin API 1.4.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, quant_method: QuantMethod | None = None,
                 tp: TPGroup | None = None, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias,
                                                       quant_method=quant_method, fuse_silu_and_mul=True, tp_group=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, quant_method=quant_method,
                                           tp_group=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gated_down(x):
            return self.forward_gate_up(self.gate_up_proj(x))
        return self.down_proj(self.gate_up_proj.forward_silu_and_mul(x))

    def forward_gate_up(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`forward` from the output of `gate_up_proj` (a caller that fused the norm into it)."""
        down = self.down_proj
        if self._gated_down(gate_up):  # runtime.batch1_gemv_fuse_silu: silu_and_mul in the GEMV's prologue
            y = triton_gemv.gemv(gate_up, down.weight, down.bias if down.tp_rank == 0 else None,
                                 down.gemv_gated_config, gated=True)
            return down.tp_group.all_reduce(y) if down.reduce_results else y
        return down(_SILU_AND_MUL(gate_up))

    def _gated_down(self, x: torch.Tensor) -> bool:
        return getattr(self.down_proj, "gemv_gated_config", None) is not None and x.dim() == 2 and x.shape[0] == 1


_SILU_AND_MUL = SiluAndMul()


class FusesPostAttentionNorm:
    """Declares that an MLP block can run the decoder layer's post-attention norm inside its own
    first kernel: `PreNormDecoderLayer` calls `forward_norm_fused` instead of the norm + `forward`
    for an mlp that is an instance of this class (e.g. Qwen-MoE's block: the norm inside the
    router's launch). Added in plugin API 1.7."""

    def forward_norm_fused(self, h: torch.Tensor, residual: torch.Tensor,
                           norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(self(x), res)` for `x, res = norm(h, residual)`, or None where the block cannot fuse
        this norm or these tensors (the layer then runs `norm` and the block as usual)."""
        raise NotImplementedError


class PreNormDecoderLayer(nn.Module):
    """The Llama-style decoder layer: `h = attn(input_norm(stream))`, `stream += h`,
    `h = mlp(post_attention_norm(stream))`, with the residual add fused into the norms
    (`norm(h, residual) -> (normed, h + residual)`), following the `DecoderStack` convention.

    :param self_attn: called as `self_attn(positions, h, batch)`.
    :param mlp: called as `mlp(h)`; registered under `mlp_name` (the checkpoint's name for it,
        e.g. Mixtral's "block_sparse_moe"). A `FusesPostAttentionNorm` mlp is asked first to run
        the post-attention norm itself (plugin API 1.7).
    :param input_layernorm: / `post_attention_layernorm`: norms taking `(x)` and `(x, residual)`
        as `radixserve.layers.norm.RMSNorm` does.

    One-row inputs whose next projection has a batch-1 GEMV tile (`runtime.batch1_gemv`, with
    `runtime.batch1_gemv_fuse_norm`) run a plain `RMSNorm` inside that GEMV instead
    (radixserve.layers.norm_gemv): `DecoderAttention.forward_qkv` / `SwiGLUMLP.forward_gate_up`
    then take the projection's output; other attention / MLP modules always get the two calls.

    Added in plugin API 1.4.
    """

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module, mlp_name: str = "mlp") -> None:
        super().__init__()
        self.self_attn = self_attn
        setattr(self, mlp_name, mlp)
        self.mlp_name = mlp_name
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm

    def forward(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        attn, mlp = self.self_attn, getattr(self, self.mlp_name)
        # batch-1 GEMV tiles with runtime.batch1_gemv_fuse_norm: each norm runs inside the projection after it
        if _plain(attn, DecoderAttention) and norm_linear_fusable(self.input_layernorm, attn.qkv_proj, h):
            qkv, residual = norm_linear(self.input_layernorm, attn.qkv_proj, h, residual)
            h = attn.forward_qkv(positions, qkv, batch)
        else:
            if residual is None:
                residual = h
                h = self.input_layernorm(h)
            else:
                h, residual = self.input_layernorm(h, residual)
            h = attn(positions, h, batch)
        if _plain(mlp, SwiGLUMLP) and norm_linear_fusable(self.post_attention_layernorm, mlp.gate_up_proj, h):
            gate_up, residual = norm_linear(self.post_attention_layernorm, mlp.gate_up_proj, h, residual)
            return mlp.forward_gate_up(gate_up), residual
        if isinstance(mlp, FusesPostAttentionNorm):  # the MLP may run the norm in its own first kernel
            out = mlp.forward_norm_fused(h, residual, self.post_attention_layernorm)
            if out is not None:
                return out
        h, residual = self.post_attention_layernorm(h, residual)
        return mlp(h), residual


def _plain(module: nn.Module, cls: type) -> bool:
    """`module` is a `cls` whose `forward` is cls's own (a subclass overriding it computes something else)."""
    return isinstance(module, cls) and type(module).forward is cls.forward
