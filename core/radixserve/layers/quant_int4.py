"""Weight-only int4 linears shared by the int4 QuantMethods (AWQ, GPTQ): the packing helpers their
checkpoint layouts need, one kernel layout both repack into, and the matmul that dispatches to a
Triton kernel on CUDA or dequantizes on the CPU.

The kernel layout (`Int4Weight`), for y = x @ W with W [K in, N out]:
- `qweight` int32 [K/8, N]: eight 4-bit codes per element along K, code k % 8 in bits 4*(k%8)
  (GPTQ's own `qweight` layout, so GPTQ without act-order needs no repacking);
- `scales`, `zeros` [G, N] in the activation dtype (zeros are the integer zero points as floats);
- `g_idx` int32 [K]: the group of each row of `qweight`;
- `perm` long [K] or None: with GPTQ act-order the rows are sorted by group so each tile reads
  few groups, and the input columns are permuted the same way (x[:, perm]).
W[k, n] = (code[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.layers import int4_rows_gemm, int4_triton, lowbit_gemv

PACK = 8  # 4-bit codes per int32
_SHIFTS = tuple(range(0, 32, 4))

# below this many rows the GEMM is memory-bound: the fused kernel reads the 4-bit weight once;
# above it, dequantizing once into a bf16/fp16 GEMM wins (tensor cores, compute-bound)
FUSED_MAX_ROWS = 64
# with the row-layout copy: batches of at most this many rows take the whole-row GEMV, larger ones (up to
# int4_rows_gemm.MAX_ROWS) the tensor-core GEMM over the same copy. H200, Llama-3.1-8B projections summed per
# layer: GEMV 72.5 / 109 / 234 us at 1 / 2 / 4 rows (sessions 12 and 7), the GEMM 128-131 us at 1-4 rows
GEMV_MAX_ROWS = 2


def _to_int32(v: torch.Tensor) -> torch.Tensor:
    """An int64 holding 32 bits -> int32 with the same bits (two's complement)."""
    v = v & 0xFFFFFFFF
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def pack_int4(codes: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(PACK))) -> torch.Tensor:
    """Pack 4-bit codes (ints 0..15) eight to an int32 along `dim`: within each group of eight
    consecutive codes, code `order[i]` goes to bits 4*i (sequential by default; AWQ interleaves)."""
    c = codes.to(torch.int64).movedim(dim, -1)
    if c.shape[-1] % PACK:
        raise ValueError(f"cannot pack {c.shape[-1]} codes into int32s of {PACK}")
    c = c.reshape(*c.shape[:-1], -1, PACK)[..., list(order)]
    shifted = c << torch.tensor(_SHIFTS, dtype=torch.int64, device=c.device)
    return _to_int32(shifted.sum(-1)).movedim(-1, dim).contiguous()


def unpack_int4(packed: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(PACK))) -> torch.Tensor:
    """Inverse of `pack_int4`: int32 -> codes (int32, 0..15), eight per element along `dim`."""
    p = packed.movedim(dim, -1)
    codes = (p[..., None] >> torch.tensor(_SHIFTS, dtype=torch.int32, device=p.device)) & 0xF
    inverse = [order.index(j) for j in range(PACK)]  # where code j sits
    codes = codes[..., inverse]
    return codes.reshape(*p.shape[:-1], -1).movedim(-1, dim).contiguous()


@dataclass
class Int4Weight:
    qweight: torch.Tensor  # int32 [K/8, N]
    scales: torch.Tensor  # [G, N]
    zeros: torch.Tensor  # [G, N]
    g_idx: torch.Tensor  # int32 [K]
    perm: torch.Tensor | None = None  # long [K]
    uniform_group_size: int | None = None  # g when g_idx[k] == k // g for every row (kernel fast path)
    rows: lowbit_gemv.RowInt4 | None = None  # row-layout copy for the small-batch kernels (`add_row_layout`)

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * PACK

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [K, N] in `dtype`, rows in the kernel's (possibly permuted) order."""
        if int4_triton.available(self.qweight):
            return int4_triton.dequantize(self, dtype)
        codes = unpack_int4(self.qweight, 0).to(torch.float32)
        g = self.g_idx.long()
        return ((codes - self.zeros[g].float()) * self.scales[g].float()).to(dtype)


def make_int4_weight(codes_or_qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     g_idx: torch.Tensor, dtype: torch.dtype, packed: bool) -> Int4Weight:
    """The kernel layout from row-packed (or plain [K, N] `codes`) int4 codes with their group
    scales, integer zero points and per-row groups; sorts rows by group when `g_idx` is not."""
    g_idx = g_idx.to(torch.int32)
    perm = None
    if bool((g_idx[1:] < g_idx[:-1]).any()):  # act-order: rows not in group order
        perm = torch.argsort(g_idx, stable=True)
        codes = unpack_int4(codes_or_qweight, 0) if packed else codes_or_qweight
        codes_or_qweight, packed = codes[perm], False
        g_idx = g_idx[perm].contiguous()
    qweight = codes_or_qweight if packed else pack_int4(codes_or_qweight, 0)
    k, groups = g_idx.numel(), scales.shape[0]
    g = -(-k // groups)
    rows = torch.arange(k, device=g_idx.device, dtype=torch.int32)
    uniform = g if torch.equal(g_idx, rows // g) else None
    w = Int4Weight(qweight.contiguous(), scales.to(dtype).contiguous(), zeros.to(dtype).contiguous(), g_idx, perm,
                   uniform)
    return w


def add_row_layout(w: Int4Weight) -> bool:
    """Give a CUDA int4 weight the row-layout copy that routes its small batches to the whole-row GEMV
    and (uniform groups) those of at most `int4_rows_gemm.MAX_ROWS` rows to the tensor-core GEMM over the
    same copy (`int4_linear` picks; what the int4 methods' `enable_lowbit_gemv` does); False, and nothing
    changed, for a CPU weight."""
    if not w.qweight.is_cuda:
        return False
    if w.rows is None:
        w.rows = lowbit_gemv.repack_int4(w)
    return True


def int4_linear(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ W -> [..., N] in x's dtype (+ bias)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if w.perm is not None:
        x2 = x2[:, w.perm]
    if int4_triton.available(x2) and x2.dtype in (torch.float16, torch.bfloat16, torch.float32):
        m = x2.shape[0]
        if w.rows is not None and m <= GEMV_MAX_ROWS:
            y = lowbit_gemv.int4_gemv(x2, w.rows)
        elif w.rows is not None and m <= int4_rows_gemm.MAX_ROWS and int4_rows_gemm.supports(w.rows):
            y = int4_rows_gemm.int4_rows_gemm(x2, w.rows)
        elif w.rows is not None and m <= lowbit_gemv.MAX_ROWS:  # groups the GEMM cannot read: the GEMV can
            y = lowbit_gemv.int4_gemv(x2, w.rows)
        elif m <= FUSED_MAX_ROWS:
            y = int4_triton.fused_gemm(x2, w)
        else:
            y = x2 @ int4_triton.dequantize(w, x2.dtype)
    else:
        y = (x2.float() @ w.dequantize(torch.float32)).to(x.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*shape[:-1], y.shape[-1])
