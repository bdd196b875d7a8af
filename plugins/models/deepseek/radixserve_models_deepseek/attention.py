"""DeepSeek's multi-head latent attention (MLA), model side: the projections, the latent norm and
rotary; the attention itself runs in the selected backend through `RadixLatentAttention`.

Per token: queries from `q_proj` (q_lora_rank None, V2-Lite) or `q_a_proj -> q_a_layernorm ->
q_b_proj`; `kv_a_proj_with_mqa` gives the latent `c_kv` (kv_lora_rank, then `kv_a_layernorm`) and
the rotary key part `k_pe` shared by all heads. `kv_b_proj` (the up-projection to per-head keys
and values) is never quantized: backends read its weight as per-head views."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from radixserve.interfaces.latent_attention import LatentAttentionDims
from radixserve.interfaces.quantization import QuantMethod
from radixserve.layers.latent_attention import RadixLatentAttention
from radixserve.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from radixserve.layers.norm import RMSNorm
from radixserve.layers.rotary import RotaryEmbedding, rope_parameters_of
from radixserve.state import ForwardBatch

# DeepSeek's q_a_layernorm / kv_a_layernorm use the RMSNorm default eps, not config.rms_norm_eps
# (as in DeepSeek's reference code and transformers)
LATENT_NORM_EPS = 1e-6


def latent_dims(config, num_layers: int | None = None) -> LatentAttentionDims:
    """The LatentAttentionDims of a DeepSeek config (`num_layers` defaults to num_hidden_layers)."""
    return LatentAttentionDims(
        num_layers=config.num_hidden_layers if num_layers is None else num_layers,
        num_heads=config.num_attention_heads, kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(config) -> float:
    """(qk_nope + qk_rope) ** -0.5, times mscale(factor, mscale_all_dim) ** 2 when the rope is scaled
    and the config gives `mscale_all_dim` (DeepSeek's YaRN: the cos/sin carry mscale / mscale_all_dim,
    the scores the rest)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters_of(config)
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if params["rope_type"] != "default" and mscale_all_dim:
        m = _yarn_mscale(float(params["factor"]), float(mscale_all_dim))
        scale *= m * m
    return scale


class LatentUpProjection(nn.Module):
    """`kv_b_proj`: a float `weight` [num_heads * (qk_nope + v), kv_lora_rank] the latent backend reads
    as per-head views (RadixLatentAttention.w_uk / w_uv). Not a quantizable linear on purpose: no
    quant method, no packed copy for the CPU GEMM."""

    def __init__(self, kv_lora_rank: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, kv_lora_rank), requires_grad=False)

    def forward(self, c_kv: torch.Tensor) -> torch.Tensor:
        return F.linear(c_kv, self.weight)


class DeepseekRotary(nn.Module):
    """Rotary on q_pe `[T, H, rope]` and k_pe `[T, rope]`.

    DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... (V2 always; V3 when
    `rope_interleave`, the default). Gathering the even then the odd dims turns that into the
    rotate-half layout the core RotaryEmbedding (and its kernels) rotate; q and k get the same
    permutation, so every q.k product is unchanged. k_pe is stored in the pool in that layout."""

    def __init__(self, config, interleaved: bool | None = None) -> None:
        super().__init__()
        self.rope_dim = config.qk_rope_head_dim
        self.interleaved = bool(getattr(config, "rope_interleave", True)) if interleaved is None else interleaved
        max_pos = getattr(config, "max_position_embeddings", 4096)
        self.rotary_emb = RotaryEmbedding(self.rope_dim, self.rope_dim, max_pos, rope_parameters_of(config))

    def _deinterleave(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)

    def forward(self, positions: torch.Tensor, q_pe: torch.Tensor,
                k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t, h, r = q_pe.shape
        if self.interleaved:
            q_pe, k_pe = self._deinterleave(q_pe), self._deinterleave(k_pe)
        q, k = self.rotary_emb(positions, q_pe.reshape(t, h * r).contiguous(), k_pe.reshape(t, r).contiguous())
        return q.view(t, h, r), k.view(t, r)


class DeepseekAttention(nn.Module):
    """MLA for one decoder layer; HF parameter names (`q_proj` or `q_a_proj`/`q_a_layernorm`/`q_b_proj`,
    `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`).

    :param config: the HF DeepSeek-V2/V3 config.
    :param layer_id: this layer's index into the LatentKVPool.
    :param quant_method: for the projections except `kv_b_proj` (always unquantized: the backend
        reads it as per-head views; a quantized checkpoint's kv_b_proj is dequantized at load) and
        `kv_a_proj_with_mqa` when `keep_kv_a_unquantized` (its 576 rows are no whole number of FP8
        128-row blocks).
    :param rope_interleave: rotate interleaved pairs (V2: always); None: `config.rope_interleave`
        (V3, default True).
    """

    def __init__(self, config, layer_id: int, quant_method: QuantMethod | None = None,
                 keep_kv_a_unquantized: bool = False, rope_interleave: bool | None = None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, self.num_heads * qk_head_dim, quant_method=quant_method)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias, quant_method=quant_method)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, self.num_heads * qk_head_dim,
                                                 quant_method=quant_method)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias,
                                                   quant_method=None if keep_kv_a_unquantized else quant_method)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = LatentUpProjection(self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim))
        self.o_proj = RowParallelLinear(self.num_heads * self.v_head_dim, hidden, bias=bias, quant_method=quant_method)
        self.rotary = DeepseekRotary(config, rope_interleave)
        self.attn = RadixLatentAttention(layer_id, self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim,
                                         self.qk_rope_head_dim, self.v_head_dim, softmax_scale(config), self.kv_b_proj)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = h.shape[0]
        q = self.q_proj(h) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h)))
        q_nope, q_pe = q.view(t, self.num_heads, -1).split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(h).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe)
        return self.o_proj(self.attn(q_nope, q_pe, c_kv, k_pe, batch))
