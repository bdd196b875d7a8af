"""`@triton.jit` steps shared by the small-batch MoE kernels (`small_m`, `one_launch`): the routing of
one token (the router kernels) and the per-token row sum run by the last down program (the down
kernels). Called from inside those kernels, so they inline: the kernels compute exactly what they
computed with the steps written out. Imports Triton: `small_m` and `one_launch` import this module
only when they build their kernels (CPU machines may lack Triton)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def route_token(logits, offs, ok, t, bias_ptr, weights_ptr, ids_ptr, E, scale, TOP_K: tl.constexpr,
                SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
                BLOCK_TOPK: tl.constexpr):
    """Token t's routing from its fp32 router logits [BLOCK_E] (-inf where not `ok`), as
    `routing.select_experts` without expert groups: scores (sigmoid or softmax), the top TOP_K of
    scores + bias (the first index on ties), their scores renormalised and scaled, stored to
    weights[t * TOP_K:] (fp32) and ids[t * TOP_K:] (int32)."""
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    else:
        p = tl.exp(logits - tl.max(logits, axis=0))
        p = tl.where(ok, p, 0.0)
        scores = p / tl.sum(p, axis=0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    choice = tl.where(ok, choice, float("-inf"))
    slots = tl.arange(0, BLOCK_TOPK)
    chosen_ids = tl.zeros((BLOCK_TOPK,), dtype=tl.int32)
    chosen_w = tl.zeros((BLOCK_TOPK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.minimum(tl.argmax(choice, axis=0), E - 1)  # NaN logits (a padding row) stay in range
        w = tl.sum(tl.where(offs == best, scores, 0.0), axis=0)
        chosen_ids = tl.where(slots == j, best.to(tl.int32), chosen_ids)
        chosen_w = tl.where(slots == j, w, chosen_w)
        choice = tl.where(offs == best, float("-inf"), choice)
    if RENORMALIZE:
        chosen_w = chosen_w / tl.maximum(tl.sum(chosen_w, axis=0), 1e-20)
    chosen_w = chosen_w * scale
    keep = slots < TOP_K
    tl.store(weights_ptr + t * TOP_K + slots, chosen_w, mask=keep)
    tl.store(ids_ptr + t * TOP_K + slots, chosen_ids, mask=keep)


@triton.jit
def sum_rows_if_last(counter_ptr, partial_ptr, final_ptr, token, offs_n, n_ok, N,
                     ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """After a down program stored its partial row: publish it (every thread's stores before the
    barrier, then the release-acquire arrival on counter_ptr, the (token, column block)'s counter)
    and, in the last of the ROWS programs to arrive, reset the counter and write
    final[token, offs_n] = the sum of partial rows [token * ROWS, (token + 1) * ROWS) in index
    order (read past L1, .cg), cast to final's dtype."""
    tl.debug_barrier()
    if tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == ROWS - 1:
        tl.store(counter_ptr, 0)
        base = partial_ptr + (token * ROWS).to(tl.int64) * N + offs_n
        total = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for r in range(0, ROWS):
            total += tl.load(base + r * N, mask=n_ok, other=0.0, cache_modifier=".cg")
        tl.store(final_ptr + token.to(tl.int64) * N + offs_n, total.to(final_ptr.dtype.element_ty), mask=n_ok)
