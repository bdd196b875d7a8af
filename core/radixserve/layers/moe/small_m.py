"""The small-batch (decode) path of the routed experts: GEMV kernels launched straight from the top-k ids.

At a few tokens the grouped-GEMM path (`triton_kernel`) is sized for the worst case: its grid has a
tile per expert (fixed bounds, so CUDA graphs can capture it) and nearly every program exits empty,
and it first sorts the pairs by expert in several small kernels. Here nothing is sorted:

1. `gate_up`: one program per ((token, k) pair, BLOCK_N columns of I) reads the pair's expert id,
   multiplies the token's row of x by the expert's gate and up rows (a GEMV: I/O bound, no tensor
   cores needed at one row) and writes silu(gate) * up in fp32 ([pairs, I]);
2. `down`: one program per (pair, BLOCK_N columns of H, split of I) writes the pair's partial down
   projection times its routing weight to its own row of an fp32 buffer [pairs * splits, H];
3. `sum_rows`: each token's top_k * splits rows are summed in one fixed order and cast to x's dtype.

No atomics: the result is deterministic run to run, and a token's output does not depend on the
other tokens of the batch (the split count depends only on the layer's shape and the device).
Every size is known on the host from the tensors' shapes, so the launches are CUDA-graph safe.

`fused_select_experts` is the router (softmax or sigmoid, top-k, renormalisation, scaling, an
optional correction bias) as one kernel per token, for the same small batches (no expert groups).

Added in plugin API 1.5."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from radixserve.layers.moe.routing import RoutingConfig
from radixserve.layers.triton_support import available, pdl_launch, trigger_dependents
from radixserve.layers.triton_support import interpreting as _interpreting

triton = tl = None  # imported by `_kernels` on first use (CPU machines may lack Triton)
# small_m_steps' @triton.jit steps, set by `_kernels` (kernels see module globals)
route_token = sum_rows_if_last = residual_add = rms_scale = None

# The small path runs while tokens * top_k is at most this (and at most one pair per two experts, see
# `use_small_m`). Each pair reads its expert's weights on its own (programs of the same weight tile
# run side by side, so L2 may serve repeats), while the grouped GEMM reads a tile of an expert once
# for up to BLOCK_M rows but launches a tile per expert and sorts first. 64 pairs is batch 8 of
# Qwen3-30B-A3B (top 8 of 128: at most half the experts active, so repeats are rare); Mixtral (top 2
# of 8) gets batch 2 by the per-expert bound (past it the H200 measured a loss). benchmarks/h200/s5_moe.sh
# measures the crossover.
# RADIXSERVE_MOE_SMALL_M_MAX_PAIRS overrides it (0 turns the path off: A/B runs on the GPU).
SMALL_M_MAX_PAIRS = int(os.environ.get("RADIXSERVE_MOE_SMALL_M_MAX_PAIRS", "64"))


@dataclass(frozen=True)
class SmallMBlocks:
    """Tile sizes of the small path's kernels (columns x reduction per program, warps per program).
    Each program of a GEMV holds a [BLOCK_N, BLOCK_K] fp32 partial sum; the defaults keep a few
    programs per SM at one token of Qwen3-30B-A3B (benchmarks/h200/s5_moe.sh sweeps others)."""

    gate_up_n: int = 16
    gate_up_k: int = 256
    down_n: int = 32
    down_k: int = 256
    num_warps: int = 4
    sum_n: int = 256
    # both phases in one launch (`one_launch`: ticket-ordered tiles; same bits as the two launches).
    # None: one launch for at most ONE_LAUNCH_MAX_TOKENS tokens, where the H200 measured it faster
    one_launch: bool | None = None
    # the two-launch path's per-token sum of the down rows in the down kernel's last program of each
    # (token, column block) (no `sum_rows` launch; the same sum in the same order); False: the launch
    fused_sum: bool = True


# Qwen3-30B-A3B's experts on the H200 (benchmarks/results/h200-moe.md, session 7): one launch vs two
# took 25.4 vs 26.2 us at 1 token (1.03x), 43.3 vs 46.3 at 2 (1.07x), but 0.98x at 4 and 0.92x at 8
# tokens (its down tiles wait for whole pairs while the split grids overlap better at more pairs)
ONE_LAUNCH_MAX_TOKENS = 2
DEFAULT_BLOCKS = SmallMBlocks()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def use_small_m(pairs: int, num_experts: int) -> bool:
    """True when `pairs` (tokens * top_k) (token, expert) pairs over `num_experts` experts go through
    the small-batch path: at most SMALL_M_MAX_PAIRS, and at most one per two experts (past that
    pairs share experts and the grouped GEMM's tiles share one read of an expert's weights among
    many rows). Measured on the H200 (benchmarks/results/h200-moe.md): Qwen3-30B-A3B (128 experts)
    gains 3.6x at 1 token and 1.4x at 8 (64 pairs); Mixtral (8 experts) gains 1.6x at 1 token and
    1.2x at 2, but loses at 4 (8 pairs: 0.97x) and 8 (16 pairs: 0.78x)."""
    return 0 < pairs <= min(SMALL_M_MAX_PAIRS, num_experts // 2)


@dataclass(frozen=True)
class ExpertCall:
    """The checked operands of one small-M fused-experts call, shared by the two-launch path
    (`small_m_fused_experts`) and the one-launch path (`one_launch.one_launch_fused_experts`)."""

    tokens: int
    hidden: int
    inter: int
    top_k: int
    pairs: int
    out: torch.Tensor  # [tokens, hidden], the result (empty: every row is written by the kernels)
    x: torch.Tensor  # contiguous
    ids: torch.Tensor  # int32 [pairs]
    weights: torch.Tensor  # fp32 [pairs]
    splits: int  # parts of the down projection's reduction, none empty
    k_per_split: int


def prepare_expert_call(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, splits: int | None, b: SmallMBlocks) -> ExpertCall:
    """Check the operands and pick the down projection's splits (ValueError on bad shapes or strides)."""
    t, hidden, _, inter, top_k, pairs = expert_shapes(x, w13, w2, topk_ids)
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("expert weights must be contiguous in their last dim")
    out = torch.empty((t, hidden), dtype=x.dtype, device=x.device)
    splits = splits or down_splits(top_k, hidden, inter, _processors(x), b)
    k_per_split = _cdiv(_cdiv(inter, splits), b.down_k) * b.down_k
    return ExpertCall(t, hidden, inter, top_k, pairs, out, x.contiguous(),
                      topk_ids.reshape(-1).to(torch.int32).contiguous(),
                      topk_weights.reshape(-1).float().contiguous(),
                      _cdiv(inter, k_per_split), k_per_split)  # no empty split


