"""The Qwen mixture-of-experts family: Qwen2-MoE (q/k/v bias, a shared expert behind a sigmoid
gate) and Qwen3-MoE (per-head q/k RMSNorm, no shared expert).

Which layers are sparse follows the config: layer i uses the MoE block unless it is listed in
`mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step`; the others use a dense
SwiGLU MLP of `intermediate_size`. Routing: softmax top-`num_experts_per_tok`, renormalised when
`norm_topk_prob`."""

from __future__ import annotations

import torch
import torch.nn as nn
from radixserve.interfaces.quantization import QuantMethod
from radixserve.layers.attention import RadixAttention
from radixserve.layers.causal_lm import DecoderOnlyCausalLM, PreNormDecoderLayer, head_dim_of
from radixserve.layers.distributed import TPGroup
from radixserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from radixserve.layers.moe import FusedMoE, RoutingConfig
from radixserve.layers.norm import RMSNorm
from radixserve.layers.rotary import get_rope
from radixserve.state import ForwardBatch


def _check_silu(config) -> None:
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (only silu)")


class QwenMoeAttention(nn.Module):
    def __init__(self, config, layer_id: int, quant_method: QuantMethod | None, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        o_bias = qk_norm and qkv_bias  # Qwen3-MoE: `attention_bias` covers o_proj too; Qwen2-MoE: never
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=qkv_bias, quant_method=quant_method)
        self.q_size = self.qkv_proj.num_heads * self.head_dim
        self.kv_size = self.qkv_proj.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=o_bias,
                                        quant_method=quant_method)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = get_rope(config, self.head_dim)
        self.attn = RadixAttention(layer_id, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, self.head_dim,
                                   self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:  # Qwen3: RMSNorm over each head before rotary
            n = q.shape[0]
            q = self.q_norm(q.reshape(n, -1, self.head_dim)).reshape(n, -1)
            k = self.k_norm(k.reshape(n, -1, self.head_dim)).reshape(n, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch))


class QwenMLP(nn.Module):
    """SwiGLU MLP: the dense layers' MLP and Qwen2-MoE's shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, quant_method: QuantMethod | None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, quant_method=quant_method,
                                                       fuse_silu_and_mul=True)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, quant_method=quant_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_silu_and_mul(x))


class QwenSparseMoeBlock(nn.Module):
    """Router `gate`, routed `experts`, and (Qwen2-MoE) `shared_expert` scaled by sigmoid(`shared_expert_gate`)."""

    def __init__(self, config, quant_method: QuantMethod | None, prefix: str) -> None:
        super().__init__()
        routing = RoutingConfig(top_k=config.num_experts_per_tok, scoring="softmax",
                                renormalize=bool(getattr(config, "norm_topk_prob", False)))
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts)  # the router stays unquantized
        self.experts = FusedMoE(config.num_experts, config.hidden_size, config.moe_intermediate_size, routing,
                                quant_method=quant_method, prefix=f"{prefix}.experts")
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        if shared:
            self.shared_expert = QwenMLP(config.hidden_size, shared, quant_method)
            self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1)
        else:
            self.shared_expert = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def is_sparse_layer(config, layer_id: int) -> bool:
    """HF's rule: MoE unless listed in `mlp_only_layers` or off the `decoder_sparse_step` stride."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    only_dense = set(getattr(config, "mlp_only_layers", None) or ())
    return config.num_experts > 0 and layer_id not in only_dense and (layer_id + 1) % step == 0


def _qwen_moe_layer(config, layer_id: int, quant_method: QuantMethod | None, qkv_bias: bool,
                    qk_norm: bool) -> PreNormDecoderLayer:
    if is_sparse_layer(config, layer_id):
        mlp = QwenSparseMoeBlock(config, quant_method, f"model.layers.{layer_id}.mlp")
    else:
        mlp = QwenMLP(config.hidden_size, config.intermediate_size, quant_method)
    return PreNormDecoderLayer(QwenMoeAttention(config, layer_id, quant_method, qkv_bias, qk_norm), mlp,
                               RMSNorm(config.hidden_size, config.rms_norm_eps),
                               RMSNorm(config.hidden_size, config.rms_norm_eps))


class Qwen2MoeForCausalLM(DecoderOnlyCausalLM):
    """Qwen2-MoE; Qwen3MoeForCausalLM below flips the attention flags."""

    qk_norm = False
    expert_names = ("gate_proj", "up_proj", "down_proj")

    def qkv_bias(self, config) -> bool:
        return bool(getattr(config, "qkv_bias", True))

    def __init__(self, config, quant_method: QuantMethod | None = None, prefix: str = "",
                 tp_group: TPGroup | None = None) -> None:
        _check_silu(config)
        super().__init__(config, quant_method, prefix, tp_group)

    def build_layer(self, config, layer_id: int, quant_method: QuantMethod | None, tp: TPGroup) -> nn.Module:
        return _qwen_moe_layer(config, layer_id, quant_method, self.qkv_bias(config), self.qk_norm)


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    qk_norm = True

    def qkv_bias(self, config) -> bool:
        return bool(getattr(config, "attention_bias", False))
