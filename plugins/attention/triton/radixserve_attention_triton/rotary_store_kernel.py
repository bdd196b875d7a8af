"""Rotary fused with the KV store: one launch rotates q, rotates k and writes k and v into their pool slots
(and, for Qwen3-style layers, applies the per-head q/k RMSNorm first).

A decode step otherwise runs three kernels per layer for this (the rotary kernel, then one
`index_put_` each for k and v); at batch 1 each is a few microseconds of mostly launch latency.
The math is the one of `radixserve.layers.triton_ops.rotary` (neox / rotate-half layout, the same
roundings to the tensor dtype at the same points, fp-fusion off), so the rotated q and the stored
k are bit-equal to `rotary(...)` followed by `KVPool.set_kv` when the pool has q's dtype, the only
case the backend sends here.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
import triton.language.extra.cuda  # noqa: F401 - tl.extra.cuda.gdc_launch_dependents
from radixserve.layers import triton_interpreter as _interpreter_compat
from radixserve.layers.triton_interpreter import interpreter_enabled
from radixserve.layers.triton_rotary import rotate_halves
from radixserve.layers.triton_support import pdl_launch, trigger_dependents

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
    QW,
    KW,
    eps,
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
    HAS_NORM: tl.constexpr,
    TRIGGER: tl.constexpr,
    GDC: tl.constexpr,  # PDL-launched (`rotary_store_pdl`): the batch's slots and positions before the wait
):
    if TRIGGER:  # the decode attention after it is PDL-launched (decode_kernel.decode_pdl): it may start now
        tl.extra.cuda.gdc_launch_dependents()
    # grid: (token, head block); blocks [0, qb) rotate q heads, [qb, qb + kb) rotate k heads into the
    # pool, the rest copy v heads into the pool
    row = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    q_blocks: tl.constexpr = (NQ + BLOCK_H - 1) // BLOCK_H
    k_blocks: tl.constexpr = (NK + BLOCK_H - 1) // BLOCK_H
    # slots and positions are the batch's metadata, written before the forward (never by the kernel before)
    slot = tl.load(Loc + row).to(tl.int64)
    crow = tl.load(P + row).to(tl.int64)
    if GDC:  # q/k/v are the previous kernel's output, and every store below may overwrite what it reads
        tl.extra.cuda.gdc_wait()
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
        norm_w = QW
    else:
        heads = (hb - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = heads < NK
        src = K + row * stride_k + heads[:, None] * HEAD_DIM
        dst = K_buf + slot * stride_kbs + heads[:, None] * stride_kbh
        norm_w = KW
    d = tl.arange(0, HALF_BLOCK)
    mask_d = d < HALF
    mask = mask_h[:, None] & mask_d[None, :]
    x1 = tl.load(src + d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + d[None, :], mask=mask, other=0.0).to(tl.float32)
    dt = QO.dtype.element_ty
    if HAS_NORM:  # per-head RMSNorm before the rotation (Qwen3's q_norm / k_norm), triton_ops.rmsnorm's recipe
        # the statistic over the whole head in one reduction, as the rmsnorm kernel takes it
        dd = tl.arange(0, D_BLOCK)
        xs = tl.load(src + dd[None, :], mask=mask_h[:, None] & (dd < HEAD_DIM)[None, :], other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xs * xs, axis=1) / HEAD_DIM + eps)[:, None]
        w1 = tl.load(norm_w + d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(norm_w + HALF + d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        # cast the normalised value to the dtype, multiply by the weight, round again (norm's output)
        x1 = ((x1 * rstd).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        x2 = ((x2 * rstd).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    # C/S: the whole fp32 cos/sin caches; gather row positions[token] (crow) and round it like `cos.to(q.dtype)`
    rotate_halves(x1, x2, dst, d, mask, mask_d, C, S, crow, stride_c, stride_s, dt, HALF)
    ot = dst.dtype.element_ty
    if REST > 0:  # partial rotary: the tail of each head passes through unchanged
        r = tl.arange(0, REST_BLOCK)
        rmask = mask_h[:, None] & (r < REST)[None, :]
        tail = tl.load(src + 2 * HALF + r[None, :], mask=rmask, other=0.0)
        if HAS_NORM:
            wt = tl.load(norm_w + 2 * HALF + r, mask=r < REST, other=0.0).to(tl.float32)[None, :]
            tail = ((tail.to(tl.float32) * rstd).to(dt).to(tl.float32) * wt).to(dt)
        tl.store(dst + 2 * HALF + r[None, :], tail.to(ot), mask=rmask)


# Programmatic dependent launch of the rotary + KV store kernel after the kernel before it (at batch 1 on sm90 the
# qkv GEMV, which signals launch_dependents after its own wait): resident and waiting when that one finishes, in
# place of a launch after it. Off by default, with RADIXSERVE_DECODE_MERGE_PDL (decode_kernel.py says why:
# session 27 measured the pair costing Llama-3.1-8B 3.6% at batch 1); RADIXSERVE_ROTARY_STORE_PDL=1 turns it on.
ROTARY_STORE_PDL = os.environ.get("RADIXSERVE_ROTARY_STORE_PDL", "0") != "0"


def rotary_store_pdl(t: torch.Tensor) -> bool:
    """Whether the rotary + KV store kernel on t's device runs PDL-launched (ROTARY_STORE_PDL, and sm90+
    with a Triton that has PDL, not the interpreter)."""
    return ROTARY_STORE_PDL and trigger_dependents(t)


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
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    trigger: bool = False,
    pdl: bool = False,
) -> torch.Tensor:
    """Rotate q and k (neox layout, the first `rotary_dim` dims of each head) and store the rotated k
    and v at slots `loc` of `k_buf` / `v_buf`, in one kernel. Returns the rotated q, a new
    contiguous `[n, num_heads*head_dim]` tensor; k and v are not returned (they are in the pool).

    q: [n, H*D], k/v: [n, KVH*D] (rows may be strided slices of a fused qkv output); positions: [n];
    cos/sin: the whole fp32 caches [max_position, rotary_dim]; k_buf/v_buf: [slots, KVH, D] with
    unit stride on D; loc: [n] slots. Nothing is read back to the host (CUDA-graph safe).

    `qk_norm` = (q_weight [D], k_weight [D], eps): first RMSNorm each head of q and of k (Qwen3's
    q_norm / k_norm, the recipe of `radixserve.layers.triton_ops.rmsnorm`: fp32 statistics, the
    normalised value rounded to q's dtype, times the weight, rounded again); the weights must have
    q's dtype. `trigger`: signal `launch_dependents` at the kernel's start, for a PDL-launched kernel
    after it (the decode attention with `decode_kernel.decode_pdl`); `pdl` (see `rotary_store_pdl`): launch
    it with programmatic dependent launch after the kernel before it; both ignored in the interpreter."""
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
    if qk_norm is not None:
        q_w, k_w, eps = qk_norm
        if q_w.shape != (head_dim,) or k_w.shape != (head_dim,) or q_w.dtype != q.dtype or k_w.dtype != q.dtype:
            raise ValueError(f"rotary_and_store: q/k norm weights {tuple(q_w.shape)} {q_w.dtype}, {tuple(k_w.shape)} "
                             f"{k_w.dtype} must be [head_dim={head_dim}] in q's dtype {q.dtype}")
        q_w, k_w = q_w.contiguous(), k_w.contiguous()
    else:
        q_w = k_w = c2  # dummy pointers, never read
        eps = 0.0
    if n == 0:
        return q_out
    half, rest = rotary_dim // 2, head_dim - rotary_dim
    half_block = triton.next_power_of_2(half)
    block_h = max(1, min(16, 512 // half_block))  # ~512 (head, dim) pairs of each half per program
    kv_blocks = (num_kv_heads + block_h - 1) // block_h
    grid = (n, (nq + block_h - 1) // block_h + 2 * kv_blocks)
    _rotary_store_kernel[grid](
        q2, k2, v2, q_out, k_buf, v_buf, loc, c2, s2, positions, q_w, k_w, float(eps),
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
        HAS_NORM=qk_norm is not None,
        TRIGGER=trigger and not interpreter_enabled(),
        num_warps=4,
        **pdl_launch(pdl and not interpreter_enabled()),
        enable_fp_fusion=False,  # keep x*cos + rot*sin as rounded mul, mul, add: bit-equal to torch in fp32
    )
    return q_out
