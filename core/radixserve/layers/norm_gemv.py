"""RMSNorm (with the residual add before it) fused into the batch-1 Triton GEMV that follows it.

At batch 1 every GEMV program reads the whole activation row anyway (K = 4096 bf16 = 8 KB for
Llama-3.1-8B), so each program can compute the row's RMS itself instead of a separate norm kernel
writing the normalised row first: one launch instead of two before qkv and before gate_up (64
launches and their gaps per 8B decode step). One extra program (program 0) writes x + residual,
the stream the next layer reads.

The math, in one pass over K: y[n] = rstd * sum_k W[n, k] * (x[k] * g[k]) (+ bias), with
x = bf16(x + residual) (rounded as torch's add rounds), rstd = rsqrt(mean(x^2) + eps) and g the
norm weight. The 1/rms factor is applied once to each dot product, so the sum of squares
accumulates in the same loop as the dot products. Rounding differs from `RMSNorm` then `F.linear`:
the normalised row is never rounded to bf16 (HF rounds x * rstd, then its product with g), so
results agree to bf16 precision, not bit for bit (tests/test_norm_gemv.py checks the bound).

`runtime.batch1_gemv_fuse_norm` (default true; H200, Llama-3.1-8B batch 1: qkv 14.4 us fused vs
16.0 norm + GEMV, Engine 233.9 vs 228.3 tok/s, session 7) switches it; it applies only where
`runtime.batch1_gemv` gave the following projection a tile (`gemv_config`). Decoder layers call
`norm_linear_fusable` / `norm_linear` (radixserve.layers.decoder_blocks.PreNormDecoderLayer).

Triton is imported on first use (the module imports on machines without it).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.nn as nn

from radixserve.layers.norm import RMSNorm
from radixserve.layers.triton_gemv import GemvConfig, default_config, pdl_launch_args, triton_cdiv
from radixserve.layers.triton_support import interpreting as _interpreting


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    del interpret  # only part of the cache key (see triton_gemv._kernels)
    import triton
    import triton.language as tl
    import triton.language.extra.cuda  # noqa: F401 - tl.extra.cuda.gdc_* (PDL tiles)

    from radixserve.layers import triton_interpreter

    triton_interpreter.apply()  # the K loop's bound is a run-time scalar

    @triton.jit
    def rmsnorm_gemv_kernel(X, R, G, W, B, Y, ResOut, N, K, stride_wn, eps, HAS_RESIDUAL: tl.constexpr,
                            HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            EVEN_K: tl.constexpr, RES_BLOCK: tl.constexpr, PDL: tl.constexpr, GDC: tl.constexpr):
        pid = tl.program_id(0)
        if HAS_RESIDUAL:
            # program 0 writes the new stream x + residual and nothing else (the first dispatched, so
            # it overlaps the first wave instead of trailing the last). A store in the dot-product
            # programs (in their loop or after it) made ptxas keep 95 instead of 80 registers for
            # the 8B qkv tile on sm90: 5 programs per SM instead of 6, two waves instead of one
            # (17.7 vs 14.4 us on the H200)
            if pid == 0:
                if GDC:  # x and the residual are earlier kernels' outputs (PDL: GemvConfig.pdl)
                    tl.extra.cuda.gdc_wait()
                    tl.extra.cuda.gdc_launch_dependents()
                for k0 in range(0, K, RES_BLOCK):
                    cols = k0 + tl.arange(0, RES_BLOCK)
                    mask_k = cols < K
                    x = tl.load(X + cols, mask=mask_k, other=0.0)
                    r = tl.load(R + cols, mask=mask_k, other=0.0)
                    tl.store(ResOut + cols, (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty), mask=mask_k)
                return
            pid -= 1
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = rows < N
        w_rows = W + rows.to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        sumsq = tl.zeros([BLOCK_K], dtype=tl.float32)
        if PDL:
            # the first K step with its weight and norm-weight tiles (never written by earlier kernels)
            # loaded before the wait for the previous kernel, x / residual (its outputs) after it; the
            # same arithmetic in the same order as the loop's first step (bit-equal to PDL off)
            cols = tl.arange(0, BLOCK_K)
            mask_k = cols < K
            w = tl.load(w_rows + cols[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                        eviction_policy="evict_first")
            g = tl.load(G + cols, mask=mask_k, other=0.0)
            if GDC:  # off only in the interpreter (no inline assembly there): the same body, no wait
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
            x = tl.load(X + cols, mask=mask_k, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(R + cols, mask=mask_k, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
            x32 = x.to(tl.float32)
            sumsq += x32 * x32
            acc += w.to(tl.float32) * (x32 * g.to(tl.float32))[None, :]
        for k0 in range(BLOCK_K if PDL else 0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            mask_k = cols < K
            # every load before any arithmetic (triton_gemv: a cast between them stalls on x's latency)
            if EVEN_K:
                x = tl.load(X + cols)
                if HAS_RESIDUAL:
                    r = tl.load(R + cols)
                g = tl.load(G + cols)
                w = tl.load(w_rows + cols[None, :], mask=mask_n[:, None], other=0.0, eviction_policy="evict_first")
            else:
                x = tl.load(X + cols, mask=mask_k, other=0.0)
                if HAS_RESIDUAL:
                    r = tl.load(R + cols, mask=mask_k, other=0.0)
                g = tl.load(G + cols, mask=mask_k, other=0.0)
                w = tl.load(w_rows + cols[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                            eviction_policy="evict_first")
            if HAS_RESIDUAL:
                # torch's `x + residual` rounds the sum to x's dtype (as the next layer reads it)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
            x32 = x.to(tl.float32)
            sumsq += x32 * x32
            acc += w.to(tl.float32) * (x32 * g.to(tl.float32))[None, :]
        rstd = tl.math.rsqrt(tl.sum(sumsq, axis=0) / K + eps)
        y = tl.sum(acc, axis=1) * rstd
        if HAS_BIAS:
            y += tl.load(B + rows, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=mask_n)

    return SimpleNamespace(rmsnorm_gemv=rmsnorm_gemv_kernel)


def rmsnorm_gemv(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                 bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                 config: GemvConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(F.linear(RMSNorm(x + residual), weight, bias), x + residual)` in one launch, for one row.

    :param x: [1, K] activation row (the layer's output, or the embedding when `residual` is None).
    :param norm_weight: the RMSNorm weight [K], in x's dtype; `eps` its epsilon.
    :param weight: [N, K] with unit stride on K, in x's dtype; `bias` [N] or None.
    :param residual: [1, K] in x's dtype, or None (no add: the stream is x itself).
    :param config: the GEMV tile (the layer's `gemv_config`; None: `triton_gemv.default_config`);
        its `pdl` launches the kernel with programmatic dependent launch (bit-equal either way).
    :return: (y [1, N] in x's dtype, the new residual stream [1, K]: a new tensor, or x when
        `residual` is None). Launch-only (no host sync): capturable in CUDA graphs. Agrees with the
        two-kernel path to bf16 rounding (module docstring), not bit for bit.
    :raises ValueError: x not one row, or shapes / dtypes that do not match.
    """
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"rmsnorm_gemv: x must be one row [1, K], got {tuple(x.shape)}")
    n, k = weight.shape
    if x.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"rmsnorm_gemv: x {tuple(x.shape)} / weight {tuple(weight.shape)} (unit stride on K needed)")
    if norm_weight.shape != (k,) or norm_weight.dtype != x.dtype or weight.dtype != x.dtype:
        raise ValueError(f"rmsnorm_gemv: norm weight {tuple(norm_weight.shape)} {norm_weight.dtype} and weight "
                         f"{weight.dtype} must be ({k},) and {x.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rmsnorm_gemv: residual {tuple(residual.shape)} {residual.dtype} must match x")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"rmsnorm_gemv: bias shape {tuple(bias.shape)} != ({n},)")
    xc = x.contiguous()
    rc = residual.contiguous() if residual is not None else xc
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(xc) if residual is not None else x
    interpret = _interpreting()
    cfg = config or default_config(n, k, interpret)
    grid = (triton_cdiv(n, cfg.block_n) + (residual is not None),)  # + program 0, which writes the stream
    _kernels(interpret).rmsnorm_gemv[grid](
        xc, rc, norm_weight.contiguous(), weight, bias if bias is not None else xc, y,
        res_out if residual is not None else xc, n, k, weight.stride(0), eps,
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0, RES_BLOCK=min(_next_pow2(k), 4096),  # the stream in 1-2 steps (8B: one)
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch_args(cfg.pdl, interpret),
    )
    return y, res_out


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def norm_linear_fusable(norm: nn.Module, linear: nn.Module | None, x: torch.Tensor) -> bool:
    """Whether `norm_linear(norm, linear, x, ...)` runs the fused kernel: `x` one row, `norm` a plain
    `RMSNorm` (not a subclass: Gemma-style norms compute something else), `linear` given a GEMV tile
    by `runtime.batch1_gemv` with `runtime.batch1_gemv_fuse_norm` on (its `gemv_fuse_norm`), not
    gathering its output, and all three in one dtype."""
    if linear is None or getattr(linear, "gemv_config", None) is None or not getattr(linear, "gemv_fuse_norm", False):
        return False
    if type(norm) is not RMSNorm or getattr(linear, "gather_output", False):
        return False
    w = linear.weight
    return (x.dim() == 2 and x.shape[0] == 1 and x.shape[1] == w.shape[1]
            and x.dtype == w.dtype == norm.weight.dtype)


def norm_linear(norm: nn.Module, linear: nn.Module, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`linear(norm(x, residual))` and the new residual stream: the fused kernel when
    `norm_linear_fusable(norm, linear, x)`, else the two usual calls (`residual` None: `norm(x)`,
    the stream is x)."""
    if norm_linear_fusable(norm, linear, x):
        return rmsnorm_gemv(x, norm.weight, norm.eps, linear.weight, linear.bias, residual, linear.gemv_config)
    if residual is None:
        return linear(norm(x)), x
    h, residual = norm(x, residual)
    return linear(h), residual
