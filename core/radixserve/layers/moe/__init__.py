"""Mixture-of-experts layers: the router (`select_experts`), the routed experts (`FusedMoE`), and
their compute paths (CPU per expert, Triton fused kernel on CUDA, a plain torch reference).

Added in plugin API 1.3."""

from radixserve.layers.moe.layer import FusedMoE
from radixserve.layers.moe.routing import RoutingConfig, select_experts

__all__ = ["FusedMoE", "RoutingConfig", "select_experts"]
