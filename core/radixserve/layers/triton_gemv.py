"""A Triton GEMV for one-row activations (batch-1 decode): y = x @ W.T with no split-K reduction.

cuBLAS picks split-K kernels for some batch-1 projections (a partial pass, then a `splitKreduce`
launch). This kernel gives each program `block_n` whole output rows: it streams their weight rows
once, accumulates in fp32 and writes the result, so there is nothing to reduce afterwards. The
plain-weight layers (`UnquantizedMethod.apply`) route a one-row activation here when the model
runner gave the layer a `gemv_config` (`runtime.batch1_gemv`, chosen per layer by
radixserve.layers.gemv_selection from shapes measured against cuBLAS). Rounding: one fp32 accumulation rounded to the
output dtype, as cuBLAS does, in a different summation order (results may differ in the last bit).

Triton is imported on first use (the module imports on machines without it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from radixserve.layers.triton_support import interpreting as _interpreting
from radixserve.layers.triton_support import pdl_launch

triton = tl = None  # imported by `_kernels` on first use
silu_mul = None  # a @triton.jit helper, defined by `_kernels` (module-level so kernels can call it)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # output rows per program
    block_k: int  # K elements per loop step
    num_warps: int
    num_stages: int
    # programmatic dependent launch (sm90+, `runtime.batch1_gemv_pdl`): the kernel may start while the
    # previous one finishes, loads its first weight tile, then waits for it (griddepcontrol.wait)
    # before reading x; it lets the next PDL launch start early too. Session 8 (H200, Llama-3.1-8B,
    # with the norm-fused GEMV): 1-1.5 us less per GEMV, graph replay 4.050 -> 3.904 ms per batch-1
    # step; bit-equal with and without it (same summation order), greedy tokens identical. The
    # interpreter runs the same body without the griddepcontrol instructions (no inline assembly).
    pdl: bool = False


def default_config(n: int, k: int, interpret: bool) -> GemvConfig:
    """A starting point; benchmarks/h200/gemv_vs_cublas.py sweeps the alternatives."""
    if interpret:
        return GemvConfig(8, 32, 1, 1)
    return GemvConfig(16, 512, 4, 3)


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    del interpret  # only part of the cache key: @triton.jit decides interpret-or-compile when it decorates
    global triton, tl, silu_mul
    import triton
    import triton.language as tl
    import triton.language.extra.cuda  # noqa: F401 - tl.extra.cuda.gdc_* (PDL tiles)

    from radixserve.layers import triton_interpreter

    triton_interpreter.apply()  # the K loop's bound is a run-time scalar

    @triton.jit
    def silu_mul(gate, up):
        """silu(gate) * up in fp32, rounded to gate's dtype twice as the silu_and_mul kernel rounds
        (so a gated GEMV sees the same x bit for bit)."""
        g = gate.to(tl.float32)
        act = tl.div_rn(g, 1.0 + tl.exp(-g)).to(gate.dtype).to(tl.float32)
        return (act * up.to(tl.float32)).to(gate.dtype)

    @triton.jit
    def gemv_kernel(X, W, B, Y, N, K, stride_wn, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr,
                    GDC: tl.constexpr):
        # GATED / PDL off, this is the session-5 body as measured (benchmarks/results/h200-session5.md):
        # keep the loads ahead of every cast (a cast of x between its load and w's stalled each step
        # on x's latency: ~8% slower on the H200)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = rows < N
        w_rows = W + rows.to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        if PDL:
            # the first tile's weights (never written by earlier kernels) stream in while the previous
            # kernel finishes; x is its output, read only after the wait
            cols = tl.arange(0, BLOCK_K)
            mask_k = cols < K
            w = tl.load(w_rows + cols[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                        eviction_policy="evict_first")
            if GDC:  # off only in the interpreter (no inline assembly there): the same body, no wait
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
            x = tl.load(X + cols, mask=mask_k, other=0.0)
            if GATED:
                up = tl.load(X + K + cols, mask=mask_k, other=0.0)
                x = silu_mul(x, up)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        for k0 in range(BLOCK_K if PDL else 0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                x = tl.load(X + cols)
                if GATED:
                    up = tl.load(X + K + cols)
                w = tl.load(w_rows + cols[None, :], mask=mask_n[:, None], other=0.0, eviction_policy="evict_first")
            else:
                mask_k = cols < K
                x = tl.load(X + cols, mask=mask_k, other=0.0)
                if GATED:
                    up = tl.load(X + K + cols, mask=mask_k, other=0.0)
                w = tl.load(w_rows + cols[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                            eviction_policy="evict_first")  # weights stream through once: keep L2 for the rest
            if GATED:
                x = silu_mul(x, up)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(B + rows, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=mask_n)

    return SimpleNamespace(gemv=gemv_kernel)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None, gated: bool = False) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x of one row: x [1, K] (or [K]), weight [N, K] with unit
    stride on K, bias [N] or None; returns [1, N] (or [N]) in x's dtype. `gated`: x is [gate | up]
    of 2K columns and the product is `F.linear(silu_and_mul(x), weight, bias)` (the activation in
    the kernel's prologue: one launch, the [K] intermediate never written; not used by the models:
    on the H200 it took 37.4 us for the 8B down projection against 30.8 us for silu_and_mul + GEMV,
    benchmarks/results/h200-2026-12-04-s6/gemv-b/gemv_selected.txt). Launch-only (no host
    sync), so it can be captured in CUDA graphs. Raises ValueError for more than one row or
    mismatched shapes."""
    squeeze = x.dim() == 1
    x2 = x.reshape(1, -1) if squeeze else x
    if x2.dim() != 2 or x2.shape[0] != 1:
        raise ValueError(f"gemv: x must be one row ([K] or [1, K]), got {tuple(x.shape)}")
    n, k = weight.shape
    if x2.shape[1] != (2 * k if gated else k) or weight.stride(1) != 1:
        raise ValueError(f"gemv: x {tuple(x.shape)} / weight {tuple(weight.shape)} (unit stride on K needed"
                         + ("; gated: x has 2K columns)" if gated else ")"))
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"gemv: bias shape {tuple(bias.shape)} != ({n},)")
    xc = x2.contiguous()
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    interpret = _interpreting()
    cfg = config or default_config(n, k, interpret)
    grid = (triton_cdiv(n, cfg.block_n),)
    _kernels(interpret).gemv[grid](
        xc, weight, bias if bias is not None else xc, y, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0,
        GATED=gated, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch_args(cfg.pdl, interpret),
    )
    return y.view(n) if squeeze else y


def pdl_launch_args(pdl: bool, interpret: bool) -> dict:
    """The launch keywords of a kernel with `PDL` / `GDC` constexprs (this module's and
    norm_gemv's): with `pdl`, the PDL body (first weight tile loaded before the wait) and, on a GPU,
    the griddepcontrol instructions and Triton's `launch_pdl` launch attribute; the interpreter runs
    the body alone."""
    return {"PDL": pdl, **pdl_launch(pdl and not interpret)}


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