def expert_shapes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_ids: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """(tokens, hidden, experts, intermediate, top_k, pairs) of a fused-experts call; ValueError when
    the expert weights do not fit x (w13 [E, 2I, H], w2 [E, H, I])."""
    t, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    if w13.shape[2] != hidden or tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(f"expert weights {tuple(w13.shape)} / {tuple(w2.shape)} do not fit hidden size {hidden}")
    return t, hidden, num_experts, inter, top_k, t * top_k


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _processors(x: torch.Tensor) -> int:
    return _sm_count(x.device) if x.is_cuda else 4  # the interpreter: a small pretend GPU


def down_splits(top_k: int, hidden: int, inter: int, processors: int, blocks: SmallMBlocks = DEFAULT_BLOCKS) -> int:
    """How many parts the down projection's reduction over I is split into: enough programs for
    about 4 per processor at one token, each part at least 4 BLOCK_K steps long. It depends on the
    layer's shape only (not on the batch), so a token's sum has the same order at any batch size."""
    programs = top_k * _cdiv(hidden, blocks.down_n)
    want = _cdiv(4 * processors, programs)
    return max(1, min(want, inter // (4 * blocks.down_k)))


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    del interpret  # cache key only: @triton.jit picks interpreter mode when it decorates
    global triton, tl, route_token, sum_rows_if_last, residual_add, rms_scale
    import triton
    import triton.language as tl
    import triton.language.extra.cuda  # noqa: F401 - tl.extra.cuda.gdc_* (the router's PDL launch)

    from radixserve.layers.moe.small_m_steps import residual_add, rms_scale, route_token, sum_rows_if_last

    @triton.jit
    def gate_up_kernel(x_ptr, w_ptr, act_ptr, ids_ptr, N, K: tl.constexpr, top_k, stride_xm, stride_we, stride_wn,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
        """act[pair, n] = silu(x[token] . w[e, n]) * (x[token] . w[e, N + n]), fp32; e = ids[pair]."""
        pair = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        token = pair // top_k
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        w_gate = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
        w_up = w_gate + N * stride_wn
        x_row = x_ptr + token.to(tl.int64) * stride_xm
        acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            # expert weights stream through once: evict them first, keep L2 for the activations
            if EVEN_K:  # no K mask: whole vectors per load
                xv = tl.load(x_row + kk).to(tl.float32)[None, :]
                mask = n_ok[:, None]
            else:
                k_ok = kk < K
                xv = tl.load(x_row + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
                mask = n_ok[:, None] & k_ok[None, :]
            acc_gate += tl.load(w_gate + kk[None, :], mask=mask, other=0.0,
                                eviction_policy="evict_first").to(tl.float32) * xv
            acc_up += tl.load(w_up + kk[None, :], mask=mask, other=0.0,
                              eviction_policy="evict_first").to(tl.float32) * xv
        gate = tl.sum(acc_gate, axis=1)
        up = tl.sum(acc_up, axis=1)
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(act_ptr + pair * N + offs_n, act, mask=n_ok)

    @triton.jit
    def down_kernel(act_ptr, w_ptr, out_ptr, weight_ptr, ids_ptr, N, K: tl.constexpr, k_per_split: tl.constexpr, stride_we, stride_wn,
                    final_ptr, arrivals_ptr, top_k, ROWS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FUSED_SUM: tl.constexpr, EVEN_K: tl.constexpr):
        """out[pair * splits + s, n] = weight[pair] * sum over k in split s of act[pair, k] * w[e, n, k].
        FUSED_SUM: the last of a (token, column block)'s top_k * splits programs to finish also does
        `sum_rows` for that block (same rows, same order) into final; ROWS = top_k * splits."""
        pair = tl.program_id(0)
        pid_n = tl.program_id(1)
        split = tl.program_id(2)
        splits = tl.num_programs(2)
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
        act_row = act_ptr + pair.to(tl.int64) * K
        k_start = split * k_per_split  # k_per_split: a whole number of BLOCK_K, so splits do not overlap
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, k_per_split, BLOCK_K):
            kk = k_start + k0 + offs_k
            if EVEN_K:  # every split is whole BLOCK_K steps inside K: no K mask
                av = tl.load(act_row + kk)[None, :]
                w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
            else:
                k_ok = kk < K
                av = tl.load(act_row + kk, mask=k_ok, other=0.0)[None, :]
                w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                            eviction_policy="evict_first")
            acc += w.to(tl.float32) * av
        out = tl.sum(acc, axis=1) * tl.load(weight_ptr + pair)
        tl.store(out_ptr + (pair * splits + split).to(tl.int64) * N + offs_n, out, mask=n_ok)
        if FUSED_SUM:  # the block's last program sums the token's rows
            token = pair // top_k
            sum_rows_if_last(arrivals_ptr + token * tl.num_programs(1) + pid_n, out_ptr, final_ptr, token, offs_n,
                             n_ok, N, ROWS, BLOCK_N)

    @triton.jit
    def sum_rows_kernel(buf_ptr, out_ptr, R: tl.constexpr, N, BLOCK_N: tl.constexpr):
        """out[t, n] = sum over r < R of buf[t * R + r, n], rows added in index order."""
        t = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        base = buf_ptr + t.to(tl.int64) * R * N + offs_n
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for r in range(0, R):
            acc += tl.load(base + r * N, mask=n_ok, other=0.0)
        tl.store(out_ptr + t.to(tl.int64) * N + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)

    @triton.jit
    def router_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, E, stride_lm, scale,
                      TOP_K: tl.constexpr, SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr):
        """One token's routing, as `routing.select_experts` without expert groups."""
        t = tl.program_id(0)
        offs = tl.arange(0, BLOCK_E)
        ok = offs < E
        logits = tl.load(logits_ptr + t.to(tl.int64) * stride_lm + offs, mask=ok, other=float("-inf")).to(tl.float32)
        route_token(logits, offs, ok, t, bias_ptr, weights_ptr, ids_ptr, E, scale, TOP_K, SIGMOID, RENORMALIZE,
                    HAS_BIAS, BLOCK_TOPK)

    @triton.jit
    def gate_router_kernel(x_ptr, w_ptr, logits_ptr, bias_ptr, weights_ptr, ids_ptr, arrivals_ptr, E,
                           K: tl.constexpr, stride_xm, stride_we, scale,
                           TOP_K: tl.constexpr, SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr,
                           HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr,
                           res_ptr, norm_w_ptr, xn_ptr, res_out_ptr, stride_rm, eps, NORM: tl.constexpr,
                           PRELOAD: tl.constexpr, GDC: tl.constexpr, TRIGGER: tl.constexpr):
        """The router's linear (ROWS experts' logits per program, rounded to x's dtype as the linear
        layer's output is) and, in the program of the token that arrives last, its routing.
        NORM: the router's input is RMSNorm(x + res) with weight norm_w, computed by every program
        with the recipe of `triton_ops.rmsnorm` (a first pass for the statistics); the first program
        of each token also writes it to xn and x + res to res_out.
        PRELOAD: every load of the program (its ROWS weight rows, then norm_w, x and res) is issued
        before any arithmetic and held in registers (tuples of BLOCK_K chunks, unrolled loops), so
        the rows' DRAM latency overlaps the statistics instead of following them. The loads are
        volatile only to keep that order: without it ptxas sinks the rows' loads below the
        statistics (sm_90 SASS: issued once x and res have arrived). The host sets PRELOAD where
        it fits the registers; otherwise each pass loads its chunks in a loop. The same sums in the
        same order either way: the same bits.
        GDC: launched with programmatic dependent launch (sm90+, `moe_pdl`): the weight rows and
        norm_w (PRELOAD) load before `gdc_wait`, the activations after it; bit-equal to GDC off.
        TRIGGER: signal `launch_dependents` at the start (the experts kernel after it is PDL-launched:
        `moe_experts_pdl`)."""
        if TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
        t = tl.program_id(0)
        pid = tl.program_id(1)
        rows = pid * ROWS + tl.arange(0, ROWS)
        rows_ok = rows < E
        offs_k = tl.arange(0, BLOCK_K)
        x_row = x_ptr + t.to(tl.int64) * stride_xm
        w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_we
        res_row = res_ptr + t.to(tl.int64) * stride_rm
        if PRELOAD:
            ws = ()
            nws = ()
            xs = ()
            rs = ()
            for k0 in tl.static_range(0, K, BLOCK_K):
                k_ok = k0 + offs_k < K
                ws += (tl.load(w_rows + (k0 + offs_k)[None, :], mask=rows_ok[:, None] & k_ok[None, :], other=0.0,
                               volatile=True),)
                if NORM:
                    nws += (tl.load(norm_w_ptr + k0 + offs_k, mask=k_ok, other=0.0, volatile=True),)
        if GDC:
            # PDL: the parameters above load while the previous kernel (the o_proj GEMV, which signals
            # launch_dependents) still runs; x and res are its outputs (or earlier ones): after the wait
            tl.extra.cuda.gdc_wait()
        if PRELOAD:
            for k0 in tl.static_range(0, K, BLOCK_K):
                k_ok = k0 + offs_k < K
                xs += (tl.load(x_row + k0 + offs_k, mask=k_ok, other=0.0, volatile=True),)
                if NORM:
                    rs += (tl.load(res_row + k0 + offs_k, mask=k_ok, other=0.0, volatile=True),)
            if NORM:
                ss = tl.zeros((BLOCK_K,), dtype=tl.float32)
                for k0 in tl.static_range(0, K, BLOCK_K):
                    s = residual_add(xs[k0 // BLOCK_K], rs[k0 // BLOCK_K])
                    ss += s.to(tl.float32) * s.to(tl.float32)
                    if pid == 0:
                        tl.store(res_out_ptr + t.to(tl.int64) * K + k0 + offs_k, s, mask=k0 + offs_k < K)
                rstd = tl.math.rsqrt(tl.sum(ss, axis=0) / K + eps)
            acc = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
            for k0 in tl.static_range(0, K, BLOCK_K):
                xv = xs[k0 // BLOCK_K]
                if NORM:
                    xv = rms_scale(residual_add(xv, rs[k0 // BLOCK_K]), rstd, nws[k0 // BLOCK_K])
                    if pid == 0:
                        tl.store(xn_ptr + t.to(tl.int64) * K + k0 + offs_k, xv, mask=k0 + offs_k < K)
                acc += ws[k0 // BLOCK_K].to(tl.float32) * xv.to(tl.float32)[None, :]
        else:
            if NORM:
                ss = tl.zeros((BLOCK_K,), dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    kk = k0 + offs_k
                    k_ok = kk < K
                    s = residual_add(tl.load(x_row + kk, mask=k_ok, other=0.0),
                                     tl.load(res_row + kk, mask=k_ok, other=0.0))
                    ss += s.to(tl.float32) * s.to(tl.float32)
                    if pid == 0:
                        tl.store(res_out_ptr + t.to(tl.int64) * K + kk, s, mask=k_ok)
                rstd = tl.math.rsqrt(tl.sum(ss, axis=0) / K + eps)
            acc = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + offs_k
                k_ok = kk < K
                w = tl.load(w_rows + kk[None, :], mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
                xv = tl.load(x_row + kk, mask=k_ok, other=0.0)
                if NORM:
                    xv = rms_scale(residual_add(xv, tl.load(res_row + kk, mask=k_ok, other=0.0)), rstd,
                                   tl.load(norm_w_ptr + kk, mask=k_ok, other=0.0))
                    if pid == 0:
                        tl.store(xn_ptr + t.to(tl.int64) * K + kk, xv, mask=k_ok)
                acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
        logit = tl.sum(acc, axis=1)
        logit = logit.to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(logits_ptr + t.to(tl.int64) * E + rows, logit, mask=rows_ok)
        # publish the logits: every thread's stores before the barrier, the release-acquire atomic hands
        # them to the token's last program, which reads them past L1 (.cg) and resets the counter
        tl.debug_barrier()
        if tl.atomic_add(arrivals_ptr + t, 1, sem="acq_rel", scope="gpu") == tl.num_programs(1) - 1:
            tl.store(arrivals_ptr + t, 0)
            offs = tl.arange(0, BLOCK_E)
            ok = offs < E
            logits = tl.load(logits_ptr + t.to(tl.int64) * E + offs, mask=ok, other=float("-inf"),
                             cache_modifier=".cg")
            route_token(logits, offs, ok, t, bias_ptr, weights_ptr, ids_ptr, E, scale, TOP_K, SIGMOID,
                        RENORMALIZE, HAS_BIAS, BLOCK_TOPK)

    return SimpleNamespace(gate_up=gate_up_kernel, down=down_kernel, sum_rows=sum_rows_kernel, router=router_kernel,
                           gate_router=gate_router_kernel)


def small_m_fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor, splits: int | None = None,
                          blocks: SmallMBlocks | None = None) -> torch.Tensor:
    """[T, H] routed-expert output (see `reference.fused_experts_reference`) in x's dtype, by GEMVs.

    :param x: [T, H]; w13: [E, 2I, H] (gate rows, then up rows); w2: [E, H, I]; contiguous in
        their last dim; fp32, bf16 or fp16 (x and the weights may differ: both are read into fp32).
    :param topk_weights: [T, top_k] (any float dtype); topk_ids: [T, top_k] integer expert ids.
    :param splits: parts of the down projection's reduction (default `down_splits`).
    :param blocks: tile sizes (default `DEFAULT_BLOCKS`); `blocks.one_launch` runs both phases in one
        launch (`one_launch.one_launch_fused_experts`, the same result bit for bit; None: for at most
        ONE_LAUNCH_MAX_TOKENS tokens).
    Meant for few pairs (`use_small_m`); correct at any size."""
    b = blocks or DEFAULT_BLOCKS
    if b.one_launch or (b.one_launch is None and x.shape[0] <= ONE_LAUNCH_MAX_TOKENS):
        from radixserve.layers.moe.one_launch import one_launch_fused_experts

        return one_launch_fused_experts(x, w13, w2, topk_weights, topk_ids, splits, b)
    call = prepare_expert_call(x, w13, w2, topk_weights, topk_ids, splits, b)
    out = call.out
    if call.pairs == 0:
        return out
    t, hidden, inter, top_k, pairs = call.tokens, call.hidden, call.inter, call.top_k, call.pairs
    x, ids, weights, splits, k_per_split = call.x, call.ids, call.weights, call.splits, call.k_per_split
    kernels = _kernels(_interpreting())
    act = torch.empty((pairs, inter), dtype=torch.float32, device=x.device)
    kernels.gate_up[(pairs, _cdiv(inter, b.gate_up_n))](
        x, w13, act, ids, inter, hidden, top_k, x.stride(0), w13.stride(0), w13.stride(1),
        BLOCK_N=b.gate_up_n, BLOCK_K=b.gate_up_k, EVEN_K=hidden % b.gate_up_k == 0, num_warps=b.num_warps)
    partial = torch.empty((pairs * splits, hidden), dtype=torch.float32, device=x.device)
    n_blocks = _cdiv(hidden, b.down_n)
    arrivals = _sum_arrivals(x.device, t * n_blocks) if b.fused_sum else None
    kernels.down[(pairs, n_blocks, splits)](
        act, w2, partial, weights, ids, hidden, inter, k_per_split, w2.stride(0), w2.stride(1),
        out, arrivals if arrivals is not None else ids, top_k, ROWS=top_k * splits,
        BLOCK_N=b.down_n, BLOCK_K=b.down_k, FUSED_SUM=arrivals is not None,
        EVEN_K=k_per_split * splits == inter, num_warps=b.num_warps)
    if arrivals is None:
        kernels.sum_rows[(t, _cdiv(hidden, b.sum_n))](partial, out, top_k * splits, hidden, BLOCK_N=b.sum_n)
    return out


_ARRIVALS: dict[torch.device, list[torch.Tensor]] = {}


def _sum_arrivals(device: torch.device, n: int) -> torch.Tensor:
    """An all-zero int32 buffer of at least n counters on `device`, left all zero by each launch. A
    larger one replaces it for later calls, but every buffer stays alive: a captured CUDA graph keeps
    the address it recorded."""
    held = _ARRIVALS.setdefault(device, [])
    if not held or held[-1].numel() < n:
        held.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
    return held[-1]


def fused_router_applies(router_logits: torch.Tensor, cfg: RoutingConfig) -> bool:
    """True when `fused_select_experts` serves this call: CUDA (or the interpreter on a CUDA-less
    test), a small batch (`use_small_m`), no expert groups."""
    if cfg.num_expert_group is not None and cfg.num_expert_group > 1:
        return False
    return available(router_logits) and use_small_m(router_logits.shape[0] * cfg.top_k, router_logits.shape[1])


def fused_select_experts(router_logits: torch.Tensor, cfg: RoutingConfig,
                         correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`routing.select_experts` in one kernel launch (one program per token), without expert groups.

    :returns: (weights fp32 [T, top_k], expert ids int32 [T, top_k])."""
    if cfg.num_expert_group is not None and cfg.num_expert_group > 1:
        raise ValueError(f"the fused router has no expert groups (num_expert_group={cfg.num_expert_group})")
    t, e = router_logits.shape
    weights = torch.empty((t, cfg.top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((t, cfg.top_k), dtype=torch.int32, device=router_logits.device)
    if t == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    bias = correction_bias if correction_bias is not None else weights
    _kernels(_interpreting()).router[(t,)](
        logits, bias, weights, ids, e, logits.stride(0), float(cfg.routed_scaling_factor),
        TOP_K=cfg.top_k, SIGMOID=cfg.scoring == "sigmoid", RENORMALIZE=cfg.renormalize,
        HAS_BIAS=correction_bias is not None, BLOCK_E=_pow2(e), BLOCK_TOPK=_pow2(cfg.top_k),
        num_warps=1 if e <= 256 else 4)  # one warp: the top-k's reductions stay in shuffles, no barriers
    return weights, ids


# programmatic dependent launch of the one-launch router (`moe_pdl`); RADIXSERVE_MOE_PDL=0 turns it off
# (A/B runs on the GPU, as RADIXSERVE_MOE_SMALL_M_MAX_PAIRS for the small path)
MOE_PDL = os.environ.get("RADIXSERVE_MOE_PDL", "1") != "0"
# the experts kernel's PDL launch after the router (`moe_experts_pdl`); RADIXSERVE_MOE_EXPERTS_PDL=0 turns it off.
# On by default: -0.027 ms a Qwen3-30B-A3B batch-1 step on an H100 with its checks passing (session 23)
MOE_EXPERTS_PDL = os.environ.get("RADIXSERVE_MOE_EXPERTS_PDL", "1") != "0"
GATE_ROWS = 2  # experts per program of the router's linear: 64 programs for 128 experts
# `gate_router_kernel` preloads a program's operands while they take at most this many bytes a warp
# (160 registers a thread): Qwen3-30B-A3B's with the norm, 2 rows + x, res, norm_w of 2048 bf16 each
# (sm_90, Triton 3.6: 240 registers, no spills)
GATE_PRELOAD_BYTES = 20 * 1024


def fused_gate_applies(x: torch.Tensor, gate_weight: torch.Tensor, cfg: RoutingConfig,
                       arrivals: torch.Tensor) -> bool:
    """True when `fused_gate_select_experts` serves this call: the fused router applies
    (`fused_router_applies` on x's rows), the gate weight is a plain [E, H] matrix in x's dtype and
    the arrival counters cover the tokens."""
    if gate_weight.dim() != 2 or gate_weight.dtype != x.dtype or gate_weight.stride(1) != 1:
        return False
    if cfg.num_expert_group is not None and cfg.num_expert_group > 1:
        return False
    t = x.shape[0]
    return (available(x) and t <= arrivals.numel() and x.shape[1] == gate_weight.shape[1]
            and use_small_m(t * cfg.top_k, gate_weight.shape[0]))


def fused_gate_select_experts(x: torch.Tensor, gate_weight: torch.Tensor, cfg: RoutingConfig,
                              arrivals: torch.Tensor, correction_bias: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_experts(x @ gate_weight.T, cfg)` in one launch: programs of GATE_ROWS experts compute
    the router logits (fp32 sums rounded to x's dtype, as the linear layer returns them); the last
    program of each token to finish (an arrival counter) routes it as `fused_select_experts`.

    :param x: [T, H]; gate_weight: [E, H] in x's dtype, unit stride on H.
    :param arrivals: int32 [>= T] all zeros; left all zeros (reset by the last program).
    :returns: (weights fp32 [T, top_k], expert ids int32 [T, top_k]).
    Added in plugin API 1.6."""
    return _gate_router(x, gate_weight, cfg, arrivals, correction_bias, None)[:2]


def fused_norm_gate_select_experts(h: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                   gate_weight: torch.Tensor, cfg: RoutingConfig, arrivals: torch.Tensor,
                                   correction_bias: torch.Tensor | None = None
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The residual add and RMSNorm before an MoE block, its router's linear and top-k in one launch:
    `x, res = RMSNorm(norm_weight, eps)(h, residual)` then `fused_gate_select_experts(x, ...)`.

    :param h, residual: [T, H] of one dtype, unit stride on H; norm_weight: [H] in that dtype.
    :returns: (x [T, H] the normalised input of the experts, res [T, H] = h + residual, weights fp32
        [T, top_k], expert ids int32 [T, top_k]). x and res follow `triton_ops.rmsnorm`'s rounding
        (the sum of squares in another order: x may differ from it in the last bit).
    Added in plugin API 1.7."""
    if residual.shape != h.shape or residual.dtype != h.dtype or norm_weight.shape != (h.shape[1],):
        raise ValueError(f"fused_norm_gate_select_experts: residual {tuple(residual.shape)} {residual.dtype} and "
                         f"norm weight {tuple(norm_weight.shape)} must match h {tuple(h.shape)} {h.dtype}")
    xn = torch.empty_like(h, memory_format=torch.contiguous_format)
    res = torch.empty_like(h, memory_format=torch.contiguous_format)
    norm = (residual if residual.stride(1) == 1 else residual.contiguous(), norm_weight.contiguous(), xn,
            res, float(eps))
    weights, ids = _gate_router(h, gate_weight, cfg, arrivals, correction_bias, norm)
    return xn, res, weights, ids


def _gate_router(x, gate_weight, cfg, arrivals, correction_bias, norm):
    t, hidden = x.shape
    e = gate_weight.shape[0]
    if arrivals.dtype != torch.int32 or arrivals.numel() < t:
        raise ValueError(f"fused_gate_select_experts: arrivals must be int32 with >= {t} elements")
    weights = torch.empty((t, cfg.top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((t, cfg.top_k), dtype=torch.int32, device=x.device)
    if t == 0:
        return weights, ids
    x = x if x.stride(1) == 1 else x.contiguous()
    logits = torch.empty((t, e), dtype=torch.float32, device=x.device)
    bias = correction_bias if correction_bias is not None else weights
    res, norm_w, xn, res_out, eps = norm if norm is not None else (x, x, x, x, 0.0)
    block_k = min(1024, _pow2(hidden))
    warps = 1 if e <= 256 else 4  # as the router kernel: the last program's top-k stays in shuffles
    # a program's loads all in registers at once: its weight rows and x (res and norm_w with the norm)
    loaded = (GATE_ROWS + (3 if norm is not None else 1)) * _cdiv(hidden, block_k) * block_k * x.element_size()
    _kernels(_interpreting()).gate_router[(t, _cdiv(e, GATE_ROWS))](
        x, gate_weight, logits, bias, weights, ids, arrivals, e, hidden, x.stride(0), gate_weight.stride(0),
        float(cfg.routed_scaling_factor), TOP_K=cfg.top_k, SIGMOID=cfg.scoring == "sigmoid",
        RENORMALIZE=cfg.renormalize, HAS_BIAS=correction_bias is not None, ROWS=GATE_ROWS,
        BLOCK_K=block_k, BLOCK_E=_pow2(e), BLOCK_TOPK=_pow2(cfg.top_k),
        res_ptr=res, norm_w_ptr=norm_w, xn_ptr=xn, res_out_ptr=res_out, stride_rm=res.stride(0), eps=eps,
        NORM=norm is not None, PRELOAD=loaded <= GATE_PRELOAD_BYTES * warps, num_warps=warps,
        TRIGGER=moe_experts_pdl(x), **pdl_launch(moe_pdl(x)))
    return weights, ids


def moe_pdl(x: torch.Tensor) -> bool:
    """Whether the one-launch router runs with programmatic dependent launch on x's device: where
    kernels can signal `launch_dependents` (`triton_support.trigger_dependents`: sm90+, a Triton with
    PDL, not the interpreter) and MOE_PDL is on."""
    return MOE_PDL and trigger_dependents(x)


def moe_experts_pdl(x: torch.Tensor) -> bool:
    """Whether the one-launch experts kernel (`one_launch`) runs PDL-launched, the one-launch router
    before it signalling `launch_dependents` at its start: MOE_EXPERTS_PDL (on unless
    RADIXSERVE_MOE_EXPERTS_PDL=0) where `trigger_dependents` holds."""
    return MOE_EXPERTS_PDL and trigger_dependents(x)

