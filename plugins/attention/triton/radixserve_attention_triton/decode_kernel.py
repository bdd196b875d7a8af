"""Decode attention (one query token per request) over the token-slot KV pool, split-KV style.

Stage 1: program (request, KV head, split) walks its slice of the request's KV (slots read through
`req_to_token`) for all query heads of that KV head's group at once (GQA: K/V are read once per
group), and writes a normalised partial output plus its log2-sum-exp per head.
Stage 2: program (request, query head) merges the partials of the request's splits.

The number of splits per request is a device tensor (see `compute_num_kv_splits`) and the grid's
split axis is the fixed `max_kv_splits`, so a launch never depends on host-side lengths: that is
what lets CUDA graphs replay it with new lengths. With a work list (`decode_work.py`, large batches) the
grid is instead a bound on the planned (request, split) items, each program looking up its own.

FP8 KV pools (KV_FP8): K and V tiles are loaded as float8_e4m3fn (half the bytes of bf16) and
widened to q's dtype, which is exact; the dequantization `stored * scale` is applied to the
tile's results instead of every element: the k scale is folded into the softmax scale (scores
are q . (k_stored * k_scale) = k_scale * (q . k_stored)) and the v scale multiplies the split's
accumulated output (sum_j p_j * v_stored_j * v_scale), the same numbers with fewer multiplies.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
import triton.language.extra.cuda  # noqa: F401 - tl.extra.cuda.gdc_launch_dependents
from radixserve.layers import triton_interpreter as _interpreter_compat
from radixserve.layers.kv_splits import compute_num_kv_splits  # noqa: F401 - re-exported (its old home)
from radixserve.layers.triton_softmax import NEG_BIG, store_split_partial
from radixserve.layers.triton_support import pdl_launch, trigger_dependents

from radixserve_attention_triton.decode_work import DecodeWork
from radixserve_attention_triton.pool_keys import attend_pool_keys, prefetch_rows_l2

_interpreter_compat.apply()


@triton.jit
def _decode_stage1_kernel(
    Q,
    K_buf,
    V_buf,
    ReqToToken,
    req_pool_idx_ptr,
    seq_lens_ptr,
    num_splits_ptr,
    work_request_ptr,
    work_split_start_ptr,
    bs,
    MidO,
    MidLse,
    sm_scale,
    v_scale,
    logit_cap,
    window,
    stride_qb,
    stride_qh,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    stride_r2t,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    KV_FP8: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 q/k/v: exact fp32 products (dot_qk)
    GDC: tl.constexpr,  # PDL-launched (`decode_pdl`): the split's first K/V rows prefetched into L2, then the wait
    TRIGGER: tl.constexpr,  # the merge kernel after it is PDL-launched (`decode_merge_pdl`): it may start now
    WORK_LIST: tl.constexpr,  # axis 0 indexes the planned (request, split) items (decode_work.py), axis 2 is 1
):
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    kvh = tl.program_id(1)
    # the batch's metadata is written before the forward starts, never by the kernel just before this
    # one (the rotary + KV store): it may be read before the PDL wait
    if WORK_LIST:
        item = tl.program_id(0)
        b = tl.load(work_request_ptr + item)
        if b >= bs:  # past the batch's planned items
            return
        split = item - tl.load(work_split_start_ptr + b)
        n_splits = tl.load(num_splits_ptr + b).to(tl.int32)
    else:
        b = tl.program_id(0)
        split = tl.program_id(2)
        n_splits = tl.load(num_splits_ptr + b).to(tl.int32)
        if split >= n_splits:
            return
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    req = tl.load(req_pool_idx_ptr + b).to(tl.int64)
    # a sliding window: only the last `window` keys (the new token's included) are read
    kv_start = seq_len * 0
    if HAS_WINDOW:
        kv_start = tl.maximum(seq_len - window, 0)
    # Splits are whole multiples of BLOCK_N so loads stay aligned; trailing splits may be empty.
    split_len = tl.cdiv(tl.cdiv(seq_len - kv_start, n_splits), BLOCK_N) * BLOCK_N
    lo = kv_start + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    if GDC:
        # While the rotary + KV store kernel runs: the slots of the split's first tile and its K and V rows
        # into L2 (no data in registers: the new token's row may still be being written, and L2 is where that
        # write lands). Then wait for that kernel: q and the rows are read after it. One tile: at batch 1 a
        # split is one tile (min_split_tokens = BLOCK_N), and each tile's prefetch waits on its slots' load.
        pf_n = lo + offs_n
        pf_slot = tl.load(ReqToToken + req * stride_r2t + pf_n, mask=pf_n < hi, other=0).to(tl.int64)  # 0: any row
        row_bytes: tl.constexpr = HEAD_DIM * K_buf.dtype.element_ty.primitive_bitwidth // 8
        prefetch_rows_l2(K_buf + pf_slot * stride_kbs + kvh * stride_kbh, row_bytes)
        prefetch_rows_l2(V_buf + pf_slot * stride_vbs + kvh * stride_vbh, row_bytes)
        tl.extra.cuda.gdc_wait()
    heads = kvh * GROUP + offs_h
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_H], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    r2t_row = ReqToToken + req * stride_r2t
    # the window is already in `lo` (kv_start), so the pass runs without one
    m_i, l_i, acc = attend_pool_keys(q, offs_h, m_i, l_i, acc, r2t_row, K_buf, V_buf, kvh, lo, hi, sm_scale, logit_cap,
                                     window, stride_kbs, stride_kbh, stride_vbs, stride_vbh, offs_n, offs_d, mask_d,
                                     BLOCK_N, HAS_CAP, False, KV_FP8, IEEE)
    if KV_FP8:
        acc = acc * v_scale

    store_split_partial(MidO, MidLse, b, heads, split, offs_d, mask_h, mask_d, m_i, l_i, acc,
                        stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh)


@triton.jit
def _merge_splits(MidO, MidLse, Out, b, h, n_splits, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
                  stride_ob, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Out[b, h] = the split partials of (b, h) weighted by their sum-exps."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < n_splits
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(MidLse + b * stride_mlb + h * stride_mlh + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # a zero-length (padding) request: all weights 0
    w = tl.exp2(lse - m)
    parts = tl.load(
        MidO + b * stride_mob + h * stride_moh + offs_s[:, None] * stride_mos + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * parts, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)


@triton.jit
def _decode_stage2_kernel(
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
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    TRIGGER: tl.constexpr,
    GDC: tl.constexpr,  # PDL-launched after the split kernel (`decode_merge_pdl`): the partials after the wait
):
    if TRIGGER:  # a PDL-launched GEMV after it (o_proj, runtime.batch1_gemv_pdl) may start loading its weights
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    n_splits = tl.load(num_splits_ptr + b).to(tl.int32)  # the batch's metadata: never the split kernel's output
    if GDC:
        tl.extra.cuda.gdc_wait()
    _merge_splits(MidO, MidLse, Out, b, h, n_splits, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
                  stride_ob, stride_oh, HEAD_DIM, BLOCK_D, BLOCK_S)


# Programmatic dependent launch of the decode attention's split kernel after the rotary + KV store kernel
# (which then signals launch_dependents at its start): the slots and K/V rows of each split's first tile go
# to L2 while that kernel runs. On where `triton_support.trigger_dependents` holds (sm90+, a Triton with PDL,
# not the interpreter): -0.045 ms a Qwen3-30B-A3B batch-1 step on an H100, Llama-3.1-8B unchanged (session 23);
# RADIXSERVE_DECODE_ATTENTION_PDL=0 turns it off.
DECODE_PDL = os.environ.get("RADIXSERVE_DECODE_ATTENTION_PDL", "1") != "0"


def decode_pdl(t: torch.Tensor) -> bool:
    """Whether the decode attention on t's device runs PDL-launched (DECODE_PDL, and sm90+ with a
    Triton that has PDL)."""
    return DECODE_PDL and trigger_dependents(t)


# Programmatic dependent launch of the merge (stage 2) after the split kernel, which then signals
# launch_dependents at its start: the merge's programs are resident and waiting when the splits finish, in place
# of a launch after them. Off by default, with RADIXSERVE_ROTARY_STORE_PDL: the pair saved 0.04 ms of a
# Qwen3-30B-A3B batch-1 step on an H100 (session 24) but cost Llama-3.1-8B 3.6% of its Engine batch-1 decode rate
# beside the batch-1 GEMVs' own PDL launches, and gained Qwen3's Engine run nothing (session 27:
# benchmarks/results/h100-session27.md). RADIXSERVE_DECODE_MERGE_PDL=1 turns it on.
DECODE_MERGE_PDL = os.environ.get("RADIXSERVE_DECODE_MERGE_PDL", "0") != "0"


def decode_merge_pdl(t: torch.Tensor) -> bool:
    """Whether the decode attention's merge kernel on t's device runs PDL-launched (DECODE_MERGE_PDL,
    and sm90+ with a Triton that has PDL)."""
    return DECODE_MERGE_PDL and trigger_dependents(t)


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int
    num_warps: int
    num_stages: int


def decode_config(head_dim: int, interpret: bool) -> DecodeConfig:
    """Tiles per head dim. D <= 128 values were picked by the H200 sweep recorded in
    benchmarks/results/h200-attention-kernels.md; D = 256 keeps 32-token tiles (2 stages of 128-token
    K and V tiles would not fit in shared memory)."""
    if interpret:
        return DecodeConfig(16, 1, 1)
    block_d = triton.next_power_of_2(head_dim)
    if block_d <= 64:
        return DecodeConfig(64, 4, 2)
    if block_d <= 128:
        return DecodeConfig(128, 4, 2)
    return DecodeConfig(32, 4, 2)


def decode_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_splits: torch.Tensor,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    sm_scale: float,
    interpret: bool = False,
    config: DecodeConfig | None = None,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    pdl: bool = False,
    merge_pdl: bool = False,
    work: DecodeWork | None = None,
) -> None:
    """Write decode attention into `out` (tiles from `config`, else `decode_config`).

    `work` (planned by `decode_work.plan_decode_work` from `num_kv_splits`): one split program per planned
    (request, split) item instead of one per request and split slot.

    `pdl` (see `decode_pdl`): launch the split kernel with programmatic dependent launch; it prefetches
    its keys and values into L2 before it waits for the kernel before it. `merge_pdl` (see
    `decode_merge_pdl`): launch the merge kernel with it after the split kernel. Both ignored in the
    interpreter.

    An fp8 pool (k_buf/v_buf float8_e4m3fn): the real keys and values are `stored * k_scale` and
    `stored * v_scale` (the layer's `KVPool.kv_scales`); q stays in the model dtype.

    `sliding_window` W: each request attends its last W keys only; `logit_cap` c: scores are
    soft-capped to c * tanh(score / c) (None: off, for both).

    Shapes: q/out [bs, H, D]; k_buf/v_buf [slots, KVH, D]; num_kv_splits int32 [bs];
    mid_o float32 [>=bs, H, S, D] and mid_lse float32 [>=bs, H, S] are scratch, S = max splits
    (the grid's split axis). Each request's KV (its new token included) must already be in the pool.
    """
    bs, num_heads, head_dim = q.shape
    if bs == 0:
        return
    num_kv_heads = k_buf.shape[1]
    group = num_heads // num_kv_heads
    kv_fp8 = k_buf.dtype == torch.float8_e4m3fn
    if kv_fp8 != (v_buf.dtype == torch.float8_e4m3fn) or (not kv_fp8 and (k_scale, v_scale) != (1.0, 1.0)):
        raise ValueError(f"k/v scales need float8_e4m3fn K and V buffers (got {k_buf.dtype}, {v_buf.dtype}, "
                         f"scales {k_scale}, {v_scale})")
    max_splits = mid_o.shape[2]
    cfg = config or decode_config(head_dim, interpret)
    pdl, merge_pdl = pdl and not interpret, merge_pdl and not interpret
    block_d = triton.next_power_of_2(head_dim)
    grid = (work.request.shape[0], num_kv_heads, 1) if work is not None else (bs, num_kv_heads, max_splits)
    _decode_stage1_kernel[grid](
        q,
        k_buf,
        v_buf,
        req_to_token,
        req_pool_indices,
        seq_lens,
        num_kv_splits,
        work.request if work is not None else num_kv_splits,  # unread without WORK_LIST
        work.split_start if work is not None else num_kv_splits,
        bs,
        mid_o,
        mid_lse,
        sm_scale * k_scale,
        float(v_scale),
        float(logit_cap or 1.0),
        int(sliding_window or 0),
        q.stride(0),
        q.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_H=max(16, triton.next_power_of_2(group)),  # tl.dot needs >= 16 rows
        BLOCK_N=cfg.block_n,
        BLOCK_S=triton.next_power_of_2(max_splits),
        HAS_CAP=bool(logit_cap),
        HAS_WINDOW=bool(sliding_window),
        KV_FP8=kv_fp8,
        IEEE=q.dtype == torch.float32,
        TRIGGER=merge_pdl,
        WORK_LIST=work is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch(pdl),
    )
    _decode_stage2_kernel[(bs, num_heads)](
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
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_S=triton.next_power_of_2(max_splits),
        TRIGGER=not interpret and trigger_dependents(out),
        num_warps=4 if not interpret else 1,
        **pdl_launch(merge_pdl),
    )
