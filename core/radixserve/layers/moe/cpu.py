"""Routed experts on the CPU: each expert runs once on the tokens routed to it.

fp32 weights go through the core's native GEMM (`cpu_gemm`: the [gate; up] projection with SiLU
applied in the GEMM, then the down projection), packed once per expert at load; other dtypes use
torch matmuls. Each (token, k) pair's result, scaled by its routing weight in fp32, lands in its
own row; the rows of a token are summed over k, so its output does not depend on the batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.layers import cpu_gemm


def pack_experts(w13: torch.Tensor, w2: torch.Tensor) -> tuple[list, list] | None:
    """Per-expert native-GEMM packings of [E, 2I, H] and [E, H, I] weights; None where packing does
    not apply (not CPU fp32, or no native kernel/oneDNN)."""
    if w13.device.type != "cpu" or w13.dtype != torch.float32:
        return None
    p13 = [cpu_gemm.pack_silu_gated(w13[e]) for e in range(w13.shape[0])]
    p2 = [cpu_gemm.pack(w2[e]) for e in range(w2.shape[0])]
    if any(p is None for p in p13) or any(p is None for p in p2):
        return None
    return p13, p2


def _expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, p13, p2) -> torch.Tensor:
    h = cpu_gemm.silu_gated_linear(x, p13) if p13 is not None else None
    if h is None:
        gate, up = F.linear(x, w13).chunk(2, dim=-1)
        h = F.silu(gate) * up
    return cpu_gemm.linear(h, w2, p2)


def cpu_fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, packed: tuple[list, list] | None = None) -> torch.Tensor:
    """[T, H] routed-expert output (see `reference.fused_experts_reference`), in x's dtype."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, tokens in order within
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    # one row per (token, k) pair, summed over k at the end: a token's sum has the same order in any
    # batch (and index_add_ spins its OpenMP threads on a busy machine: 10x slower than the GEMMs)
    rows = torch.empty(t * k, w2.shape[1], dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1, 1).float()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        p13, p2 = (packed[0][e], packed[1][e]) if packed is not None else (None, None)
        y = _expert_mlp(x.index_select(0, pairs // k), w13[e], w2[e], p13, p2)
        rows[pairs] = y.float() * weights[pairs]
    return rows.view(t, k, -1).sum(1).to(x.dtype)
