"""Triton kernels for the int4 weight-only linears (layout: `quant_int4.Int4Weight`).

- `fused_gemm(x, w)`: dequantize-in-the-GEMM for small batches (decode, 1-64 rows). Each program
  owns a [BLOCK_M, BLOCK_N] output tile and a slice of K (split-K, so batch-1 decode still fills
  the GPU); it reads each 4-bit weight element once, unpacks it in registers, applies the group's
  scale and zero, and accumulates in fp32. Memory-bound: ~4x fewer weight bytes than bf16.
- `dequantize(w, dtype)`: W [K, N] in `dtype`, for large batches (prefill), which then run a
  bf16/fp16 GEMM on tensor cores.

Triton is imported on first use (CPU machines may lack it). CPU tensors are accepted when
TRITON_INTERPRET=1 (tests). No host reads of device values: the kernels are CUDA-graph safe.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from radixserve.layers.split_k import cdiv, plan_split_k
from radixserve.layers.triton_support import available  # noqa: F401 (callers ask this module)
from radixserve.layers.triton_support import interpreting as _interpreting

if TYPE_CHECKING:
    from radixserve.layers.quant_int4 import Int4Weight

triton = tl = _unpacked_tile = None  # defined by `_kernels` on first use

# How a tile's 4-bit codes reach registers: "repeat" (each row loads its int32, cache hits) or
# "reshape" (each int32 loaded once, expanded in registers). Which is faster is the GPU's call:
# benchmarks/h200_quant.py times both; both are tested.
UNPACK = "repeat"




@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    del interpret  # cache key only: @triton.jit picks interpreter mode when it decorates
    # module globals, not locals: jitted kernels resolve `tl` and the helper they call by global name
    global triton, tl, _unpacked_tile
    import triton
    import triton.language as tl

    @triton.jit
    def _unpacked_tile(qw_ptr, s_ptr, z_ptr, g_ptr, k0, offs_n, K, N,
                       BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_SIZE: tl.constexpr,
                       GPT: tl.constexpr, ROWS: tl.constexpr, REPEAT_LOADS: tl.constexpr):
        """W[k0:k0+BLOCK_K, offs_n] as fp32: unpack 8 codes per int32, then (code - zero) * scale.
        GROUP_SIZE > 0: row k is in group k // GROUP_SIZE; GROUP_SIZE == 0: any grouping, read
        through g_idx row by row.
        REPEAT_LOADS: each row k loads its int32 (k // 8) and scale/zero rows directly (the same
        address 8 or GROUP_SIZE times: cache hits, no register reshapes); otherwise each int32 and
        each group's scales are loaded once and expanded in registers (GPT groups of ROWS rows)."""
        n_ok = offs_n < N
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        if REPEAT_LOADS:
            packed = tl.load(qw_ptr + (offs_k // 8)[:, None] * N + offs_n[None, :],
                             mask=k_ok[:, None] & n_ok[None, :], other=0)
            codes = ((packed >> ((offs_k % 8) * 4)[:, None]) & 0xF).to(tl.float32)
            if GROUP_SIZE > 0:
                g = offs_k // GROUP_SIZE
            else:
                g = tl.load(g_ptr + offs_k, mask=k_ok, other=0)
            s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            z = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            return (codes - z.to(tl.float32)) * s.to(tl.float32)
        offs_kp = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        packed = tl.load(qw_ptr + offs_kp[:, None] * N + offs_n[None, :],
                         mask=(offs_kp[:, None] < K // 8) & n_ok[None, :], other=0)
        shifts = tl.arange(0, 8) * 4
        codes = (packed[:, None, :] >> shifts[None, :, None]) & 0xF
        if GROUP_SIZE > 0:
            groups = k0 // GROUP_SIZE + tl.arange(0, GPT)
            g_ok = groups < (K + GROUP_SIZE - 1) // GROUP_SIZE
            s = tl.load(s_ptr + groups[:, None] * N + offs_n[None, :], mask=g_ok[:, None] & n_ok[None, :], other=0.0)
            z = tl.load(z_ptr + groups[:, None] * N + offs_n[None, :], mask=g_ok[:, None] & n_ok[None, :], other=0.0)
            codes = tl.reshape(codes, (GPT, ROWS, BLOCK_N)).to(tl.float32)
            w = (codes - z.to(tl.float32)[:, None, :]) * s.to(tl.float32)[:, None, :]
            return tl.reshape(w, (BLOCK_K, BLOCK_N))
        codes = tl.reshape(codes, (BLOCK_K, BLOCK_N))
        g = tl.load(g_ptr + offs_k, mask=k_ok, other=0)
        s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=n_ok[None, :], other=0.0)
        z = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=n_ok[None, :], other=0.0)
        return (codes.to(tl.float32) - z.to(tl.float32)) * s.to(tl.float32)

    @triton.jit
    def fused_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, M, N, K, stride_xm,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PER_SPLIT: tl.constexpr,
                          GROUP_SIZE: tl.constexpr, GPT: tl.constexpr, ROWS: tl.constexpr,
                          REPEAT_LOADS: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = pid_k * K_PER_SPLIT
        for k_off in range(0, K_PER_SPLIT, BLOCK_K):  # the last split's tail is masked (k >= K)
            k0 = k_start + k_off
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
            w = _unpacked_tile(qw_ptr, s_ptr, z_ptr, g_ptr, k0, offs_n, K, N, BLOCK_K, BLOCK_N, GROUP_SIZE, GPT, ROWS, REPEAT_LOADS)
            acc += tl.dot(x, w.to(x.dtype))
        out = out_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))

    @triton.jit
    def dequant_kernel(qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, N, K,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_SIZE: tl.constexpr,
                       GPT: tl.constexpr, ROWS: tl.constexpr, REPEAT_LOADS: tl.constexpr):
        k0 = tl.program_id(0) * BLOCK_K
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = _unpacked_tile(qw_ptr, s_ptr, z_ptr, g_ptr, k0, offs_n, K, N, BLOCK_K, BLOCK_N, GROUP_SIZE, GPT, ROWS, REPEAT_LOADS)
        tl.store(out_ptr + offs_k[:, None] * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty),
                 mask=(offs_k[:, None] < K) & (offs_n[None, :] < N))

    return SimpleNamespace(fused_gemm=fused_gemm_kernel, dequant=dequant_kernel)


