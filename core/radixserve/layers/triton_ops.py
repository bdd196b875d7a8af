"""Fused Triton kernels for the per-token layers: RMSNorm (+ residual add), SiLU-and-mul, rotary.

Each replaces a chain of small torch kernels (casts, reductions, elementwise ops, concatenations)
with one launch that reads its inputs once. Numerics follow the torch code of the layers: the same
fp32 statistics and the same roundings to the tensor dtype at the same points, so bf16 outputs
agree with the fallback (rotary and SiLU-and-mul elementwise; RMSNorm up to the order of the
fp32 sum of squares).

Triton is imported lazily, on the first kernel call: `radixserve.layers` must import on machines
without Triton (CPU users), and the layers only call in here for CUDA tensors (`available`).
The wrappers also accept CPU tensors when TRITON_INTERPRET=1 (the CPU tests run the kernels in
Triton's interpreter). Nothing here reads device values back to the host, so the kernels can be
recorded into CUDA graphs; outputs are fresh tensors (torch.empty), never views of the inputs.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from radixserve.layers.triton_support import (
    available,  # noqa: F401 (callers ask this module)
    trigger_dependents,
)
from radixserve.layers.triton_support import interpreting as _interpreting

triton = tl = _rotate_heads = None  # imported by `_kernels` on first use

# One program holds a whole row in registers; beyond this a row would spill (no model is that wide).
MAX_NORM_HIDDEN = 65536




def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    """The jitted kernels, built on first use. Keyed by interpreter mode because `@triton.jit`
    decides between compiling and interpreting when it decorates, not when it launches."""
    del interpret  # only part of the cache key
    # module globals, not locals: Triton's interpreter looks for `tl` in the kernel's globals
    global triton, tl, _rotate_heads
    import triton
    import triton.language as tl
    import triton.language.extra.cuda  # noqa: F401 - tl.extra.cuda.gdc_launch_dependents

    from radixserve.layers.triton_rotary import rotate_heads as _rotate_heads

    @triton.jit
    def rmsnorm_kernel(
        X,
        R,
        W,
        Out,
        ResOut,
        stride_x,
        stride_r,
        stride_o,
        stride_ro,
        n_cols,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
        TRIGGER: tl.constexpr,
    ):
        if TRIGGER:  # a PDL-launched GEMV after it (the batch-1 LM head after the final norm) may start early
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)  # int64: rows * stride can pass 2**31 in long prefills
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
            # torch's `x + residual` rounds the sum to x's dtype before the norm sees it
            x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
            tl.store(ResOut + row * stride_ro + cols, x, mask=mask)
        x32 = x.to(tl.float32)
        var = tl.sum(x32 * x32, axis=0) / n_cols  # masked lanes are 0: they add nothing
        rstd = tl.math.rsqrt(var + eps)
        # HF recipe: cast the normalised row to x's dtype, then multiply by the weight
        y = (x32 * rstd).to(X.dtype.element_ty).to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Out + row * stride_o + cols, (y * w).to(Out.dtype.element_ty), mask=mask)

    @triton.jit
    def silu_and_mul_kernel(X, Out, stride_x, stride_o, d, BLOCK: tl.constexpr, TRIGGER: tl.constexpr):
        if TRIGGER:  # a PDL-launched GEMV after it (the down projection) may start loading its weights
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < d
        gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(X + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
        # F.silu works in fp32 and rounds to the dtype; the product with `up` is a second rounding
        act = tl.div_rn(gate, 1.0 + tl.exp(-gate)).to(Out.dtype.element_ty).to(tl.float32)
        tl.store(Out + row * stride_o + cols, (act * up).to(Out.dtype.element_ty), mask=mask)

    @triton.jit
    def rotary_kernel(
        Q,
        K,
        QO,
        KO,
        C,
        S,
        P,
        stride_q,
        stride_k,
        stride_c,
        stride_s,
        NQ: tl.constexpr,
        NK: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HALF: tl.constexpr,
        HALF_BLOCK: tl.constexpr,
        REST: tl.constexpr,
        REST_BLOCK: tl.constexpr,
        BLOCK_H: tl.constexpr,
        GATHER: tl.constexpr,
    ):
        # grid: (token, head block); the first blocks cover q's heads, the rest k's: one launch for both
        row = tl.program_id(0).to(tl.int64)
        hb = tl.program_id(1)
        q_blocks: tl.constexpr = (NQ + BLOCK_H - 1) // BLOCK_H
        if hb < q_blocks:
            src = Q + row * stride_q
            dst = QO + row * (NQ * HEAD_DIM)
            head0 = hb * BLOCK_H
            n_heads = NQ
        else:
            src = K + row * stride_k
            dst = KO + row * (NK * HEAD_DIM)
            head0 = (hb - q_blocks) * BLOCK_H
            n_heads = NK
        heads = head0 + tl.arange(0, BLOCK_H)
        # GATHER: C/S are the whole fp32 cos/sin caches and P the positions
        crow = tl.load(P + row).to(tl.int64) if GATHER else row
        _rotate_heads(src + heads[:, None] * HEAD_DIM, dst + heads[:, None] * HEAD_DIM, heads < n_heads, C, S, crow,
                      stride_c, stride_s, QO.dtype.element_ty, HALF, HALF_BLOCK, REST, REST_BLOCK)

    return SimpleNamespace(rmsnorm=rmsnorm_kernel, silu_and_mul=silu_and_mul_kernel, rotary=rotary_kernel)


def _rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """`x` as [rows, width] with unit column stride (a view when possible, else a copy)."""
    x2 = x.reshape(-1, width)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`RMSNorm.forward` in one kernel: norm(x), or (norm(x + residual), x + residual).

    Normalises over the last dim; any leading shape. The output dtype is the promotion of x's and
    the weight's (as `weight * normed` gives in torch); residual must have x's shape and dtype."""
    hidden = x.shape[-1]
    if hidden > MAX_NORM_HIDDEN:
        raise ValueError(f"rmsnorm: hidden size {hidden} > {MAX_NORM_HIDDEN}")
    if weight.shape != (hidden,):
        raise ValueError(f"rmsnorm: weight shape {tuple(weight.shape)} != ({hidden},)")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError("rmsnorm: residual must have x's shape and dtype")
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    x2 = _rows(x, hidden)
    n_rows = x2.shape[0]
    if n_rows and hidden:
        r2 = _rows(residual, hidden) if residual is not None else x2  # dummy pointer when unused
        ro2 = res_out.view(-1, hidden) if res_out is not None else out.view(-1, hidden)
        block = _next_pow2(hidden)
        _kernels(_interpreting()).rmsnorm[(n_rows,)](
            x2,
            r2,
            weight.contiguous(),
            out.view(-1, hidden),
            ro2,
            x2.stride(0),
            r2.stride(0),
            hidden,
            hidden,
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            TRIGGER=trigger_dependents(x2),
            num_warps=min(max(block // 256, 1), 16),  # ~8 elements per thread: 16-byte bf16 loads
        )
    return out if res_out is None else (out, res_out)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] on the last dim -> silu(gate) * up, in x's dtype (as `F.silu(gate) * up`)."""
    width = x.shape[-1]
    if width % 2:
        raise ValueError(f"silu_and_mul: last dim {width} is odd")
    d = width // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    x2 = _rows(x, width)
    n_rows = x2.shape[0]
    if n_rows and d:
        block = min(1024, _next_pow2(d))
        grid = (n_rows, (d + block - 1) // block)
        _kernels(_interpreting()).silu_and_mul[grid](
            x2, out.view(-1, d), x2.stride(0), d, d, BLOCK=block, num_warps=min(max(block // 256, 1), 4),
            TRIGGER=trigger_dependents(x2),
        )
    return out


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
    rotary_dim: int,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox (rotate-half) rotary on the first `rotary_dim` dims of every head, as
    `RotaryEmbedding._rotate` computes it; the rest of each head is copied.

    q: [n, hq*head_dim], k: [n, hkv*head_dim] (rows may be strided, e.g. slices of a fused qkv
    output); cos/sin: [n, rotary_dim] already gathered per token, in q's dtype, or, with `positions`
    [n], the whole [max_position, rotary_dim] caches in any float dtype: the kernel gathers row
    positions[i] and rounds it to q's dtype itself (saves a gather and a cast kernel per layer).
    Out of place: returns new contiguous (q_rot, k_rot) and leaves q and k untouched, like the torch path."""
    n = q.shape[0]
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary: rotary_dim {rotary_dim} must be even and in (0, head_dim={head_dim}]")
    if q.shape[-1] % head_dim or k.shape[-1] % head_dim or k.shape[0] != n:
        raise ValueError(f"rotary: q {tuple(q.shape)} / k {tuple(k.shape)} are not [n, heads*{head_dim}]")
    if q.dtype != k.dtype or (positions is None and not q.dtype == cos.dtype == sin.dtype):
        raise ValueError("rotary: q, k (and cos, sin unless positions are given) must share a dtype")
    rows = n if positions is None else cos.shape[0]
    if cos.shape != (rows, rotary_dim) or sin.shape != (rows, rotary_dim):
        raise ValueError(f"rotary: cos/sin must be [{rows}, {rotary_dim}]")
    if positions is not None and positions.shape != (n,):
        raise ValueError(f"rotary: positions must be [{n}]")
    q2, k2 = _rows(q, q.shape[-1]), _rows(k, k.shape[-1])
    c2, s2 = _rows(cos, rotary_dim), _rows(sin, rotary_dim)
    nq, nk = q2.shape[1] // head_dim, k2.shape[1] // head_dim
    q_out = torch.empty((n, nq * head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((n, nk * head_dim), dtype=k.dtype, device=k.device)
    if n == 0 or nq + nk == 0:
        return q_out, k_out
    half, rest = rotary_dim // 2, head_dim - rotary_dim
    half_block = _next_pow2(half)
    block_h = max(1, min(16, 512 // half_block))  # ~512 (head, dim) pairs of each half per program
    grid = (n, (nq + block_h - 1) // block_h + (nk + block_h - 1) // block_h)
    _kernels(_interpreting()).rotary[grid](
        q2,
        k2,
        q_out,
        k_out,
        c2,
        s2,
        positions if positions is not None else c2,  # unread without GATHER
        q2.stride(0),
        k2.stride(0),
        c2.stride(0),
        s2.stride(0),
        NQ=nq,
        NK=nk,
        HEAD_DIM=head_dim,
        HALF=half,
        HALF_BLOCK=half_block,
        REST=rest,
        REST_BLOCK=_next_pow2(rest) if rest else 1,
        BLOCK_H=block_h,
        GATHER=positions is not None,
        num_warps=4,
        enable_fp_fusion=False,  # keep x*cos + rot*sin as rounded mul, mul, add: bit-equal to torch in fp32
    )
    return q_out, k_out
