"""Absorbed latent decode attention (MLA), split-KV, over a LatentKVPool layer buffer.

Inputs are already in latent space: per request b and head h the query is `q_lat[b, h]`
(`q_nope @ W_UK[h]`, kv_lora_rank wide) plus `q_pe[b, h]` (rope wide); the keys and values of the
request are its pool rows `[c_kv, k_pe]` (slots read through `req_to_token`). Per head:
score = scale * (q_lat . c_kv + q_pe . k_pe), o_lat = softmax(scores) @ c_kv.

Stage 1: program (request, block of heads, KV split) walks its slice of the request's rows and
loads each row ONCE for the whole block of heads (every head of an MLA layer shares the same latent
row: that sharing is where MLA saves memory bandwidth), writing a normalised partial o_lat and its
log2-sum-exp per head.
Stage 2: program (request, head) merges the partials of the request's splits (online, split by split).

The split count per request is a device tensor (planned by the triton plugin's
`compute_num_kv_splits`) and the grid's split axis is the fixed `max_kv_splits`, so a launch never
depends on host-side lengths and CUDA graphs can replay it with new lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from radixserve.layers import triton_interpreter
from radixserve.layers.triton_softmax import LOG2E, NEG_BIG, dot_qk, online_softmax_step, store_split_partial

triton_interpreter.apply()


@triton.jit
def _latent_decode_split_kernel(
    QLat,
    QPe,
    Latent,
    ReqToToken,
    req_pool_idx_ptr,
    seq_lens_ptr,
    num_splits_ptr,
    MidO,
    MidLse,
    sm_scale_log2,
    num_heads,
    stride_qlb,
    stride_qlh,
    stride_qpb,
    stride_qph,
    stride_lat,
    stride_r2t,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    LORA: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 operands: exact fp32 products (triton_softmax.dot_qk)
):
    b = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    n_splits = tl.load(num_splits_ptr + b).to(tl.int32)
    if split >= n_splits:
        return
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    req = tl.load(req_pool_idx_ptr + b).to(tl.int64)
    # splits are whole multiples of BLOCK_N; trailing splits of a short request may be empty
    split_len = tl.cdiv(tl.cdiv(seq_len, n_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    mask_h = heads < num_heads
    mask_l = offs_l < LORA
    mask_r = offs_r < ROPE
    q_lat = tl.load(
        QLat + b * stride_qlb + heads[:, None] * stride_qlh + offs_l[None, :],
        mask=mask_h[:, None] & mask_l[None, :],
        other=0.0,
    )
    q_pe = tl.load(
        QPe + b * stride_qpb + heads[:, None] * stride_qph + offs_r[None, :],
        mask=mask_h[:, None] & mask_r[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_H], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    r2t_row = ReqToToken + req * stride_r2t
    for start in range(lo, hi, BLOCK_N):
        n = start + offs_n
        mask_n = n < hi
        slot = tl.load(r2t_row + n, mask=mask_n, other=0).to(tl.int64)
        row = Latent + slot[:, None] * stride_lat
        c_kv = tl.load(row + offs_l[None, :], mask=mask_n[:, None] & mask_l[None, :], other=0.0)
        k_pe = tl.load(row + LORA + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0)
        qk = dot_qk(q_lat, c_kv, IEEE) + dot_qk(q_pe, k_pe, IEEE)
        qk = tl.where(mask_n[None, :], qk * sm_scale_log2, float("-inf"))
        m_i, l_i, acc = online_softmax_step(qk, c_kv, m_i, l_i, acc, IEEE)

    store_split_partial(MidO, MidLse, b, heads, split, offs_l, mask_h, mask_l, m_i, l_i, acc,
                        stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh)


@triton.jit
def _latent_decode_merge_kernel(
    MidO,
    MidLse,
    Out,
    num_splits_ptr,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    LORA: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    n_splits = tl.load(num_splits_ptr + b).to(tl.int32)
    offs_l = tl.arange(0, BLOCK_L)
    mask_l = offs_l < LORA
    # the running max, sum and output are kept as [BLOCK_L] vectors (all lanes of m and l equal):
    # one loop-carried type for every split, no scalar/vector mix
    m = tl.full([BLOCK_L], NEG_BIG, dtype=tl.float32)
    total = tl.zeros([BLOCK_L], dtype=tl.float32)
    acc = tl.zeros([BLOCK_L], dtype=tl.float32)
    lse_ptr = MidLse + b * stride_mlb + h * stride_mlh + offs_l * 0
    part_ptr = MidO + b * stride_mob + h * stride_moh + offs_l
    for s in range(0, n_splits):
        lse = tl.load(lse_ptr + s)  # -inf for an empty split: weight 0
        part = tl.load(part_ptr + s * stride_mos, mask=mask_l, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha + w * part
        total = total * alpha + w
        m = m_new
    out = acc / tl.where(total > 0.0, total, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_l, out.to(Out.dtype.element_ty), mask=mask_l)


@dataclass(frozen=True)
class LatentDecodeConfig:
    block_h: int  # heads per program (rows of the dot; >= 16)
    block_n: int  # latent rows per step
    num_warps: int
    num_stages: int


def latent_decode_config(num_heads: int, kv_lora_rank: int, interpret: bool) -> LatentDecodeConfig:
    """Tiles: 16 heads per program (tl.dot's minimum rows; DeepSeek has 16 or more per rank) and
    32-row tiles for kv_lora_rank 512 (a [16, 512] fp32 accumulator is 64 registers a thread with
    4 warps; two stages of 32 x 512 bf16 rows fit shared memory easily)."""
    if interpret:
        return LatentDecodeConfig(16, 16, 1, 1)
    block_n = 32 if triton.next_power_of_2(kv_lora_rank) >= 512 else 64
    return LatentDecodeConfig(16, block_n, 4, 2)


def num_head_blocks(num_heads: int, config: LatentDecodeConfig) -> int:
    """Stage-1 programs per request and split (the split planner's 'heads' factor)."""
    return triton.cdiv(num_heads, config.block_h)


def latent_decode_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    out: torch.Tensor,
    latent: torch.Tensor,
    kv_lora_rank: int,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_splits: torch.Tensor,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    sm_scale: float,
    config: LatentDecodeConfig,
) -> None:
    """Write absorbed latent decode attention `o_lat` into `out`.

    Shapes (any strides whose last dim is contiguous): q_lat/out [bs, H, kv_lora_rank] (e.g. a
    transposed view of a `[H, bs, L]` bmm result); q_pe [bs, H, rope]; latent [slots, L + rope], the
    layer's LatentKVPool buffer in the query dtype; num_kv_splits int32 [bs] (>= 1); mid_o float32
    [>=bs, H, S, L] and mid_lse float32 [>=bs, H, S] are scratch, S = the grid's split axis. Each
    request's rows (its new token included) must already be in the pool.
    """
    bs, num_heads, lora = q_lat.shape
    if bs == 0:
        return
    rope = latent.shape[1] - kv_lora_rank
    if lora != kv_lora_rank or q_pe.shape[-1] != rope:
        raise ValueError(f"latent decode: q_lat width {lora} / q_pe width {q_pe.shape[-1]} do not match the pool "
                         f"rows ({kv_lora_rank} + {rope})")
    max_splits = mid_o.shape[2]
    block_l = triton.next_power_of_2(lora)
    _latent_decode_split_kernel[(bs, num_head_blocks(num_heads, config), max_splits)](
        q_lat,
        q_pe,
        latent,
        req_to_token,
        req_pool_indices,
        seq_lens,
        num_kv_splits,
        mid_o,
        mid_lse,
        sm_scale * LOG2E,
        num_heads,
        q_lat.stride(0),
        q_lat.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        latent.stride(0),
        req_to_token.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        LORA=lora,
        ROPE=rope,
        BLOCK_L=block_l,
        BLOCK_R=max(16, triton.next_power_of_2(rope)),  # tl.dot needs K >= 16
        BLOCK_H=config.block_h,
        BLOCK_N=config.block_n,
        IEEE=q_lat.dtype == torch.float32,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    _latent_decode_merge_kernel[(bs, num_heads)](
        mid_o,
        mid_lse,
        out,
        num_kv_splits,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        LORA=lora,
        BLOCK_L=block_l,
        num_warps=1 if config.num_warps == 1 else 4,
    )
