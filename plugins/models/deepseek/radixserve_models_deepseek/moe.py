"""DeepSeek's feed-forward blocks: the dense SwiGLU MLP, and the MoE block (router `gate`, routed
`experts` through the core FusedMoE, always-on `shared_experts` added to their output).

Routing, as transformers implements it:
- V2 (`DeepseekV2ForCausalLM`): softmax scores, top-k over all experts (`topk_method: greedy`) or
  within the best `topk_group` of `n_group` groups, a group scored by its best expert
  (`group_limited_greedy`); weights times `routed_scaling_factor`, never renormalised
  (transformers ignores V2's `norm_topk_prob`; DeepSeek's V2 checkpoints set it False).
- V3 (`DeepseekV3ForCausalLM`): sigmoid scores; the choice adds `e_score_correction_bias`, a group
  is scored by the sum of its best two experts; the weights are the unbiased scores, renormalised
  when `norm_topk_prob`, then times `routed_scaling_factor` (`topk_method: noaux_tc`)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from radixserve.interfaces.quantization import QuantMethod
from radixserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from radixserve.layers.moe import FusedMoE, RoutingConfig

V2_TOPK_METHODS = ("greedy", "group_limited_greedy")
V3_TOPK_METHODS = ("noaux_tc",)


class DeepseekMLP(nn.Module):
    """SwiGLU MLP: the dense layers' MLP and the MoE block's shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int, quant_method: QuantMethod | None,
                 bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias,
                                                       quant_method=quant_method, fuse_silu_and_mul=True)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, quant_method=quant_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_silu_and_mul(x))


def check_activation(config) -> None:
    """ValueError naming a `hidden_act` other than silu (the MLPs are SwiGLU)."""
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (only silu)")


def num_routed_experts(config) -> int:
    return int(getattr(config, "n_routed_experts", None) or 0)


def is_moe_layer(config, layer_id: int) -> bool:
    """DeepSeek's rule: layer i is sparse when there are routed experts, i >= first_k_dense_replace
    and i is a multiple of moe_layer_freq (1 in every released config)."""
    freq = int(getattr(config, "moe_layer_freq", 1) or 1)
    first_dense = int(getattr(config, "first_k_dense_replace", 0) or 0)
    return num_routed_experts(config) > 0 and layer_id >= first_dense and layer_id % freq == 0


def routing_from_config(config, sigmoid_noaux: bool) -> RoutingConfig:
    """The RoutingConfig of a V2 (`sigmoid_noaux=False`) or V3 config; ValueError naming an
    unsupported `topk_method` / `scoring_func`."""
    method = getattr(config, "topk_method", None)
    top_k = config.num_experts_per_tok
    scaling = float(getattr(config, "routed_scaling_factor", 1.0) or 1.0)
    n_group, topk_group = getattr(config, "n_group", None), getattr(config, "topk_group", None)
    if sigmoid_noaux:
        scoring = getattr(config, "scoring_func", None) or "sigmoid"
        if scoring != "sigmoid" or (method is not None and method not in V3_TOPK_METHODS):
            raise ValueError(f"DeepSeek-V3 routing scoring_func={scoring!r}, topk_method={method!r} is not supported "
                             f"(only scoring_func 'sigmoid' with topk_method {V3_TOPK_METHODS})")
        grouped = n_group is not None and n_group > 1
        return RoutingConfig(top_k=top_k, scoring="sigmoid", renormalize=bool(getattr(config, "norm_topk_prob", True)),
                             num_expert_group=n_group if grouped else None, topk_group=topk_group if grouped else None,
                             routed_scaling_factor=scaling)
    method = method or "greedy"
    if method not in V2_TOPK_METHODS:
        raise ValueError(f"DeepSeek-V2 topk_method={method!r} is not supported (choose from {', '.join(V2_TOPK_METHODS)})")
    grouped = method == "group_limited_greedy" and n_group is not None and n_group > 1
    return RoutingConfig(top_k=top_k, scoring="softmax", renormalize=False,
                         num_expert_group=n_group if grouped else None, topk_group=topk_group if grouped else None,
                         routed_scaling_factor=scaling)


class DeepseekRouter(nn.Module):
    """The router's linear `weight` [E, H] (HF `mlp.gate.weight`), applied in fp32 as DeepSeek does,
    so a bf16 model picks the same experts as its fp32 reference more often."""

    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class DeepseekMoE(nn.Module):
    """Routed experts plus `n_shared_experts` shared ones (one MLP of n_shared * moe_intermediate_size).

    :param sigmoid_noaux: V3 routing (sigmoid with `e_score_correction_bias`, registered on
        `experts`); False: V2 softmax routing.
    """

    def __init__(self, config, quant_method: QuantMethod | None, sigmoid_noaux: bool, prefix: str = "") -> None:
        super().__init__()
        check_activation(config)
        num_experts = num_routed_experts(config)
        self.gate = DeepseekRouter(num_experts, config.hidden_size)
        self.experts = FusedMoE(num_experts, config.hidden_size, config.moe_intermediate_size,
                                routing_from_config(config, sigmoid_noaux), quant_method=quant_method,
                                correction_bias=sigmoid_noaux, prefix=f"{prefix}.experts")
        shared = int(getattr(config, "n_shared_experts", None) or 0)
        self.shared_experts = (DeepseekMLP(config.hidden_size, config.moe_intermediate_size * shared, quant_method,
                                           bias=bool(getattr(config, "mlp_bias", False))) if shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
