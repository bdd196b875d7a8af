"""The fused-MoE Triton kernel (CUDA; CPU tensors under TRITON_INTERPRET=1 for tests).

Routed experts as two grouped GEMM launches:
1. the (token, expert) pairs are sorted by expert and each expert's run padded to a multiple of
   BLOCK_M (`align_pairs_by_expert`), so every BLOCK_M-row tile belongs to one expert;
2. launch 1: for each tile, gather the tokens' rows of x and multiply by the expert's gate and up
   rows of w13 together, writing silu(gate) * up ([pairs, I]: the activation fused, no [pairs, 2I]);
3. launch 2: the down projection of each pair's row by its expert's w2, scaled by the pair's
   routing weight ([pairs, H], fp32); the top_k rows of a token are then summed in a fixed order.

Sizes are bounded without reading device values (the padded length is at most
pairs + E * (BLOCK_M - 1)), so the launches are CUDA-graph safe; tiles past the real padded length
have expert id -1 and return at once."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from radixserve.layers.moe import small_m
from radixserve.layers.triton_support import available  # noqa: F401 (callers ask this module)
from radixserve.layers.triton_support import interpreting as _interpreting

triton = tl = None  # imported by `_kernels` on first use (CPU machines may lack Triton)




def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    del interpret  # cache key only: @triton.jit picks interpreter mode when it decorates
    global triton, tl
    import triton
    import triton.language as tl

    @triton.jit
    def grouped_gemm_kernel(a_ptr, w_ptr, c_ptr, weight_ptr, sorted_ptr, expert_ptr, N, K: tl.constexpr, num_pairs,
                            a_row_div,
                            stride_am, stride_we, stride_wn, stride_cm,
                            GATED: tl.constexpr, SCALE_ROWS: tl.constexpr, IEEE: tl.constexpr,
                            UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """C[pair, n] = A[pair // a_row_div] . W[e, n] over k (GATED: silu(. W[e, n]) * (. W[e, N + n]));
        SCALE_ROWS multiplies row `pair` by weight[pair]. W is [E, rows, K] with unit stride in K.
        UPCAST: fp32 tiles into the dot (the interpreter's bf16 dot is wrong; never set on a GPU)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(expert_ptr + pid_m)
        if expert < 0:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + offs_m).to(tl.int64)
        row_ok = pair < num_pairs
        a_rows = pair // a_row_div
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            k_ok = kk < K
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + kk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
            w_mask = k_ok[:, None] & n_ok[None, :]
            w = tl.load(w_base + offs_n[None, :] * stride_wn + kk[:, None], mask=w_mask, other=0.0)
            if UPCAST:
                w = w.to(tl.float32)
            if IEEE:
                acc += tl.dot(a, w, input_precision="ieee")
            else:
                acc += tl.dot(a, w)
            if GATED:
                wu = tl.load(w_base + (offs_n[None, :] + N) * stride_wn + kk[:, None], mask=w_mask, other=0.0)
                if UPCAST:
                    wu = wu.to(tl.float32)
                if IEEE:
                    acc_up += tl.dot(a, wu, input_precision="ieee")
                else:
                    acc_up += tl.dot(a, wu)
        if GATED:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        if SCALE_ROWS:
            acc = acc * tl.load(weight_ptr + pair, mask=row_ok, other=0.0)[:, None]
        tl.store(c_ptr + pair[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])

    return SimpleNamespace(grouped_gemm=grouped_gemm_kernel)


def align_pairs_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the flattened (token, k) pairs by expert, each expert's run padded to whole BLOCK_M tiles.

    :returns: (sorted pair ids int32 [P_max], padding slots hold `pairs`; expert id int32 per tile
        [P_max / block_m], -1 past the last expert's run). P_max = pairs + E * (block_m - 1),
        rounded up to a whole tile: a bound that needs no host read."""
    flat = topk_ids.reshape(-1).long()
    pairs = flat.numel()
    p_max = _cdiv(pairs + num_experts * (block_m - 1), block_m) * block_m
    # not torch.bincount: on CUDA it reads the max id back to the host (no graph capture)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    run_ends = padded.cumsum(0)
    run_starts = run_ends - padded
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    first_of_expert = counts.cumsum(0) - counts
    rank = torch.arange(pairs, device=flat.device) - first_of_expert[sorted_experts]
    sorted_ids = torch.full((p_max,), pairs, dtype=torch.int32, device=flat.device)
    sorted_ids[run_starts[sorted_experts] + rank] = order.to(torch.int32)
    tile_starts = torch.arange(0, p_max, block_m, device=flat.device)
    tile_expert = torch.searchsorted(run_ends, tile_starts, right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)
    return sorted_ids, tile_expert


def _block_m(pairs: int, num_experts: int) -> int:
    return 16 if pairs <= 4 * num_experts else 64  # few rows per expert (decode): small tiles waste less


def _launch(kernels, a, w, c, weights, sorted_ids, tile_expert, n, k, pairs, a_row_div, gated, scale, block_m):
    block_n = 64
    block_k = 64 if k >= 64 else max(16, 1 << (k - 1).bit_length())
    grid = (tile_expert.numel(), _cdiv(n, block_n))
    kernels.grouped_gemm[grid](
        a, w, c, weights, sorted_ids, tile_expert, n, k, pairs, a_row_div,
        a.stride(0), w.stride(0), w.stride(1), c.stride(0),
        GATED=gated, SCALE_ROWS=scale, IEEE=a.dtype == torch.float32 or _interpreting(),
        UPCAST=_interpreting() and a.dtype != torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )


def triton_fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, block_m: int | None = None, path: str = "auto") -> torch.Tensor:
    """[T, H] routed-expert output (see `reference.fused_experts_reference`) in x's dtype.

    :param x: [T, H]; w13: [E, 2I, H] (gate rows, then up rows); w2: [E, H, I]; all one dtype
        (fp32, bf16 or fp16), contiguous in their last dim.
    :param topk_weights: [T, top_k] (any float dtype); topk_ids: [T, top_k] integer expert ids.
    :param block_m: tile rows (16 or more; default by the number of pairs).
    :param path: "auto" (the small-batch GEMV path of `small_m` where `small_m.use_small_m` says
        so, else the grouped GEMM), "small" or "grouped" to force one."""
    if path not in ("auto", "small", "grouped"):
        raise ValueError(f"unknown fused-MoE path {path!r} (choose auto, small or grouped)")
    if path == "small" or (path == "auto" and block_m is None and small_m.use_small_m(topk_ids.numel(), w13.shape[0])):
        return small_m.small_m_fused_experts(x, w13, w2, topk_weights, topk_ids)
    t, hidden, num_experts, inter, top_k, pairs = small_m.expert_shapes(x, w13, w2, topk_ids)
    x = x.contiguous()
    block_m = block_m or _block_m(pairs, num_experts)
    sorted_ids, tile_expert = align_pairs_by_expert(topk_ids, num_experts, block_m)
    kernels = _kernels(_interpreting())
    act = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    _launch(kernels, x, w13, act, act, sorted_ids, tile_expert, inter, hidden, pairs, top_k, True, False, block_m)
    down = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _launch(kernels, act, w2, down, weights, sorted_ids, tile_expert, hidden, inter, pairs, 1, False, True, block_m)
    return down.view(t, top_k, hidden).sum(1).to(x.dtype)