def _group_size(w: Int4Weight, block_k: int) -> int:
    """The uniform group size when the kernel may read scales per group (rows k // g, and the
    tile is whole groups or inside one), else 0 (read through g_idx)."""
    g = w.uniform_group_size or 0
    if g and (block_k % g == 0 or g % block_k == 0):
        return g
    return 0


def _group_args(w: Int4Weight, block_k: int) -> dict[str, int]:
    g = _group_size(w, block_k)
    gpt = max(block_k // g, 1) if g else 1  # groups per K tile
    return {"GROUP_SIZE": g, "GPT": gpt, "ROWS": block_k // gpt, "REPEAT_LOADS": UNPACK == "repeat"}


def _block_k(K: int) -> int:
    return 128 if K >= 128 else max(16, 1 << (K.bit_length() - 1))


def fused_gemm(x: torch.Tensor, w: Int4Weight, split_k: int | None = None) -> torch.Tensor:
    """x [M, K] @ W [K, N] -> [M, N] in x's dtype, with W dequantized tile by tile in registers."""
    M, K = x.shape
    N = w.out_features
    if K != w.in_features:
        raise ValueError(f"input has {K} features, the int4 weight {w.in_features}")
    x = x.contiguous()
    block_m = 16 if M <= 16 else (32 if M <= 32 else 64)
    block_n, block_k = 64, _block_k(K)
    split_k, k_per_split = plan_split_k(M, N, K, block_m, block_n, block_k, x.device, split_k)
    # one split stores the result in x's dtype directly; several store fp32 partials to add up
    partial = torch.empty((split_k, M, N), dtype=x.dtype if split_k == 1 else torch.float32, device=x.device)
    grid = (cdiv(M, block_m), cdiv(N, block_n), split_k)
    _kernels(_interpreting()).fused_gemm[grid](
        x, w.qweight, w.scales, w.zeros, w.g_idx, partial, M, N, K, x.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, K_PER_SPLIT=k_per_split,
        **_group_args(w, block_k),
    )
    out = partial[0] if split_k == 1 else partial.sum(0)
    return out.to(x.dtype)


def dequantize(w: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """W [K, N] in `dtype` (rows in the kernel's order)."""
    K, N = w.in_features, w.out_features
    out = torch.empty((K, N), dtype=dtype, device=w.qweight.device)
    block_n, block_k = 64, _block_k(K)
    grid = (cdiv(K, block_k), cdiv(N, block_n))
    _kernels(_interpreting()).dequant[grid](w.qweight, w.scales, w.zeros, w.g_idx, out, N, K,
                                            BLOCK_N=block_n, BLOCK_K=block_k, **_group_args(w, block_k))
    return out
