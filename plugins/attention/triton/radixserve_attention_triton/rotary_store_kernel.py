"""Rotary fused with the KV store: one launch rotates q, rotates k and writes k and v into their pool slots.

A decode step otherwise runs three kernels per layer for this (the rotary kernel, then one
`index_put_` each for k and v); at batch 1 each is a few microseconds of mostly launch latency.
The math is the one of `radixserve.layers.triton_ops.rotary` (the same `@triton.jit` helper,
`radixserve.layers.triton_rotary.rotate_heads`, fp-fusion off), so the rotated q and the stored k
are bit-equal to `rotary(...)` followed by `KVPool.set_kv` when the pool has q's dtype, the only
case the backend sends here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from radixserve.layers import triton_interpreter as _interpreter_compat
from radixserve.layers.triton_rotary import rotate_heads

_interpreter_compat.apply()


@triton.jit
def _rotary_store_kernel(
    Q,
    K,
    V,
    QO,
    K_buf,
    V_buf,
    Loc,
    C,
    S,
    P,
    stride_q,
    stride_k,
    stride_v,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    stride_c,
    stride_s,
    NQ: tl.constexpr,
    NK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    REST: tl.constexpr,
    REST_BLOCK: tl.constexpr,
    D_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # grid: (token, head block); blocks [0, qb) rotate q heads, [qb, qb + kb) rotate k heads into the
    # pool, the rest copy v heads into the pool
    row = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    q_blocks: tl.constexpr = (NQ + BLOCK_H - 1) // BLOCK_H
    k_blocks: tl.constexpr = (NK + BLOCK_H - 1) // BLOCK_H
    slot = tl.load(Loc + row).to(tl.int64)
    if hb >= q_blocks + k_blocks:  # v: a plain copy into the slot
        heads = (hb - q_blocks - k_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        d = tl.arange(0, D_BLOCK)
        mask = (heads < NK)[:, None] & (d < HEAD_DIM)[None, :]
        x = tl.load(V + row * stride_v + heads[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
        tl.store(V_buf + slot * stride_vbs + heads[:, None] * stride_vbh + d[None, :],
                 x.to(V_buf.dtype.element_ty), mask=mask)
        return
    if hb < q_blocks:
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = heads < NQ
        src = Q + row * stride_q + heads[:, None] * HEAD_DIM
        dst = QO + row * (NQ * HEAD_DIM) + heads[:, None] * HEAD_DIM
    else:
        heads = (hb - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = heads < NK
        src = K + row * stride_k + heads[:, None] * HEAD_DIM
        dst = K_buf + slot * stride_kbs + heads[:, None] * stride_kbh
    # C/S: the whole fp32 cos/sin caches, gathered at the token's position
    crow = tl.load(P + row).to(tl.int64)
    rotate_heads(src, dst, mask_h, C, S, crow, stride_c, stride_s, QO.dtype.element_ty, HALF, HALF_BLOCK, REST,
                 REST_BLOCK)


def _rows(x: torch.Tensor, width: int) -> torch.Tensor:
    x2 = x.reshape(-1, width)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rotary_and_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotary_dim: int,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    loc: torch.Tensor,
) -> torch.Tensor:
    """Rotate q and k (neox layout, the first `rotary_dim` dims of each head) and store the rotated k
    and v at slots `loc` of `k_buf` / `v_buf`, in one kernel. Returns the rotated q, a new
    contiguous `[n, num_heads*head_dim]` tensor; k and v are not returned (they are in the pool).

    q: [n, H*D], k/v: [n, KVH*D] (rows may be strided slices of a fused qkv output); positions: [n];
    cos/sin: the whole fp32 caches [max_position, rotary_dim]; k_buf/v_buf: [slots, KVH, D] with
    unit stride on D; loc: [n] slots. Nothing is read back to the host (CUDA-graph safe)."""
    n = q.shape[0]
    num_kv_heads, head_dim = k_buf.shape[1], k_buf.shape[2]
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_and_store: rotary_dim {rotary_dim} must be even and in (0, head_dim={head_dim}]")
    if q.shape[-1] % head_dim or k.shape != (n, num_kv_heads * head_dim) or v.shape != k.shape:
        raise ValueError(f"rotary_and_store: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not "
                         f"match the pool's {num_kv_heads} heads of {head_dim}")
    if cos.shape[-1] != rotary_dim or sin.shape != cos.shape or positions.shape != (n,) or loc.shape != (n,):
        raise ValueError("rotary_and_store: cos/sin must be [max_position, rotary_dim], positions and loc [n]")
    q2, k2, v2 = _rows(q, q.shape[-1]), _rows(k, k.shape[-1]), _rows(v, v.shape[-1])
    c2, s2 = _rows(cos, rotary_dim), _rows(sin, rotary_dim)
    nq = q2.shape[1] // head_dim
    q_out = torch.empty((n, nq * head_dim), dtype=q.dtype, device=q.device)
    if n == 0:
        return q_out
    half, rest = rotary_dim // 2, head_dim - rotary_dim
    half_block = triton.next_power_of_2(half)
    block_h = max(1, min(16, 512 // half_block))  # ~512 (head, dim) pairs of each half per program
    kv_blocks = (num_kv_heads + block_h - 1) // block_h
    grid = (n, (nq + block_h - 1) // block_h + 2 * kv_blocks)
    _rotary_store_kernel[grid](
        q2, k2, v2, q_out, k_buf, v_buf, loc, c2, s2, positions,
        q2.stride(0), k2.stride(0), v2.stride(0),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        c2.stride(0), s2.stride(0),
        NQ=nq,
        NK=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=half,
        HALF_BLOCK=half_block,
        REST=rest,
        REST_BLOCK=triton.next_power_of_2(rest) if rest else 1,
        D_BLOCK=triton.next_power_of_2(head_dim),
        BLOCK_H=block_h,
        num_warps=4,
        enable_fp_fusion=False,  # keep x*cos + rot*sin as rounded mul, mul, add: bit-equal to torch in fp32
    )
    return q_out
