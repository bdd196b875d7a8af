"""The CUDA compute of the fp8 method: W8A8 through `torch._scaled_mm` (rowwise scales), and a
Triton kernel for 128x128 block-scaled weights that dequantizes tiles inside the GEMM.

Each returns None when its path is unavailable on this device (no fp8 GEMM before compute
capability 8.9, no Triton), and the method falls back to dequantizing; the first refusal is
logged once and remembered, so a GPU without fp8 support never retries per forward."""

from __future__ import annotations

import functools
import logging
import os
from types import SimpleNamespace

import torch
from radixserve.layers import lowbit_gemv
from radixserve.layers.split_k import cdiv, plan_split_k

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_disabled: set[str] = set()
triton = tl = None  # imported on first use


def _refuse(path: str, why: str) -> None:
    if path not in _disabled:
        logger.warning("fp8: %s unavailable (%s); dequantizing instead (slower)", path, why)
        _disabled.add(path)


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., out, in] float weights from FP8 `weight` and one scale per `block` tile
    [..., ceil(out/bo), ceil(in/bi)] (partial edge tiles allowed); multiplied in fp32, cast to `dtype`."""
    bo, bi = block
    full = scale.repeat_interleave(bo, dim=-2).repeat_interleave(bi, dim=-1)
    return (weight.to(torch.float32) * full[..., : weight.shape[-2], : weight.shape[-1]]).to(dtype)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: fp8 rows and their fp32 scales [M, 1] (amax / 448)."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@functools.cache
def _has_fp8_gemm(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9) and hasattr(torch, "_scaled_mm")


def quantize_per_token_padded(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_per_token` in one Triton launch, into `rows` >= M rows (the extra rows are zeros
    with scale 1e-12/448-clamped, so a padded GEMM adds nothing). Also runs on CPU tensors under
    TRITON_INTERPRET=1."""
    m, k = x.shape
    x = x.contiguous()
    q = torch.empty((rows, k), dtype=FP8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    _kernels(_interpreting()).quant_rows[(rows,)](x, q, scale, m, k, BLOCK=min(1024, _next_pow2(k)))
    return q, scale


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# decode-sized batches read the fp8 weight in a Triton GEMM with bf16 activations (no activation
# quantization: fewer launches, memory-bound anyway); larger ones run W8A8 on fp8 tensor cores
TRITON_MAX_ROWS = 16


def rowwise_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_rows: torch.Tensor,
                       row_gemv: bool = False) -> torch.Tensor | None:
    """x [M, K] @ (weight [N, K] fp8 * scale_rows [N]).T -> [M, N] in x's dtype, or None. `row_gemv`:
    batches of at most `lowbit_gemv.FP8_MAX_ROWS` rows run the whole-row fp8 GEMV."""
    if row_gemv and x.shape[0] <= lowbit_gemv.FP8_MAX_ROWS and "triton" not in _disabled and _triton_importable():
        return lowbit_gemv.fp8_gemv(x, weight, weight_scale_rows)  # whole rows per program, no split-K
    if x.shape[0] <= TRITON_MAX_ROWS and "triton" not in _disabled and _triton_importable():
        return block_fp8_gemm(x, weight, weight_scale_rows[:, None], (1, x.shape[1]))
    return scaled_mm_linear(x, weight, weight_scale_rows)


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        _refuse("triton", "triton is not installed")
        return False
    return True


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_rows: torch.Tensor) -> torch.Tensor | None:
    """W8A8 through `torch._scaled_mm`: activations quantized per token, weights per row."""
    if "scaled_mm" in _disabled:
        return None
    if not _has_fp8_gemm(x.device.index or 0):
        _refuse("scaled_mm", f"compute capability {torch.cuda.get_device_capability(x.device)} < 8.9")
        return None
    m = x.shape[0]
    pad = (-m) % 16  # cuBLASLt fp8 GEMMs want every dim a multiple of 16
    if _triton_importable():
        xq, xs = quantize_per_token_padded(x, m + pad)
    else:
        xq, xs = quantize_per_token(torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x)
    out_dtype = x.dtype if x.dtype == torch.bfloat16 else torch.bfloat16  # rowwise scaling outputs bf16
    try:
        y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=weight_scale_rows[None, :], out_dtype=out_dtype)
    except (RuntimeError, NotImplementedError) as e:
        _refuse("scaled_mm", str(e).splitlines()[0])
        return None
    return (y[:m] if pad else y).to(x.dtype)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    del interpret  # cache key only
    global triton, tl
    import triton
    import triton.language as tl

    @triton.jit
    def block_gemm_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PER_SPLIT: tl.constexpr,
                          SCALE_BLOCK_N: tl.constexpr, SCALE_BLOCK_K: tl.constexpr):
        """out[split] = x @ (w * block scale).T over this split's K range, fp32 partials."""
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
            w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None],
                        mask=(offs_n[None, :] < N) & (offs_k[:, None] < K), other=0.0)
            s = tl.load(s_ptr + (offs_n[None, :] // SCALE_BLOCK_N) * stride_sn + offs_k[:, None] // SCALE_BLOCK_K,
                        mask=(offs_n[None, :] < N) & (offs_k[:, None] < K), other=0.0)
            acc += tl.dot(x, (w.to(tl.float32) * s).to(x.dtype))
        out = out_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))

    @triton.jit
    def quant_rows_kernel(x_ptr, q_ptr, s_ptr, M, K: tl.constexpr, BLOCK: tl.constexpr):
        """Row r (< M): scale = max(amax|x_r| / 448, 1e-12), q_r = clamp(x_r / scale) in e4m3;
        rows >= M (padding): zeros."""
        row = tl.program_id(0)
        live = row < M
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            v = tl.load(x_ptr + row * K + offs, mask=(offs < K) & live, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1e-12)
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            v = tl.load(x_ptr + row * K + offs, mask=(offs < K) & live, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(v / scale, -448.0), 448.0)
            tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)

    return SimpleNamespace(block_gemm=block_gemm_kernel, quant_rows=quant_rows_kernel)


def block_fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                   block: tuple[int, int], split_k: int | None = None) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] fp8 * 128x128 block scales).T -> [M, N] in x's dtype (Triton).
    Also runs on CPU tensors under TRITON_INTERPRET=1 (tests)."""
    m, k = x.shape
    n = weight.shape[0]
    x = x.contiguous()
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n, block_k = 64, min(128, block[1])
    split_k, k_per_split = plan_split_k(m, n, k, block_m, block_n, block_k, x.device, split_k)
    partial = torch.empty((split_k, m, n), dtype=x.dtype if split_k == 1 else torch.float32, device=x.device)
    grid = (cdiv(m, block_m), cdiv(n, block_n), split_k)
    _kernels(_interpreting()).block_gemm[grid](
        x, weight, scale_inv, partial, m, n, k, x.stride(0), weight.stride(0), scale_inv.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, K_PER_SPLIT=k_per_split, SCALE_BLOCK_N=block[0], SCALE_BLOCK_K=block[1],
    )
    return (partial[0] if split_k == 1 else partial.sum(0)).to(x.dtype)


# above this many rows the block path dequantizes the weight once into a bf16 GEMM (prefill)
FUSED_MAX_ROWS = 64


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     block: tuple[int, int]) -> torch.Tensor | None:
    if "triton" in _disabled or not _triton_importable():
        return None
    if x.shape[0] <= FUSED_MAX_ROWS:
        return block_fp8_gemm(x, weight, scale_inv, block)
    s = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: weight.shape[0], : weight.shape[1]]
    return x @ (weight.to(x.dtype) * s.to(x.dtype)).T
