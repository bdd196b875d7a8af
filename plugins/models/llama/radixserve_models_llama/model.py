"""The Llama family: Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm).

Sliding windows come from the config per layer (`sliding_window_for_layer`): Mistral's on every
layer, Qwen2/3's on the layers its `layer_types` marks (only with `use_sliding_window`).

One implementation; the architectures differ only in the class-level flags below."""

from __future__ import annotations

import torch
import torch.nn as nn
from radixserve.interfaces.quantization import QuantMethod
from radixserve.layers.attention import RadixAttention
from radixserve.layers.causal_lm import DecoderOnlyCausalLM, PreNormDecoderLayer, head_dim_of
from radixserve.layers.distributed import TPGroup
from radixserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from radixserve.layers.norm import RMSNorm
from radixserve.layers.rotary import get_rope
from radixserve.layers.sliding_window import sliding_window_for_layer
from radixserve.state import ForwardBatch


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_id: int, quant_method: QuantMethod | None, flags: dict[str, bool],
                 tp: TPGroup) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads,
            bias=flags["qkv_bias"], quant_method=quant_method, tp_group=tp,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=flags["o_bias"],
            quant_method=quant_method, tp_group=tp,
        )
        self.qk_norm = flags["qk_norm"]
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = get_rope(config, self.head_dim)
        self.attn = RadixAttention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
                                   sliding_window=sliding_window_for_layer(config, layer_id))

    def forward(self, positions: torch.Tensor, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:  # Qwen3: RMSNorm over each head before rotary
            n = q.shape[0]
            q = self.q_norm(q.reshape(n, -1, self.head_dim)).reshape(n, -1)
            k = self.k_norm(k.reshape(n, -1, self.head_dim)).reshape(n, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch))


class LlamaMLP(nn.Module):
    def __init__(self, config, quant_method: QuantMethod | None, tp: TPGroup) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (only silu)")
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=bias, quant_method=quant_method,
            fuse_silu_and_mul=True, tp_group=tp,
        )
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias,
                                           quant_method=quant_method, tp_group=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_silu_and_mul(x))


class LlamaForCausalLM(DecoderOnlyCausalLM):
    """Llama; subclasses below flip the flags for the other architectures."""

    qkv_bias_default = False  # used when the config has no `attention_bias`
    o_bias_follows_attention_bias = True
    qk_norm = False
    supports_tensor_parallel = True

    def build_layer(self, config, layer_id: int, quant_method: QuantMethod | None, tp: TPGroup) -> nn.Module:
        attention_bias = getattr(config, "attention_bias", None)
        flags = {
            "qkv_bias": self.qkv_bias_default if attention_bias is None else bool(attention_bias),
            "o_bias": bool(attention_bias) and self.o_bias_follows_attention_bias,
            "qk_norm": self.qk_norm,
        }
        eps = config.rms_norm_eps
        return PreNormDecoderLayer(LlamaAttention(config, layer_id, quant_method, flags, tp),
                                   LlamaMLP(config, quant_method, tp),
                                   RMSNorm(config.hidden_size, eps), RMSNorm(config.hidden_size, eps))


class MistralForCausalLM(LlamaForCausalLM):
    pass  # same math; its sliding window (every layer) is set per layer from the config


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias_default = True  # Qwen2 always has q/k/v bias and never an o_proj bias
    o_bias_follows_attention_bias = False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
