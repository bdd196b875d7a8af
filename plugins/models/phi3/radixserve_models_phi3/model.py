"""Phi-3: a Llama-shaped decoder whose checkpoints hold fused `qkv_proj` and `gate_up_proj`
matrices (loaded straight into the fused layers), with LongRoPE when `rope_parameters` asks for it
and a sliding window on every layer when the config has one."""

from __future__ import annotations

import torch
import torch.nn as nn
from radixserve.interfaces.quantization import QuantMethod
from radixserve.layers.attention import RadixAttention
from radixserve.layers.causal_lm import DecoderOnlyCausalLM, PreNormDecoderLayer, head_dim_of
from radixserve.layers.distributed import TPGroup
from radixserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from radixserve.layers.norm import RMSNorm
from radixserve.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_of
from radixserve.layers.sliding_window import sliding_window_for_layer
from radixserve.state import ForwardBatch

from radixserve_models_phi3.rope import LongRoPE


def phi3_rope(config, head_dim: int) -> RotaryEmbedding:
    """The rotary embedding Phi-3's config asks for: LongRoPE ("longrope"; "su" in old configs) or
    anything `get_rope` supports."""
    params = rope_parameters_of(config)
    if params["rope_type"] not in ("longrope", "su"):
        return get_rope(config, head_dim)
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    original = params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings",
                                                                          None)
    if not original:
        raise ValueError("longrope rope_parameters need original_max_position_embeddings")
    return LongRoPE(head_dim, int(head_dim * partial), config.max_position_embeddings, params, original)


class Phi3Attention(nn.Module):
    def __init__(self, config, layer_id: int, quant_method: QuantMethod | None) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, quant_method=quant_method)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        quant_method=quant_method)
        self.rotary_emb = phi3_rope(config, self.head_dim)
        self.attn = RadixAttention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
                                   sliding_window=sliding_window_for_layer(config, layer_id))

    def forward(self, positions: torch.Tensor, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch))


class Phi3MLP(nn.Module):
    def __init__(self, config, quant_method: QuantMethod | None) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} for Phi-3 (only silu)")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2,
                                                       quant_method=quant_method, fuse_silu_and_mul=True)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, quant_method=quant_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_silu_and_mul(x))


class Phi3ForCausalLM(DecoderOnlyCausalLM):
    stacked_params_mapping = ()  # the checkpoint's qkv_proj / gate_up_proj are fused already: their loaders split

    def build_layer(self, config, layer_id: int, quant_method: QuantMethod | None, tp: TPGroup) -> nn.Module:
        eps = config.rms_norm_eps
        return PreNormDecoderLayer(Phi3Attention(config, layer_id, quant_method), Phi3MLP(config, quant_method),
                                   RMSNorm(config.hidden_size, eps), RMSNorm(config.hidden_size, eps))
