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
from radixserve.layers.causal_lm import DecoderOnlyCausalLM
from radixserve.layers.decoder_blocks import (
    DecoderAttention,
    FusesPostAttentionNorm,
    PreNormDecoderLayer,
    SwiGLUMLP,
    check_silu,
)
from radixserve.layers.distributed import TPGroup
from radixserve.layers.linear import ReplicatedLinear
from radixserve.layers.moe import FusedMoE, RoutingConfig
from radixserve.layers.norm import RMSNorm


class QwenSparseMoeBlock(nn.Module, FusesPostAttentionNorm):
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
            self.shared_expert = SwiGLUMLP(config.hidden_size, shared, quant_method)
            self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1)
        else:
            self.shared_expert = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts.forward_with_gate(x, self.gate)  # on CUDA at decode: the router in one launch
        return self._add_shared(x, out)

    def forward_norm_fused(self, h: torch.Tensor, residual: torch.Tensor,
                           norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(forward(x), res)` for `x, res = norm(h, residual)` with the norm inside the router's
        launch (`FusedMoE.forward_with_norm_gate`: CUDA decode batches), or None where that does not
        apply (the decoder layer then runs the norm and `forward`)."""
        fused = self.experts.forward_with_norm_gate(h, residual, norm, self.gate)
        if fused is None:
            return None
        out, x, res = fused
        return self._add_shared(x, out), res

    def _add_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
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
    eps = config.rms_norm_eps
    attn = DecoderAttention(config, layer_id, quant_method, qkv_bias=qkv_bias,
                            o_bias=qk_norm and qkv_bias,  # Qwen3-MoE: `attention_bias` covers o_proj too; Qwen2: never
                            qk_norm=(lambda dim: RMSNorm(dim, eps)) if qk_norm else None)
    if is_sparse_layer(config, layer_id):
        mlp = QwenSparseMoeBlock(config, quant_method, f"model.layers.{layer_id}.mlp")
    else:
        mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, quant_method)
    return PreNormDecoderLayer(attn, mlp, RMSNorm(config.hidden_size, eps), RMSNorm(config.hidden_size, eps))


class Qwen2MoeForCausalLM(DecoderOnlyCausalLM):
    """Qwen2-MoE; Qwen3MoeForCausalLM below flips the attention flags."""

    qk_norm = False
    expert_names = ("gate_proj", "up_proj", "down_proj")

    def qkv_bias(self, config) -> bool:
        return bool(getattr(config, "qkv_bias", True))

    def __init__(self, config, quant_method: QuantMethod | None = None, prefix: str = "",
                 tp_group: TPGroup | None = None) -> None:
        check_silu(config, type(self).__name__)
        super().__init__(config, quant_method, prefix, tp_group)

    def build_layer(self, config, layer_id: int, quant_method: QuantMethod | None, tp: TPGroup) -> nn.Module:
        return _qwen_moe_layer(config, layer_id, quant_method, self.qkv_bias(config), self.qk_norm)


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    qk_norm = True

    def qkv_bias(self, config) -> bool:
        return bool(getattr(config, "attention_bias", False))
