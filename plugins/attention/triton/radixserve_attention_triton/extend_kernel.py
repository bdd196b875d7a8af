"""Extend (prefill) attention over the token-slot KV pool, variable lengths in one launch.

Each program owns one query head and one work item: a request and a block of BLOCK_M of its new
tokens, read from a work table (`ExtendWork`) planned on the host from the batch's lengths, costliest
blocks first, so the grid holds only blocks that exist (a batch of one long prompt and many decode rows
no longer launches a prompt's worth of empty blocks for every decode row). A table entry with request
-1 is padding: CUDA graphs of extend batches launch a fixed-size table. It attends in two stages with
one running (online) softmax:
  1. the request's cached prefix, whose K/V slots are read through `req_to_token` (page size 1);
  2. the new tokens' own K/V, read contiguously from the packed k/v inputs, with a causal mask;
     for a speculative verify of draft trees (HAS_TREE_MASK) also with the request's [e, e] tree
     mask block (`ForwardBatch.tree_mask`): a draft token sees only its ancestors and itself.
Per-layer options: a sliding window (HAS_WINDOW; query at position p sees keys at positions
> p - window; prefix blocks wholly before a query block's window are skipped) and soft-capping of
the scores (HAS_CAP). In a tree a draft token sits at prefix + its depth (`Depth`, per new token).
FP8 KV (KV_FP8): the pool and the new tokens' k/v are float8_e4m3fn (the new ones as the pool
stores them, so a token's keys are the same numbers in the forward that wrote it and in every
later one); tiles are widened to q's dtype, the k scale is folded into the softmax scale and the
v scale multiplies the accumulated output (see decode_kernel.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from radixserve.layers import triton_interpreter as _interpreter_compat
from radixserve.layers.triton_softmax import NEG_BIG, dot_qk, online_softmax_step, scores_log2

from radixserve_attention_triton.pool_keys import attend_pool_keys

_interpreter_compat.apply()


@triton.jit
def _load_rows(ptrs, mask_d, EVEN_D: tl.constexpr):
    """Load a [rows, BLOCK_D] tile whose rows are all valid; mask columns only when D is padded."""
    if EVEN_D:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=mask_d[None, :], other=0.0)
    return x


@triton.jit
def _single_token_heads(
    Q, K_new, V_new, Out, K_buf, V_buf, r2t_row, h, prefix_len, tok, sm_scale, v_scale, logit_cap, window,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr, HAS_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr, KV_FP8: tl.constexpr, IEEE: tl.constexpr,
):
    """A request with one new token (a decode row riding in an extend batch): the GROUP query heads
    h .. h + GROUP - 1 that share KV head h // GROUP in one [BLOCK_G, D] tile, so each cached key is
    read once per KV head instead of once per query head, and no 63 of 64 query rows are empty."""
    kvh = h // GROUP
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    q = tl.load(Q + tok * stride_qt + (h + offs_g)[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    m_i = tl.full([BLOCK_G], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    prefix_lo = prefix_len * 0
    if HAS_WINDOW:  # the token sits at position prefix_len
        prefix_lo = tl.maximum(prefix_len - window + 1, 0)
    m_i, l_i, acc = attend_pool_keys(q, tl.zeros([BLOCK_G], dtype=tl.int32), m_i, l_i, acc, r2t_row, K_buf, V_buf, kvh,
                                   prefix_lo, prefix_len, sm_scale, logit_cap, window, stride_kbs, stride_kbh,
                                   stride_vbs, stride_vbh, offs_n, offs_d, mask_d, BLOCK_N, HAS_CAP, HAS_WINDOW,
                                   KV_FP8, IEEE)
    # the token itself: a block whose first key is the only one
    mask_n = offs_n < 1
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(K_new + (tok + offs_n)[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    if KV_FP8:
        k = k.to(q.dtype)
    qk = scores_log2(dot_qk(q, k, IEEE), sm_scale, logit_cap, HAS_CAP)
    qk = tl.where(mask_n[None, :], qk, float("-inf"))
    v = tl.load(V_new + (tok + offs_n)[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    if KV_FP8:
        v = v.to(q.dtype)
    m_i, l_i, acc = online_softmax_step(qk, v, m_i, l_i, acc, IEEE)
    if KV_FP8:
        acc = acc * v_scale
    out = acc / l_i[:, None]
    tl.store(Out + tok * stride_ot + (h + offs_g)[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])


@triton.jit
def _extend_kernel(
    Q,
    K_new,
    V_new,
    Out,
    K_buf,
    V_buf,
    ReqToToken,
    req_pool_idx_ptr,
    prefix_lens_ptr,
    extend_lens_ptr,
    extend_start_ptr,
    work_req_ptr,
    work_m_ptr,
    TreeMask,
    mask_start_ptr,
    Depth,
    sm_scale,
    v_scale,
    logit_cap,
    window,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    stride_r2t,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    EVEN_D: tl.constexpr,
    HAS_TREE_MASK: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    KV_FP8: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 q/k/v: exact fp32 products (dot_qk)
):
    # one work item for each of its query heads in turn: a costly block starts on every head early
    item = tl.program_id(0) // NUM_HEADS
    h = tl.program_id(0) % NUM_HEADS
    b = tl.load(work_req_ptr + item)
    if b < 0:  # padding of a fixed-size table
        return
    m_start = tl.load(work_m_ptr + item)
    prefix_len = tl.load(prefix_lens_ptr + b).to(tl.int32)
    ext_start = tl.load(extend_start_ptr + b).to(tl.int64)
    req = tl.load(req_pool_idx_ptr + b).to(tl.int64)
    if m_start < 0:  # a one-token request, planned with its query heads packed by KV head
        if h % GROUP == 0:
            _single_token_heads(
                Q, K_new, V_new, Out, K_buf, V_buf, ReqToToken + req * stride_r2t, h, prefix_len, ext_start,
                sm_scale, v_scale, logit_cap, window, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                stride_vh, stride_ot, stride_oh, stride_kbs, stride_kbh, stride_vbs, stride_vbh,
                GROUP, HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_G, HAS_CAP, HAS_WINDOW, KV_FP8, IEEE)
        return
    ext_len = tl.load(extend_lens_ptr + b).to(tl.int32)
    if m_start >= ext_len:  # a dense table (planned without host lengths) holds blocks past the end
        return
    kvh = h // GROUP

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < ext_len
    mask_d = offs_d < HEAD_DIM

    q_ptrs = Q + (ext_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Positions relative to prefix_len: new token j at j, a draft token at its depth in the tree.
    q_rel = offs_m
    prefix_lo = prefix_len * 0  # first prefix key any query of this block can see
    new_lo = prefix_len * 0  # first earlier new token (a multiple of BLOCK_N) any query can see
    if HAS_TREE_MASK:
        if HAS_WINDOW:
            q_rel = tl.load(Depth + ext_start + offs_m, mask=mask_m, other=0).to(tl.int32)
    if HAS_WINDOW:
        if HAS_TREE_MASK:
            prefix_lo = tl.maximum(prefix_len - window + 1, 0)  # depths start at 0
        else:
            prefix_lo = tl.maximum(prefix_len + m_start - window + 1, 0)
            new_lo = (tl.maximum(m_start - window + 1, 0) // BLOCK_N) * BLOCK_N

    # Stage 1: the cached prefix, gathered slot by slot through req_to_token.
    m_i, l_i, acc = attend_pool_keys(q, q_rel, m_i, l_i, acc, ReqToToken + req * stride_r2t, K_buf, V_buf, kvh,
                                   prefix_lo, prefix_len, sm_scale, logit_cap, window, stride_kbs, stride_kbh,
                                   stride_vbs, stride_vbh, offs_n, offs_d, mask_d, BLOCK_N, HAS_CAP, HAS_WINDOW,
                                   KV_FP8, IEEE)

    if HAS_TREE_MASK:  # this request's row-major [ext_len, ext_len] block of the flat mask
        mask_row = TreeMask + tl.load(mask_start_ptr + b).to(tl.int64) + offs_m[:, None].to(tl.int64) * ext_len

    # Stage 2a: new tokens before this query block: every query sees every key, no mask on rows
    # (except a tree mask's). BLOCK_M is a multiple of BLOCK_N, so these blocks end exactly at m_start.
    for start in range(new_lo, m_start, BLOCK_N):
        tok = (ext_start + start + offs_n)[:, None]
        k = _load_rows(K_new + tok * stride_kt + kvh * stride_kh + offs_d[None, :], mask_d, EVEN_D)
        if KV_FP8:
            k = k.to(q.dtype)
        qk = scores_log2(dot_qk(q, k, IEEE), sm_scale, logit_cap, HAS_CAP)
        if HAS_TREE_MASK:
            seen = tl.load(mask_row + (start + offs_n)[None, :], mask=mask_m[:, None], other=0)
            qk = tl.where(seen != 0, qk, float("-inf"))
        if HAS_WINDOW:
            k_rel = start + offs_n
            if HAS_TREE_MASK:
                k_rel = tl.load(Depth + ext_start + start + offs_n).to(tl.int32)
            qk = tl.where(k_rel[None, :] > q_rel[:, None] - window, qk, float("-inf"))
        v = _load_rows(V_new + tok * stride_vt + kvh * stride_vh + offs_d[None, :], mask_d, EVEN_D)
        if KV_FP8:
            v = v.to(q.dtype)
        m_i, l_i, acc = online_softmax_step(qk, v, m_i, l_i, acc, IEEE)

    # Stage 2b: the diagonal, causal; keys past this block's last query are never needed.
    hi = tl.minimum(ext_len, m_start + BLOCK_M)
    for start in range(m_start, hi, BLOCK_N):
        n = start + offs_n
        mask_n = n < hi
        kv_mask = mask_n[:, None] & mask_d[None, :]
        tok = (ext_start + n)[:, None]
        k = tl.load(K_new + tok * stride_kt + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
        qk = scores_log2(dot_qk(q, k, IEEE), sm_scale, logit_cap, HAS_CAP)
        causal = (offs_m[:, None] >= n[None, :]) & mask_n[None, :]
        if HAS_TREE_MASK:
            seen = tl.load(mask_row + n[None, :], mask=mask_m[:, None] & causal, other=0)
            causal = causal & (seen != 0)
        if HAS_WINDOW:
            k_rel = n
            if HAS_TREE_MASK:
                k_rel = tl.load(Depth + ext_start + n, mask=mask_n, other=0).to(tl.int32)
            causal = causal & (k_rel[None, :] > q_rel[:, None] - window)
        qk = tl.where(causal, qk, float("-inf"))
        v = tl.load(V_new + tok * stride_vt + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            v = v.to(q.dtype)
        m_i, l_i, acc = online_softmax_step(qk, v, m_i, l_i, acc, IEEE)

    if KV_FP8:
        acc = acc * v_scale
    out = acc / l_i[:, None]
    o_ptrs = Out + (ext_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


@dataclass(frozen=True)
class ExtendConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def extend_config(head_dim: int, dtype: torch.dtype, interpret: bool) -> ExtendConfig:
    """Tile sizes per head dim, within Hopper's ~227 KB of shared memory. D in (64, 128] uses the
    best all-round tile of the H200 sweep in benchmarks/results/h200-attention-kernels.md."""
    if interpret:
        return ExtendConfig(16, 16, 1, 1)  # small tiles: more loop iterations exercised on tiny inputs
    block_d = triton.next_power_of_2(head_dim)
    wide = torch.empty((), dtype=dtype).element_size() >= 4
    if block_d <= 64:
        cfg = ExtendConfig(128, 64, 4, 3)
    elif block_d <= 128:
        cfg = ExtendConfig(64, 64, 4, 3)
    else:
        cfg = ExtendConfig(64, 32, 8, 2)
    if wide:  # fp32 tiles take twice the shared memory
        cfg = ExtendConfig(max(16, cfg.block_m // 2), max(16, cfg.block_n // 2), cfg.num_warps, cfg.num_stages)
    return cfg


@dataclass(frozen=True)
class ExtendWork:
    """The extend kernel's work table: int32 `[2, n]` on the kernel's device; item i is request
    `req[i]`'s query block starting at new token `m_start[i]` (the table's two rows); `req[i] == -1`
    marks padding, `m_start[i] == -1` a request of one new token computed with its query heads packed
    per KV head. Valid only for kernels with this `block_m`."""

    table: torch.Tensor
    block_m: int

    @property
    def req(self) -> torch.Tensor:
        return self.table[0]

    @property
    def m_start(self) -> torch.Tensor:
        return self.table[1]

    @property
    def size(self) -> int:
        return int(self.table.shape[1])


def plan_extend_blocks(prefix_lens: list[int], extend_lens: list[int], block_m: int,
                       pack_single_tokens: bool = True) -> tuple[list[int], list[int]]:
    """(request of each work item, its first new token) for every query block of every request, the
    blocks that read the most keys (prefix + the tokens up to the block's end) first: they set the
    kernel's tail. With `pack_single_tokens` (not for tree masks), a request of one new token is one
    item with first token -1: its query heads are computed in tiles of one KV head's group. Host
    lists in, host lists out."""
    items = []
    for b, (prefix, ext) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        if ext == 1 and pack_single_tokens:
            items.append((prefix + 1, b, -1))
            continue
        for m in range(0, ext, block_m):
            items.append((prefix + min(m + block_m, ext), b, m))
    items.sort(key=lambda item: -item[0])  # stable: ties keep request order
    return [b for _, b, _ in items], [m for _, _, m in items]


def write_extend_plan(work: ExtendWork, prefix_lens: list[int], extend_lens: list[int]) -> None:
    """Plan the batch's blocks into an existing (static) table, padding the rest with -1; raises
    ValueError when they do not fit. One host-to-device copy. For batches without a tree mask (graphs of
    extend batches)."""
    reqs, starts = plan_extend_blocks(prefix_lens, extend_lens, work.block_m)
    if len(reqs) > work.size:
        raise ValueError(f"{len(reqs)} extend blocks do not fit a work table of {work.size}")
    pad = work.size - len(reqs)
    work.table.copy_(torch.tensor([reqs + [-1] * pad, starts + [0] * pad], dtype=torch.int32), non_blocking=True)


def planned_extend_work(prefix_lens: list[int], extend_lens: list[int], block_m: int,
                        device: torch.device | str, pack_single_tokens: bool = True) -> ExtendWork:
    """A work table holding exactly the batch's blocks (host lengths in; one host-to-device copy)."""
    reqs, starts = plan_extend_blocks(prefix_lens, extend_lens, block_m, pack_single_tokens)
    return ExtendWork(torch.tensor([reqs, starts], dtype=torch.int32).to(device, non_blocking=True), block_m)


def dense_extend_work(bs: int, max_extend_len: int, block_m: int, device: torch.device | str) -> ExtendWork:
    """Every request x every block up to `max_extend_len`, made on the device without host lengths
    (the kernel skips blocks past a request's end); the last blocks first."""
    blocks = triton.cdiv(max_extend_len, block_m)
    req = torch.arange(bs, dtype=torch.int32, device=device).repeat(blocks)
    m_start = (blocks - 1 - torch.arange(blocks, dtype=torch.int32, device=device)).repeat_interleave(bs) * block_m
    return ExtendWork(torch.stack([req, m_start]), block_m)


def extend_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    out: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    interpret: bool = False,
    config: ExtendConfig | None = None,
    tree_mask: torch.Tensor | None = None,
    mask_start: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    depths: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    work: ExtendWork | None = None,
) -> None:
    """Write attention of the packed new tokens into `out` (tiles from `config`, else `extend_config`).

    `work`: the blocks to compute (`planned_extend_work` from host lengths, or a static table of a
    CUDA graph refreshed by `write_extend_plan`), planned for the config's `block_m`; None: every
    request x `cdiv(max_extend_len, block_m)` blocks (`dense_extend_work`). The launch is
    `work.size * num_heads` programs whatever the lengths, so a captured launch stays valid.

    `tree_mask` (uint8, flat; request i's row-major [e_i, e_i] block starts at `mask_start[i]`)
    restricts which new tokens each new token sees (speculative verify of draft trees); the
    causal rule still applies and the prefix stays fully visible.
    `sliding_window` W (None: off): a query at position p sees keys at positions > p - W; with a
    tree mask `depths` (int32 [T], each new token's depth in its draft tree) places draft tokens.
    `logit_cap` c (None: off): scores become c * tanh(score / c).
    An fp8 pool (k_buf/v_buf float8_e4m3fn) needs k_new/v_new in float8_e4m3fn too (as
    `KVPool.quantize_kv` gives them); real values are `stored * k_scale` / `stored * v_scale`.

    Shapes: q/out [T, H, D]; k_new/v_new [T, KVH, D]; k_buf/v_buf [slots, KVH, D] (last dim
    contiguous everywhere); req_to_token [rows, max_ctx]; per-request vectors [bs]. H must be a
    multiple of KVH. The prefix K/V must already be in the pool; new tokens' K/V come from k_new/v_new.
    """
    bs = int(req_pool_indices.shape[0])
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_new.shape[1]
    if work is None and (bs == 0 or max_extend_len <= 0):
        return
    cfg = config or extend_config(head_dim, q.dtype, interpret)
    if work is None:
        work = dense_extend_work(bs, max_extend_len, cfg.block_m, q.device)
    elif work.block_m != cfg.block_m:
        raise ValueError(f"the work table was planned for block_m {work.block_m}, the kernel uses {cfg.block_m}")
    if work.size == 0:
        return
    if cfg.block_m % cfg.block_n:
        raise ValueError(f"block_m must be a multiple of block_n, got {cfg}")
    kv_fp8 = k_buf.dtype == torch.float8_e4m3fn
    fp8_inputs = [t.dtype == torch.float8_e4m3fn for t in (v_buf, k_new, v_new)]
    if (kv_fp8 and not all(fp8_inputs)) or (not kv_fp8 and (any(fp8_inputs) or (k_scale, v_scale) != (1.0, 1.0))):
        raise ValueError("an fp8 KV pool needs float8_e4m3fn k_buf, v_buf, k_new and v_new, and k/v scales only "
                         f"apply to one (got {k_buf.dtype}, {v_buf.dtype}, {k_new.dtype}, {v_new.dtype}, "
                         f"scales {k_scale}, {v_scale})")
    if sliding_window and tree_mask is not None and depths is None:
        raise ValueError("a sliding window with a tree mask needs the draft tokens' depths")
    grid = (work.size * num_heads,)
    _extend_kernel[grid](
        q,
        k_new,
        v_new,
        out,
        k_buf,
        v_buf,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        extend_lens,
        extend_start,
        work.req,
        work.m_start,
        tree_mask if tree_mask is not None else extend_start,  # any pointer: unread without a mask
        mask_start if mask_start is not None else extend_start,
        depths if depths is not None else extend_start,
        sm_scale * k_scale,
        float(v_scale),
        float(logit_cap or 1.0),
        int(sliding_window or 0),
        q.stride(0),
        q.stride(1),
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        out.stride(0),
        out.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        req_to_token.stride(0),
        NUM_HEADS=num_heads,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_G=max(16, triton.next_power_of_2(num_heads // num_kv_heads)),
        EVEN_D=triton.next_power_of_2(head_dim) == head_dim,
        HAS_TREE_MASK=tree_mask is not None,
        HAS_CAP=bool(logit_cap),
        HAS_WINDOW=bool(sliding_window),
        KV_FP8=kv_fp8,
        IEEE=q.dtype == torch.float32,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
