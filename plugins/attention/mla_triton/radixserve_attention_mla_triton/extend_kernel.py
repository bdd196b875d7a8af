"""Absorbed latent extend attention (MLA): prefill, chunked prefill and speculative verify.

The same latent-space math as the decode kernel, with many query rows: per new token t and head h
the query is `q_lat[t, h]` (`q_nope @ W_UK[h]`) plus `q_pe[t, h]`, and the keys/values are the
request's pool rows `[c_kv, k_pe]` at positions 0..prefix+ext-1 (the new tokens' rows are stored
in the pool before the launch, so prefix and new tokens are read the same way, through
`req_to_token`). A query at new-token index t sees positions <= prefix + t (causal), and with a
tree mask (speculative verify of draft trees) a new key j only when block[t, j] is set; the prefix
stays fully visible.

Program (request, block of BLOCK_T new tokens, block of BLOCK_H heads): its BLOCK_T * BLOCK_H query
rows share every latent row it loads.

Why absorbed rather than decompressed: one kernel, no per-head K/V materialised for the prefix,
and the same pool reads as decode. It costs more FLOPs than decompressing for long prompts
(dot width kv_lora_rank + rope instead of nope + rope); prefill speed is not this kernel's aim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from radixserve.layers import triton_interpreter
from radixserve.layers.triton_softmax import LOG2E, NEG_BIG, dot_qk, online_softmax_step

triton_interpreter.apply()


@triton.jit
def _latent_extend_kernel(
    QLat,
    QPe,
    Out,
    Latent,
    ReqToToken,
    req_pool_idx_ptr,
    prefix_lens_ptr,
    extend_lens_ptr,
    extend_start_ptr,
    TreeMask,
    mask_start_ptr,
    sm_scale_log2,
    num_heads,
    stride_qlt,
    stride_qlh,
    stride_qpt,
    stride_qph,
    stride_ot,
    stride_oh,
    stride_lat,
    stride_r2t,
    LORA: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_TREE_MASK: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 operands: exact fp32 products (triton_softmax.dot_qk)
):
    b = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK_T
    hb = tl.program_id(2)
    ext_len = tl.load(extend_lens_ptr + b).to(tl.int32)
    if t0 >= ext_len:
        return
    prefix = tl.load(prefix_lens_ptr + b).to(tl.int32)
    ext_start = tl.load(extend_start_ptr + b).to(tl.int64)
    req = tl.load(req_pool_idx_ptr + b).to(tl.int64)

    # query rows: token-major, BLOCK_H heads of each token
    rows = tl.arange(0, BLOCK_T * BLOCK_H)
    t = t0 + rows // BLOCK_H
    h = hb * BLOCK_H + rows % BLOCK_H
    mask_m = (t < ext_len) & (h < num_heads)
    tok = ext_start + t
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    mask_l = offs_l < LORA
    mask_r = offs_r < ROPE
    q_lat = tl.load(
        QLat + tok[:, None] * stride_qlt + h[:, None] * stride_qlh + offs_l[None, :],
        mask=mask_m[:, None] & mask_l[None, :],
        other=0.0,
    )
    q_pe = tl.load(
        QPe + tok[:, None] * stride_qpt + h[:, None] * stride_qph + offs_r[None, :],
        mask=mask_m[:, None] & mask_r[None, :],
        other=0.0,
    )
    q_pos = prefix + t  # absolute position of each row's token
    if HAS_TREE_MASK:  # this request's row-major [ext_len, ext_len] block of the flat mask
        mask_rows = TreeMask + tl.load(mask_start_ptr + b).to(tl.int64) + t[:, None].to(tl.int64) * ext_len

    m_i = tl.full([BLOCK_T * BLOCK_H], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_T * BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_T * BLOCK_H, BLOCK_L], dtype=tl.float32)
    r2t_row = ReqToToken + req * stride_r2t
    # keys past this block's last query are never seen (causal; a tree only points backwards)
    hi = prefix + tl.minimum(ext_len, t0 + BLOCK_T)
    for start in range(0, hi, BLOCK_N):
        n = start + offs_n
        mask_n = n < hi
        slot = tl.load(r2t_row + n, mask=mask_n, other=0).to(tl.int64)
        row = Latent + slot[:, None] * stride_lat
        c_kv = tl.load(row + offs_l[None, :], mask=mask_n[:, None] & mask_l[None, :], other=0.0)
        k_pe = tl.load(row + LORA + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0)
        qk = dot_qk(q_lat, c_kv, IEEE) + dot_qk(q_pe, k_pe, IEEE)
        seen = mask_n[None, :] & (n[None, :] <= q_pos[:, None])
        if HAS_TREE_MASK:
            j = n - prefix  # index among the new tokens (negative: a prefix key, always seen)
            in_tree = seen & mask_m[:, None] & (j[None, :] >= 0)
            bit = tl.load(mask_rows + j[None, :], mask=in_tree, other=1)
            seen = seen & (bit != 0)
        qk = tl.where(seen, qk * sm_scale_log2, float("-inf"))
        m_i, l_i, acc = online_softmax_step(qk, c_kv, m_i, l_i, acc, IEEE)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # a padding row (masked out) has l_i == 0
    o_ptrs = Out + tok[:, None] * stride_ot + h[:, None] * stride_oh + offs_l[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_l[None, :])


@dataclass(frozen=True)
class LatentExtendConfig:
    block_t: int  # new tokens per program
    block_h: int  # heads per program; block_t * block_h >= 16 query rows
    block_n: int
    num_warps: int
    num_stages: int


def latent_extend_config(num_heads: int, kv_lora_rank: int, interpret: bool) -> LatentExtendConfig:
    """32 query rows a program on a GPU (a [32, 512] fp32 accumulator over 8 warps is 64 registers
    a thread); the interpreter uses 16 rows, and a short head block so several programs run."""
    block_h = min(triton.next_power_of_2(num_heads), 16)
    if interpret:
        return LatentExtendConfig(max(1, 16 // block_h), block_h, 16, 1, 1)
    rows = 32 if triton.next_power_of_2(kv_lora_rank) >= 512 else 64
    return LatentExtendConfig(max(1, rows // block_h), block_h, 32, 8, 2)


def latent_extend_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    out: torch.Tensor,
    latent: torch.Tensor,
    kv_lora_rank: int,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    config: LatentExtendConfig,
    tree_mask: torch.Tensor | None = None,
    mask_start: torch.Tensor | None = None,
) -> None:
    """Write absorbed latent extend attention `o_lat` of the packed new tokens into `out`.

    Shapes (last dim contiguous, other strides free): q_lat/out [T, H, kv_lora_rank]; q_pe [T, H, rope];
    latent [slots, L + rope] (the layer's pool buffer, in the query dtype) holding the rows of every
    request's prefix AND new tokens; per-request vectors [bs]; `tree_mask` uint8 flat, request i's
    row-major [e_i, e_i] block starting at `mask_start[i]`.
    """
    bs = int(req_pool_indices.shape[0])
    num_tokens, num_heads, lora = q_lat.shape
    if bs == 0 or max_extend_len <= 0 or num_tokens == 0:
        return
    rope = latent.shape[1] - kv_lora_rank
    if lora != kv_lora_rank or q_pe.shape[-1] != rope:
        raise ValueError(f"latent extend: q_lat width {lora} / q_pe width {q_pe.shape[-1]} do not match the pool "
                         f"rows ({kv_lora_rank} + {rope})")
    cfg = config
    grid = (bs, triton.cdiv(max_extend_len, cfg.block_t), triton.cdiv(num_heads, cfg.block_h))
    _latent_extend_kernel[grid](
        q_lat,
        q_pe,
        out,
        latent,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        extend_lens,
        extend_start,
        tree_mask if tree_mask is not None else extend_start,  # any pointer: unread without a mask
        mask_start if mask_start is not None else extend_start,
        sm_scale * LOG2E,
        num_heads,
        q_lat.stride(0),
        q_lat.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        out.stride(0),
        out.stride(1),
        latent.stride(0),
        req_to_token.stride(0),
        LORA=lora,
        ROPE=rope,
        BLOCK_L=triton.next_power_of_2(lora),
        BLOCK_R=max(16, triton.next_power_of_2(rope)),
        BLOCK_T=cfg.block_t,
        BLOCK_H=cfg.block_h,
        BLOCK_N=cfg.block_n,
        HAS_TREE_MASK=tree_mask is not None,
        IEEE=q_lat.dtype == torch.float32,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
