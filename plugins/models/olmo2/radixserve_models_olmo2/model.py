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
from radixserve.layers.causal_lm import DecoderOnlyCausalLM
from radixserve.layers.decoder_blocks import DecoderAttention, SwiGLUMLP, check_silu
from radixserve.layers.distributed import TPGroup
from radixserve.layers.norm import RMSNorm
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


class Olmo2Attention(DecoderAttention):
    """The core attention with OLMo 2's q/k norms: over the whole projection, before rotary."""

    def __init__(self, config, layer_id: int, quant_method: QuantMethod | None) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, layer_id, quant_method, qkv_bias=bias, o_bias=bias,
                         sliding_window=sliding_window_for_layer(config, layer_id))
        self.q_norm = Olmo2RMSNorm(self.q_size, config.rms_norm_eps)  # over every head at once
        self.k_norm = Olmo2RMSNorm(self.kv_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, self.q_norm(q.contiguous()), self.k_norm(k.contiguous()))
        return self.o_proj(self.attn(q, k, v, batch))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, quant_method: QuantMethod | None) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, layer_id, quant_method)
        check_silu(config, "OLMo 2")
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, quant_method)
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
