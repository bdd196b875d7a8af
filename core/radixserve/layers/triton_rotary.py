"""The rotary math shared by the Triton kernels that apply rotary embeddings: the layers' rotary
kernel (radixserve.layers.triton_ops.rotary) and the triton attention plugin's rotary fused with the
KV store. One copy, so the two stay bit-identical: the same roundings to the tensor dtype at the same
points as torch (`RotaryEmbedding._rotate`); callers launch with fp-fusion off.

Imports Triton at module level: import it only where Triton is there (triton_ops does so lazily).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rotate_halves(x1, x2, dst, d, mask, mask_d, C, S, crow, stride_c, stride_s, dt: tl.constexpr,
                  HALF: tl.constexpr):
    """The rotation of a block of heads whose two halves x1, x2 ([BLOCK_H, HALF_BLOCK] fp32, columns
    d, `mask` / `mask_d` as in `rotate_heads`) are loaded: cos/sin row `crow` of C/S rounded to dt,
    the rotated halves stored to dst's first 2 * HALF dims in dst's dtype. Used by `rotate_heads`
    and by the triton attention plugin's rotary + KV-store kernel (after its q/k norm)."""
    c1 = tl.load(C + crow * stride_c + d, mask=mask_d, other=0.0).to(dt).to(tl.float32)[None, :]
    c2 = tl.load(C + crow * stride_c + HALF + d, mask=mask_d, other=0.0).to(dt).to(tl.float32)[None, :]
    s1 = tl.load(S + crow * stride_s + d, mask=mask_d, other=0.0).to(dt).to(tl.float32)[None, :]
    s2 = tl.load(S + crow * stride_s + HALF + d, mask=mask_d, other=0.0).to(dt).to(tl.float32)[None, :]
    # torch computes rot*cos, rotate_half(rot)*sin and their sum as three ops, each rounded to
    # the dtype; round at the same points (the launch also turns off mul+add -> fma fusion)
    o1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
    ot = dst.dtype.element_ty
    tl.store(dst + d[None, :], o1.to(ot), mask=mask)
    tl.store(dst + HALF + d[None, :], o2.to(ot), mask=mask)


@triton.jit
def rotate_heads(
    src,
    dst,
    mask_h,
    C,
    S,
    crow,
    stride_c,
    stride_s,
    dt: tl.constexpr,
    HALF: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    REST: tl.constexpr,
    REST_BLOCK: tl.constexpr,
):
    """Neox (rotate-half) rotary of a block of heads. src/dst: pointers to each head's first
    element ([BLOCK_H, 1]), mask_h [BLOCK_H] masks the heads; the rotated halves use row `crow` of the
    cos/sin tables C/S (cast like `cos.to(q.dtype)`, dt being q's dtype) and are stored in dst's
    dtype; the last REST dims of each head are copied unchanged (partial rotary)."""
    d = tl.arange(0, HALF_BLOCK)
    mask_d = d < HALF
    mask = mask_h[:, None] & mask_d[None, :]
    x1 = tl.load(src + d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + d[None, :], mask=mask, other=0.0).to(tl.float32)
    rotate_halves(x1, x2, dst, d, mask, mask_d, C, S, crow, stride_c, stride_s, dt, HALF)
    ot = dst.dtype.element_ty
    if REST > 0:  # partial rotary: the tail of each head passes through unchanged
        r = tl.arange(0, REST_BLOCK)
        rmask = mask_h[:, None] & (r < REST)[None, :]
        tail = tl.load(src + 2 * HALF + r[None, :], mask=rmask, other=0.0)
        tl.store(dst + 2 * HALF + r[None, :], tail.to(ot), mask=rmask)
