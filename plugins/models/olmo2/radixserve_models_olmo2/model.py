"""OLMo 2: a Llama-shaped decoder with the norms moved.

- no input norm: attention and MLP read the residual stream itself, and their outputs are normed
  (`post_attention_layernorm`, `post_feedforward_layernorm`) before the residual add;
- q and k are RMS-normed over the whole projection (all heads together, one weight of
  num_heads * head_dim), before rotary.

RMSNorm here multiplies the weight in fp32 before the cast, as transformers' OLMo 2 does (the core
RMSNorm casts first, like Llama); fp32 activations take the core's fused kernels (same arithmetic).
Tensor parallelism would need the q/k norm statistics over all ranks: not supported.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from radixserve.interfaces.quantization import QuantMethod
from radixserve.layers.attention import RadixAttention
from radixserve.layers.causal_lm import DecoderOnlyCausalLM, head_dim_of
from radixserve.layers.distributed import TPGroup
from radixserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from radixserve.layers.norm import RMSNorm
from radixserve.layers.rotary import get_rope
from radixserve.layers.sliding_window import sliding_window_for_layer
from radixserve.state import ForwardBatch


class Olmo2RMSNorm(RMSNorm):
    """RMSNorm with the weight applied in fp32, then one cast to x's dtype."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.dtype == torch.float32:
            return super().forward(x, residual)
        if residual is not None:
            x = x + residual
        x32 = x.float()
        out = (self.weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)
        return out if residual is None else (out, x)


class Olmo2Attention(nn.Module):
    def __init__(self, config, layer_id: int, quant_method: QuantMethod | None) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=bias, quant_method=quant_method)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias,
                                        quant_method=quant_method)
        self.q_norm = Olmo2RMSNorm(self.q_size, config.rms_norm_eps)  # over every head at once
        self.k_norm = Olmo2RMSNorm(self.kv_size, config.rms_norm_eps)
        self.rotary_emb = get_rope(config, self.head_dim)
        self.attn = RadixAttention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
                                   sliding_window=sliding_window_for_layer(config, layer_id))

    def forward(self, positions: torch.Tensor, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, self.q_norm(q.contiguous()), self.k_norm(k.contiguous()))
        return self.o_proj(self.attn(q, k, v, batch))


class Olmo2MLP(nn.Module):
    def __init__(self, config, quant_method: QuantMethod | None) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} for OLMo 2 (only silu)")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2,
                                                       quant_method=quant_method, fuse_silu_and_mul=True)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, quant_method=quant_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_silu_and_mul(x))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, quant_method: QuantMethod | None) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, layer_id, quant_method)
        self.mlp = Olmo2MLP(config, quant_method)
        self.post_attention_layernorm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, residual, batch):
        """`x` is the residual stream itself (no input norm), so `residual` stays None."""
        x = x + self.post_attention_layernorm(self.self_attn(positions, x, batch))
        return x + self.post_feedforward_layernorm(self.mlp(x)), None


class Olmo2ForCausalLM(DecoderOnlyCausalLM):
    def build_layer(self, config, layer_id: int, quant_method: QuantMethod | None, tp: TPGroup) -> nn.Module:
        return Olmo2DecoderLayer(config, layer_id, quant_method)

    def build_norm(self, config) -> nn.Module:
        return Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)
