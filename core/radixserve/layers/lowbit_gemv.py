"""Batch-1 (small-M) GEMVs for low-bit weights: int4 (AWQ/GPTQ, `quant_int4.Int4Weight`) and fp8.

Same style as `triton_gemv`: each program owns `block_n` whole output rows, streams their weight
rows once along K with wide loads, unpacks/upcasts in registers, accumulates in fp32 and writes the
result: no split-K, no reduction pass.

- int4: `RowInt4` is the row-major repack of an `Int4Weight`: `codes` int32 [N, K/8] (code k % 8
  of a row in bits 4*(k%8)), `scales`/`zeros` [N, G]. With a uniform group size g the kernel sums
  code*x per group and applies the group's scale/zero once: s * (sum(code*x) - z * sum(x)).
  Other groupings (GPTQ act-order whose sorted groups are not uniform) read g_idx per column.
- fp8: weight float8_e4m3fn [N, K] with per-row fp32 scales [N], activations kept in bf16/fp16
  (weight-only arithmetic: w upcast in registers, the row scale applied in the epilogue).

M rows (M <= MAX_ROWS) are handled by looping the rows inside the program (weights re-read from
L1/L2, not HBM). Launch-only, no host reads of device values: CUDA-graph safe.
Triton is imported on first use.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from radixserve.layers.triton_support import interpreting as _interpreting

triton = tl = None  # imported by `_kernels` on first use

MAX_ROWS = 4  # above this the existing tiled kernels (tensor cores) are used

# Off until the H200 numbers (benchmarks/h200/lowbit_gemv.py) show it beats the split-K kernels:
# RADIXSERVE_LOWBIT_GEMV=1 routes M <= MAX_ROWS CUDA activations of int4 (AWQ/GPTQ) and per-row fp8
# linears here. int4 then keeps a second, row-major copy of the codes (+1x the int4 weight bytes).
ENABLED = os.environ.get("RADIXSERVE_LOWBIT_GEMV", "0") == "1"


@dataclass
class RowInt4:
    codes: torch.Tensor  # int32 [N, K/8]
    scales: torch.Tensor  # [N, G]
    zeros: torch.Tensor  # [N, G]
    g_idx: torch.Tensor  # int32 [K]
    group_size: int  # uniform group size, or 0 (read g_idx)

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] * 8

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.zeros))


def repack_int4(w) -> RowInt4:
    """`Int4Weight` ([K/8, N] packed along K) -> `RowInt4` ([N, K/8]): the same 4-bit codes in the same
    bit positions, only transposed (int32 k//8 of column n becomes element [n, k//8])."""
    return RowInt4(w.qweight.t().contiguous(), w.scales.t().contiguous(), w.zeros.t().contiguous(),
                   w.g_idx.contiguous(), int(w.uniform_group_size or 0))


def dequantize_rows(r: RowInt4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [K, N] (the `Int4Weight.dequantize` orientation) from the row layout, in torch (reference)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=r.codes.device)
    codes = ((r.codes[..., None] >> shifts) & 0xF).reshape(r.out_features, -1).float()  # [N, K]
    g = r.g_idx.long()
    return ((codes - r.zeros[:, g].float()) * r.scales[:, g].float()).t().to(dtype)


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    del interpret  # cache key only
    global triton, tl
    import triton
    import triton.language as tl

    from radixserve.layers import triton_interpreter

    triton_interpreter.apply()  # the K loop's bound is a run-time scalar

    @triton.jit
    def int4_gemv_kernel(X, C, S, Z, GI, Y, M, N, K, G, stride_xm,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, GPT: tl.constexpr,
                         ROWS_M: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rows < N
        rows64 = rows.to(tl.int64)
        KP = K // 8
        for m in range(ROWS_M):
            m_ok = m < M
            acc = tl.zeros([BLOCK_N, GPT], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kp = k0 // 8 + tl.arange(0, BLOCK_K // 8)
                kp_ok = kp < KP
                packed = tl.load(C + rows64[:, None] * KP + kp[None, :], mask=n_ok[:, None] & kp_ok[None, :],
                                 other=0, eviction_policy="evict_first")
                shifts = tl.arange(0, 8) * 4
                codes = ((packed[:, :, None] >> shifts[None, None, :]) & 0xF).to(tl.float32)
                codes = tl.reshape(codes, (BLOCK_N, BLOCK_K))
                cols = k0 + tl.arange(0, BLOCK_K)
                k_ok = cols < K
                x = tl.load(X + m * stride_xm + cols, mask=k_ok & m_ok, other=0.0).to(tl.float32)
                if GROUP > 0:
                    # whole groups per step: sum code*x per group, then scale/zero once per group
                    cx = tl.sum(tl.reshape(codes * x[None, :], (BLOCK_N, GPT, GROUP)), axis=2)
                    xs = tl.sum(tl.reshape(x, (GPT, GROUP)), axis=1)
                    grp = k0 // GROUP + tl.arange(0, GPT)
                    g_ok = grp < G
                    s = tl.load(S + rows64[:, None] * G + grp[None, :], mask=n_ok[:, None] & g_ok[None, :],
                                other=0.0).to(tl.float32)
                    z = tl.load(Z + rows64[:, None] * G + grp[None, :], mask=n_ok[:, None] & g_ok[None, :],
                                other=0.0).to(tl.float32)
                    acc += s * (cx - z * xs[None, :])
                else:
                    g = tl.load(GI + cols, mask=k_ok, other=0)
                    s = tl.load(S + rows64[:, None] * G + g[None, :], mask=n_ok[:, None] & k_ok[None, :],
                                other=0.0).to(tl.float32)
                    z = tl.load(Z + rows64[:, None] * G + g[None, :], mask=n_ok[:, None] & k_ok[None, :],
                                other=0.0).to(tl.float32)
                    acc += tl.reshape((codes - z) * s * x[None, :], (BLOCK_N, GPT, BLOCK_K // GPT)).sum(axis=2)
            y = tl.sum(acc, axis=1)
            tl.store(Y + m * N + rows, y.to(Y.dtype.element_ty), mask=n_ok & m_ok)

    @triton.jit
    def fp8_gemv_kernel(X, W, S, Y, M, N, K, stride_xm, stride_wn,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS_M: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rows < N
        w_rows = W + rows.to(tl.int64)[:, None] * stride_wn
        scale = tl.load(S + rows, mask=n_ok, other=0.0).to(tl.float32)
        for m in range(ROWS_M):
            m_ok = m < M
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                k_ok = cols < K
                x = tl.load(X + m * stride_xm + cols, mask=k_ok & m_ok, other=0.0).to(tl.float32)
                w = tl.load(w_rows + cols[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                            eviction_policy="evict_first")
                acc += w.to(tl.float32) * x[None, :]
            y = tl.sum(acc, axis=1) * scale
            tl.store(Y + m * N + rows, y.to(Y.dtype.element_ty), mask=n_ok & m_ok)

    return SimpleNamespace(int4=int4_gemv_kernel, fp8=fp8_gemv_kernel)


@dataclass(frozen=True)
class LowbitConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def _default(interpret: bool, fp8: bool) -> LowbitConfig:
    if interpret:
        return LowbitConfig(8, 128 if not fp8 else 32, 1, 1)
    return LowbitConfig(16, 512, 4, 3) if fp8 else LowbitConfig(8, 1024, 4, 3)


def _check_x(x: torch.Tensor, k: int, what: str) -> None:
    if x.dim() != 2 or x.shape[1] != k or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"{what}: x must be [M<={MAX_ROWS}, {k}], got {tuple(x.shape)}")


def int4_gemv(x: torch.Tensor, r: RowInt4, config: LowbitConfig | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, rows already permuted for act-order) @ W -> [M, N] in x's dtype."""
    K, N = r.in_features, r.out_features
    _check_x(x, K, "int4_gemv")
    cfg = config or _default(_interpreting(), fp8=False)
    block_k = min(cfg.block_k, max(128, 1 << (K - 1).bit_length()))
    group = r.group_size if r.group_size and block_k % r.group_size == 0 and r.group_size >= 8 else 0
    gpt = block_k // group if group else max(1, block_k // 128)
    xc = x.contiguous()
    y = torch.empty((x.shape[0], N), dtype=x.dtype, device=x.device)
    grid = (-(-N // cfg.block_n),)
    _kernels(_interpreting()).int4[grid](
        xc, r.codes, r.scales, r.zeros, r.g_idx, y, x.shape[0], N, K, r.scales.shape[1], xc.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP=group, GPT=gpt, ROWS_M=x.shape[0],
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale_rows: torch.Tensor,
             config: LowbitConfig | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) @ (weight [N, K] fp8 * scale_rows[:, None]).T -> [M, N] in x's dtype;
    the activations stay in their dtype (no per-token quantization)."""
    N, K = weight.shape
    _check_x(x, K, "fp8_gemv")
    if weight.stride(1) != 1 or scale_rows.shape != (N,):
        raise ValueError(f"fp8_gemv: weight {tuple(weight.shape)} needs unit stride on K and scales [{N}], "
                         f"got {tuple(scale_rows.shape)}")
    cfg = config or _default(_interpreting(), fp8=True)
    xc = x.contiguous()
    y = torch.empty((x.shape[0], N), dtype=x.dtype, device=x.device)
    grid = (-(-N // cfg.block_n),)
    _kernels(_interpreting()).fp8[grid](
        xc, weight, scale_rows, y, x.shape[0], N, K, xc.stride(0), weight.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ROWS_M=x.shape[0],
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y
