"""Router top-k: which experts each token goes to, and with what weight.

One function covers the routers of the MoE families: softmax (Mixtral, Qwen-MoE) or sigmoid
(DeepSeek-V3) scoring, optional renormalisation of the chosen weights, grouped top-k (experts split
into `num_expert_group` groups, only the best `topk_group` groups eligible) with an optional
score-correction bias that steers the choice but not the weights, and a routed scaling factor."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class RoutingConfig:
    """How a router picks experts.

    :param top_k: experts per token.
    :param scoring: "softmax" or "sigmoid" over the router logits.
    :param renormalize: divide the chosen weights by their sum (Mixtral: always; Qwen: `norm_topk_prob`).
    :param num_expert_group: split the experts into this many equal groups (None: no grouping).
    :param topk_group: how many groups stay eligible (the best by group score).
    :param routed_scaling_factor: multiply the final weights (DeepSeek-V3: 2.5).

    Added in plugin API 1.3."""

    top_k: int
    scoring: str = "softmax"
    renormalize: bool = True
    num_expert_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0

    def validate(self, num_experts: int) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"unsupported MoE scoring function {self.scoring!r} (choose from {', '.join(SCORINGS)})")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):  # e.g. a config's null num_experts_per_tok
            raise ValueError(f"MoE top_k (the config's experts per token, e.g. num_experts_per_tok) must be an "
                             f"integer, got {self.top_k!r}")
        if not 1 <= self.top_k <= num_experts:
            raise ValueError(f"MoE top_k={self.top_k} must be between 1 and the number of experts ({num_experts})")
        if self.num_expert_group is not None:
            g, tg = self.num_expert_group, self.topk_group
            if g < 1 or num_experts % g:
                raise ValueError(f"num_expert_group={g} must divide the number of experts ({num_experts})")
            if tg is None or not 1 <= tg <= g:
                raise ValueError(f"topk_group={tg} must be between 1 and num_expert_group ({g})")
            if self.top_k > tg * (num_experts // g):
                raise ValueError(f"top_k={self.top_k} exceeds the experts in {tg} group(s) of {num_experts // g}")


def _group_mask(choice: torch.Tensor, num_groups: int, topk_group: int, with_bias: bool) -> torch.Tensor:
    """[T, E] bool: experts in the `topk_group` best groups. A group's score is its best expert's,
    or with a correction bias the sum of its best two (DeepSeek-V3's rule)."""
    t, e = choice.shape
    grouped = choice.view(t, num_groups, e // num_groups)
    if with_bias and e // num_groups >= 2:
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
    else:
        group_scores = grouped.max(dim=-1).values
    best = group_scores.topk(topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return keep.unsqueeze(-1).expand(t, num_groups, e // num_groups).reshape(t, e)


def select_experts(router_logits: torch.Tensor, cfg: RoutingConfig,
                   correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Route each token.

    :param router_logits: [T, E] (any float dtype; scoring runs in fp32).
    :param cfg: the routing rule.
    :param correction_bias: [E] added to the scores to choose experts only (the weights are the
        unbiased scores), as DeepSeek-V3's `e_score_correction_bias`.
    :returns: (weights fp32 [T, top_k], expert ids int32 [T, top_k]).

    Added in plugin API 1.3."""
    logits = router_logits.float()
    scores = logits.softmax(-1) if cfg.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if cfg.num_expert_group is not None and cfg.num_expert_group > 1:
        mask = _group_mask(choice, cfg.num_expert_group, cfg.topk_group, correction_bias is not None)
        choice = choice.masked_fill(~mask, float("-inf"))
    ids = choice.topk(cfg.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.renormalize:
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return weights, ids.to(torch.int32)
