"""`@triton.jit` steps shared by the small-batch MoE kernels (`small_m`, `one_launch`): the routing of
one token (the router kernels), the RMSNorm recipe of the router's fused norm, and the per-token
row sum run by the last down program (the down kernels). Called from inside those kernels, so
they inline: the kernels compute exactly what they computed with the steps written out. Imports
Triton: `small_m` and `one_launch` import this module only when they build their kernels (CPU
machines may lack Triton)."""

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
    weights[t * TOP_K:] (fp32) and ids[t * TOP_K:] (int32) in descending order of choice.

    The top TOP_K come from one bitonic `tl.topk` over distinct int64 keys (the choice's bits in an
    order-preserving form, then the index reversed so the lower index wins a tie), not from TOP_K
    rounds of argmax that each wait on the last: at 128 experts the sm_90 SASS has 23 shuffles on
    its longest dependency path instead of 58. A NaN choice (a padding row's logits) counts as
    -inf, so the slots still get distinct ids in [0, E) (the row's weights are NaN or -inf); lanes
    past E (-inf, higher indices) come after every expert."""
    scores, choice = routing_scores(logits, offs, ok, bias_ptr, SIGMOID, HAS_BIAS)
    choice = tl.where(ok & (choice == choice), choice, float("-inf"))
    bits = choice.to(tl.int32, bitcast=True)
    # signed-int order = float order; only -0.0 would sort below +0.0 (argmax ties them), but no
    # choice is -0.0: scores are >= +0.0 and a sum is -0.0 only of two -0.0
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    rev = offs.shape[0] - 1 - offs  # BLOCK_E - 1 - index: the lower index wins a tie
    keys = (key.to(tl.int64) << 32) | rev.to(tl.int64)
    if BLOCK_TOPK == 1:
        top = tl.max(keys, axis=0)  # tl.topk(keys, 1) reduces to a scalar it cannot reshape (Triton 3.6)
    else:
        top = tl.topk(keys, BLOCK_TOPK)  # descending
    slots = tl.arange(0, BLOCK_TOPK)
    chosen_ids = tl.zeros((BLOCK_TOPK,), dtype=tl.int32)
    chosen_w = tl.zeros((BLOCK_TOPK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # independent of each other: no chain
        top_j = tl.sum(tl.where(slots == j, top, 0), axis=0)
        best = offs.shape[0] - 1 - top_j.to(tl.int32)  # the low half: rev
        if HAS_BIAS:
            w = tl.sum(tl.where(offs == best, scores, 0.0), axis=0)
        else:  # the choice is the score: its bits are the high half (no gather)
            hi = (top_j >> 32).to(tl.int32)
            w = (hi ^ ((hi >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        # slot by slot as the argmax loop did: the renormalising sum keeps its layout, so its order
        chosen_ids = tl.where(slots == j, best, chosen_ids)
        chosen_w = tl.where(slots == j, w, chosen_w)
    store_routing(chosen_w, chosen_ids, slots, t, weights_ptr, ids_ptr, scale, TOP_K, RENORMALIZE)


@triton.jit
def routing_scores(logits, offs, ok, bias_ptr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr):
    """(scores, choice) of a token's fp32 router logits [BLOCK_E] (-inf where not `ok`): the sigmoid or
    softmax scores, and what the top-k ranks, scores + the correction bias (the scores without one)."""
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    else:
        p = tl.exp(logits - tl.max(logits, axis=0))
        p = tl.where(ok, p, 0.0)
        scores = p / tl.sum(p, axis=0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    return scores, choice


@triton.jit
def store_routing(chosen_w, chosen_ids, slots, t, weights_ptr, ids_ptr, scale, TOP_K: tl.constexpr,
                  RENORMALIZE: tl.constexpr):
    """Store token t's TOP_K chosen ids and their weights (renormalised to sum 1 if RENORMALIZE, then
    times `scale`) from the slots [BLOCK_TOPK] of `chosen_ids` / `chosen_w`."""
    if RENORMALIZE:
        chosen_w = chosen_w / tl.maximum(tl.sum(chosen_w, axis=0), 1e-20)
    chosen_w = chosen_w * scale
    keep = slots < TOP_K
    tl.store(weights_ptr + t * TOP_K + slots, chosen_w, mask=keep)
    tl.store(ids_ptr + t * TOP_K + slots, chosen_ids, mask=keep)


@triton.jit
def residual_add(h, res):
    """torch's h + residual for an RMSNorm: the fp32 sum rounded to h's dtype before the norm sees it."""
    return (h.to(tl.float32) + res.to(tl.float32)).to(h.dtype)


@triton.jit
def rms_scale(s, rstd, norm_w):
    """HF's RMSNorm recipe on s: s * rstd rounded to s's dtype, times the weight, rounded again."""
    return ((s.to(tl.float32) * rstd).to(s.dtype).to(tl.float32) * norm_w.to(tl.float32)).to(s.dtype)


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
