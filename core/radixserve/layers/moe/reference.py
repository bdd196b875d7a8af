"""The plain torch computation of routed experts: the definition every fused path is tested
against (CPU per-expert path, Triton kernel)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, k].

    :param x: [T, H]; w13: [E, 2I, H] (gate rows then up rows); w2: [E, H, I].
    :returns: [T, H] in x's dtype (accumulated in fp32)."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            h = w13[e].float() @ x[t].float()
            a = F.silu(h[:inter]) * h[inter:]
            out[t] += float(topk_weights[t, k]) * (w2[e].float() @ a)
    return out.to(x.dtype)
