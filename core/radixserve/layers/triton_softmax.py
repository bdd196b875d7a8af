"""Shared by the Triton attention kernels (plugins triton, mla_triton): the online-softmax step
and the split-KV decode's stage-1 store.

Scores are kept in the log2 domain (softmax scale multiplied by log2(e)) so kernels use exp2.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# A finite "minus infinity" for the running max: keeps exp2(m_old - m_new) finite when a whole
# block is masked (exp2(-inf - -inf) would be NaN).
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def dot_qk(q, k, IEEE: tl.constexpr):
    """q [M, D] times k [N, D] transposed. IEEE (fp32 operands): exact fp32 products; without it
    tl.dot runs fp32 operands as TF32 on tensor cores (~1e-3 relative), which an fp32 model's
    attention must not (its prompt logprobs then differed from transformers' by 2e-3 on an H100)."""
    if IEEE:
        out = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        out = tl.dot(q, tl.trans(k))
    return out


@triton.jit
def online_softmax_step(qk, v, m_i, l_i, acc, IEEE: tl.constexpr):
    """Fold one block of (log2-scaled, -inf-masked) scores [M, N] and values [N, D] into the
    running max m_i [M], running sum l_i [M] and unnormalised output acc [M, D] (IEEE: as dot_qk)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def scores_log2(qk, sm_scale, logit_cap, HAS_CAP: tl.constexpr):
    """Raw q.k dot products -> log2-domain scores: `sm_scale * qk`, soft-capped to
    `logit_cap * tanh(sm_scale * qk / logit_cap)` when HAS_CAP, then times log2(e)."""
    if HAS_CAP:
        x = qk * (sm_scale / logit_cap)
        e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|): tanh from it never overflows
        t = (1.0 - e) / (1.0 + e)
        t = tl.where(x < 0, -t, t)
        out = t * (logit_cap * 1.4426950408889634)
    else:
        out = qk * (sm_scale * 1.4426950408889634)
    return out


@triton.jit
def store_split_partial(MidO, MidLse, b, heads, split, offs_w, mask_h, mask_w, m_i, l_i, acc,
                        stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh):
    """Last step of stage 1 of a split-KV decode: store the split's normalised output
    `acc / l_i` [H, W] at `MidO[b, heads, split, offs_w]` and its log2-sum-exp `m_i + log2(l_i)`
    at `MidLse[b, heads, split]` (-inf, output 0, for a split that saw no key)."""
    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    mo_ptrs = MidO + b * stride_mob + heads[:, None] * stride_moh + split * stride_mos + offs_w[None, :]
    tl.store(mo_ptrs, out, mask=mask_h[:, None] & mask_w[None, :])
    tl.store(MidLse + b * stride_mlb + heads * stride_mlh + split, lse, mask=mask_h)
