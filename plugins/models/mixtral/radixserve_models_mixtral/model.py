"""Mixtral: a Mistral decoder whose MLP is a sparse mixture of SwiGLU experts (softmax router,
top-`num_experts_per_tok`, always renormalised).

Checkpoint names: the router is `block_sparse_moe.gate`, the experts `block_sparse_moe.experts.{e}.
w1/w3/w2` (gate/up/down); transformers 5 state dicts name the block `mlp` and stack the experts
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`): both load."""

from __future__ import annotations

import torch
import torch.nn as nn
from radixserve.interfaces.quantization import QuantMethod
from radixserve.layers.causal_lm import DecoderOnlyCausalLM
from radixserve.layers.decoder_blocks import DecoderAttention, PreNormDecoderLayer, check_silu
from radixserve.layers.distributed import TPGroup
from radixserve.layers.linear import ReplicatedLinear
from radixserve.layers.moe import FusedMoE, RoutingConfig
from radixserve.layers.norm import RMSNorm


class MixtralSparseMoeBlock(nn.Module):
    def __init__(self, config, quant_method: QuantMethod | None, prefix: str) -> None:
        super().__init__()
        check_silu(config, "Mixtral")
        routing = RoutingConfig(top_k=config.num_experts_per_tok, scoring="softmax", renormalize=True)
        self.gate = ReplicatedLinear(config.hidden_size, config.num_local_experts)  # the router stays unquantized
        self.experts = FusedMoE(config.num_local_experts, config.hidden_size, config.intermediate_size, routing,
                                quant_method=quant_method, prefix=f"{prefix}.experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts.forward_with_gate(x, self.gate)  # on CUDA at decode: the router in one launch


class MixtralForCausalLM(DecoderOnlyCausalLM):
    expert_names = ("w1", "w3", "w2")  # gate, up, down

    def build_layer(self, config, layer_id: int, quant_method: QuantMethod | None, tp: TPGroup) -> nn.Module:
        eps = config.rms_norm_eps
        return PreNormDecoderLayer(
            DecoderAttention(config, layer_id, quant_method),
            MixtralSparseMoeBlock(config, quant_method, f"model.layers.{layer_id}.block_sparse_moe"),
            RMSNorm(config.hidden_size, eps), RMSNorm(config.hidden_size, eps), mlp_name="block_sparse_moe")

    def rename_checkpoint_name(self, name: str) -> str:
        return name.replace(".mlp.", ".block_sparse_moe.")  # transformers 5 names the block `mlp`
