"""Batch-1 (small-M) GEMVs for low-bit weights: int4 (AWQ/GPTQ, `quant_int4.Int4Weight`) and fp8.

Same style as `triton_gemv`: each program owns `block_n` whole output rows, streams their weight
rows once along K with wide loads, unpacks/upcasts in registers, accumulates in fp32 and writes the
result (int4 may cut K into `split_k` ranges for more programs in flight: the last range of a tile to
finish adds the fp32 partials in the same launch, counted in `RowInt4.tile_counters`).
M <= MAX_ROWS activation rows share each loaded weight tile
(one accumulator per row), so M=2..4 read the weight once. Launch-only, no host reads of device
values: CUDA-graph safe. Triton is imported on first use.

int4 layout (`RowInt4`, made once at load by `repack_int4`): codes int32 [N, Kp/8], Kp = K rounded
up to CHUNK (=128) columns, zero-padded. Each row is a run of 128-column chunks of PLANE (=16)
int32s; nibble j (bits 4j..4j+3) of int32 w in chunk c holds the code of column c*128 + 16*j + w.
So "nibble plane" j of a chunk covers 16 contiguous columns: the kernel takes it from the whole
loaded tile with static masks (the old [N, K/8] sequential packing needed per-nibble variable shifts
and reshapes that Triton lowers through shared memory: 0.36 TB/s on the H200), and the matching 16
activations are one contiguous load. Tiles are [chunks, rows, 16 int32] so each thread keeps several
rows and converts each activation once for all of them; the next tile is loaded into registers while
this one computes. Unpacking (benchmarks/lowbit_sass.py prints the loop's instruction mix): two shifts
per int32 bring every nibble to bits 8..11, 12..15 or 16..19; one LOP3 masks it and ORs in the
exponent of 2^15, 2^11 or 2^7, giving the float 2^15/2^11/2^7 + code exactly (no int->float
conversion, a quarter-rate instruction); the 2^15 planes subtract their offset at once, the others
accumulate f*x in fp32 and subtract sum(offset*x) + zero*sum(x) once per group before the scale
multiplies (relative error ~1e-5 of the output scale). Per weight: LOP3 + FFMA, plus ~2 instructions
per 8 weights. Planes never straddle a group when the group size is a multiple of 16 dividing 128 or
a multiple of 128; any other grouping (uneven sorted act-order groups) reads each column's group
from g_idx (slower, exact).

fp8: weight float8_e4m3fn [N, K] with per-row fp32 scales [N], activations kept in bf16/fp16
(weight-only arithmetic). Variants: "fma" (upcast to fp32, FMA), "fma_prefetch" (the same with the
next weight tile loaded into registers while this one computes) and "dot" (upcast to fp16 and a
tensor-core dot against the activations padded to 16 rows, fp32 accumulate; Triton pipelines its
weight loads through shared memory).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from radixserve.layers.split_k import jit_sum_splits, plan_split_k
from radixserve.layers.triton_support import interpreting as _interpreting

triton = tl = sum_splits = None  # imported / made by `_kernels` on first use

MAX_ROWS = 4  # above this the existing tiled kernels (tensor cores) are used
# fp8 at 4 rows took 329 us per 8B layer on the H200 against ~281 us for the tiled kernel at 1 row (the
# four fp32 accumulators spill); at 2 rows 124 us: fp8 layers route at most this many rows here
FP8_MAX_ROWS = 2
CHUNK = 128  # columns per packed chunk of the int4 row layout
PLANE = CHUNK // 8  # int32s per chunk (= columns per nibble plane)

def resolve(mode: str, device: torch.device) -> bool:
    """Whether a model on `device` uses these GEMVs, from `runtime.lowbit_gemv`: "auto" (the default)
    on CUDA, "on" too but a ValueError elsewhere, "off" never. Per model: the loader then asks each
    linear's QuantMethod to prepare for them (`QuantMethod.enable_lowbit_gemv`: int4 keeps a second
    copy of its codes in the row layout, +1x the int4 weight bytes; per-row fp8 layers flag themselves)."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"runtime.lowbit_gemv={mode!r}: expected 'auto', 'on' or 'off'")
    if mode == "on" and device.type != "cuda":
        raise ValueError(f"runtime.lowbit_gemv=on: the low-bit GEMVs run on CUDA, this model is on {device.type!r} "
                         "(use 'auto' or 'off')")
    return mode != "off" and device.type == "cuda"


@dataclass
class RowInt4:
    codes: torch.Tensor  # int32 [N, Kp/8], nibble-plane layout (module docstring)
    scales: torch.Tensor  # [N, G]
    zeros: torch.Tensor  # [N, G]
    g_idx: torch.Tensor  # int32 [Kp] (padding columns: group 0, their activations are masked to 0)
    group_size: int  # uniform group size, or 0 (read g_idx)
    in_features: int  # K before padding
    # int32 [ceil(N / 8)], zero between calls: the split-K kernels over this layout (`int4_gemv` with split_k > 1,
    # `int4_rows_gemm`) count finished K splits per output tile (>= 8 rows) here; the last split of a tile
    # sums the partials and resets its counter
    tile_counters: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.zeros))


def _plane_order(k_padded: int, device) -> torch.Tensor:
    """Column held by (int32 w, nibble j) of the layout, flattened as [chunk, w, j]."""
    c = torch.arange(k_padded // CHUNK, device=device)[:, None, None]
    w = torch.arange(PLANE, device=device)[None, :, None]
    j = torch.arange(8, device=device)[None, None, :]
    return (c * CHUNK + j * PLANE + w).reshape(-1)


def pack_rows(codes_nk: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (ints 0..15) -> the row layout's int32 [N, Kp/8] (zero-padded to CHUNK)."""
    n, k = codes_nk.shape
    kp = -(-k // CHUNK) * CHUNK
    c = torch.nn.functional.pad(codes_nk.to(torch.int64), (0, kp - k))[:, _plane_order(kp, codes_nk.device)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=c.device)
    v = (c.reshape(n, kp // 8, 8) << shifts).sum(-1) & 0xFFFFFFFF
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def unpack_rows(codes: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of `pack_rows`: codes [N, k] int32."""
    n, kp = codes.shape[0], codes.shape[1] * 8
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=codes.device)
    flat = ((codes[..., None] >> shifts) & 0xF).reshape(n, kp)
    out = torch.empty_like(flat)
    out[:, _plane_order(kp, codes.device)] = flat
    return out[:, :k]


def _uniform_kernel_group(g: int) -> int:
    """The group size the fast path handles (planes never straddle a group), or 0."""
    return g if g and g % PLANE == 0 and (CHUNK % g == 0 or g % CHUNK == 0) else 0


def repack_int4(w, slice_rows: int = 4096) -> RowInt4:
    """`Int4Weight` ([K/8, N] packed along K) -> `RowInt4` (nibble-plane rows, module docstring); the
    codes, scales and zeros are moved exactly. Works on `slice_rows` output rows at a time to bound
    the temporary memory."""
    from radixserve.layers.quant_int4 import unpack_int4

    k, n = w.in_features, w.out_features
    kp = -(-k // CHUNK) * CHUNK
    codes = torch.empty((n, kp // 8), dtype=torch.int32, device=w.qweight.device)
    for n0 in range(0, n, slice_rows):
        codes[n0:n0 + slice_rows] = pack_rows(unpack_int4(w.qweight[:, n0:n0 + slice_rows], 0).t())
    g_idx = torch.nn.functional.pad(w.g_idx.to(torch.int32), (0, kp - k)).contiguous()
    return RowInt4(codes, w.scales.t().contiguous(), w.zeros.t().contiguous(), g_idx,
                   _uniform_kernel_group(int(w.uniform_group_size or 0)), k,
                   torch.zeros(-(-n // 8), dtype=torch.int32, device=codes.device))


def dequantize_rows(r: RowInt4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [K, N] (the `Int4Weight.dequantize` orientation) from the row layout, in torch (reference)."""
    codes = unpack_rows(r.codes, r.in_features).float()
    g = r.g_idx[: r.in_features].long()
    return ((codes - r.zeros[:, g].float()) * r.scales[:, g].float()).t().to(dtype)


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    global triton, tl, sum_splits
    import triton
    import triton.language as tl

    from radixserve.layers import triton_interpreter

    sum_splits = jit_sum_splits(interpret)  # `interpret` is the cache key only: @triton.jit reads the env

    triton_interpreter.apply()  # the K loop's bound is a run-time scalar

    @triton.jit
    def int4_rows_kernel(X, C, S, Z, GI, Y, WS, CNT, M, N, K, KW, G, stride_xm, MG8, MG12, MG16, COLS_PER_SPLIT,
                         SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, CH: tl.constexpr, PG: tl.constexpr,
                         GS: tl.constexpr, ROWS_M: tl.constexpr, PLANE_: tl.constexpr):
        # tiles are [CH chunks, BLOCK_N rows, PLANE int32]: chunks first so that a warp's threads
        # spread over the chunks of a row (wide contiguous loads) and each thread keeps several rows
        # (the activations it converts are shared by those rows)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rows < N
        rows64 = rows.to(tl.int64)
        ch = tl.arange(0, CH)
        w = tl.arange(0, PLANE_)
        CK = PLANE_ * 8  # columns per chunk
        acc0 = tl.zeros([CH, BLOCK_N, PLANE_], dtype=tl.float32)
        if ROWS_M > 1:
            acc1 = tl.zeros([CH, BLOCK_N, PLANE_], dtype=tl.float32)
        if ROWS_M > 2:
            acc2 = tl.zeros([CH, BLOCK_N, PLANE_], dtype=tl.float32)
            acc3 = tl.zeros([CH, BLOCK_N, PLANE_], dtype=tl.float32)
        c_ptr = C + rows64[None, :, None] * KW + (ch * (CK // 8))[:, None, None] + w[None, None, :]
        # this program's columns: one K range of COLS_PER_SPLIT (a multiple of a loop step) per split
        k_begin = tl.program_id(1) * COLS_PER_SPLIT
        k_end = tl.minimum(k_begin + COLS_PER_SPLIT, KW * 8)
        nxt = tl.load(c_ptr + k_begin // 8, mask=(k_begin + ch * CK < k_end)[:, None, None] & n_ok[None, :, None],
                      other=0, eviction_policy="evict_first")
        for k0 in range(k_begin, k_end, CK * CH):
            kc = k0 + ch * CK  # [CH] first column of each chunk
            c_ok = kc < KW * 8
            # register double buffer: the next step's codes are in flight while this step computes
            # (Triton only pipelines loads that feed a dot)
            p = nxt
            kn = kc + CK * CH
            nxt = tl.load(c_ptr + (k0 + CK * CH) // 8, mask=(kn < k_end)[:, None, None] & n_ok[None, :, None],
                          other=0, eviction_policy="evict_first")
            # every nibble is brought to bits 8..11, 12..15 or 16..19 (two shifts per int32), then OR-ing it
            # into the mantissa of 2^15, 2^11 or 2^7 (whose unit there is 1) gives the float
            # 2^15 + code, 2^11 + code or 2^7 + code exactly: one LOP3 per weight, no int->float
            # conversion. The small offsets (2^11, 2^7) are accumulated in fp32 and subtracted once per
            # group (relative error ~1e-5); 2^15 would cost ~3e-4, so those two planes subtract it at once
            p_l12 = p << 12  # nibbles 0, 1 at bits 12.., 16..
            p_r12 = p >> 12  # nibbles 5, 6, 7 at bits 8.., 12.., 16.. (the masks drop the sign extension)
            for j in tl.static_range(8):
                if j == 0:
                    f = ((p_l12 & 0xF000) | MG12).to(tl.float32, bitcast=True)
                    OFFSET = 2048.0
                elif j == 1:
                    f = ((p_l12 & 0xF0000) | MG16).to(tl.float32, bitcast=True)
                    OFFSET = 128.0
                elif j == 2:
                    f = ((p & 0xF00) | MG8).to(tl.float32, bitcast=True) - 32768.0  # 2^15: subtract now
                    OFFSET = 0.0
                elif j == 3:
                    f = ((p & 0xF000) | MG12).to(tl.float32, bitcast=True)
                    OFFSET = 2048.0
                elif j == 4:
                    f = ((p & 0xF0000) | MG16).to(tl.float32, bitcast=True)
                    OFFSET = 128.0
                elif j == 5:
                    f = ((p_r12 & 0xF00) | MG8).to(tl.float32, bitcast=True) - 32768.0  # 2^15: subtract now
                    OFFSET = 0.0
                elif j == 6:
                    f = ((p_r12 & 0xF000) | MG12).to(tl.float32, bitcast=True)
                    OFFSET = 2048.0
                else:
                    f = ((p_r12 & 0xF0000) | MG16).to(tl.float32, bitcast=True)
                    OFFSET = 128.0
                cols = (kc + j * PLANE_)[:, None] + w[None, :]  # [CH, PLANE]: this plane's activations
                x_ok = cols < K
                x0 = tl.load(X + cols, mask=x_ok, other=0.0).to(tl.float32)
                if ROWS_M > 1:
                    x1 = tl.load(X + stride_xm + cols, mask=x_ok & (M > 1), other=0.0).to(tl.float32)
                if ROWS_M > 2:
                    x2 = tl.load(X + 2 * stride_xm + cols, mask=x_ok & (M > 2), other=0.0).to(tl.float32)
                    x3 = tl.load(X + 3 * stride_xm + cols, mask=x_ok & (M > 3), other=0.0).to(tl.float32)
                if PG > 0:
                    if j % PG == 0:  # a group starts: fresh partials (sum f*x, and per column sum x, sum offset*x)
                        part0 = f * x0[:, None, :]
                        xs0 = x0
                        xo0 = x0 * OFFSET
                        if ROWS_M > 1:
                            part1 = f * x1[:, None, :]
                            xs1 = x1
                            xo1 = x1 * OFFSET
                        if ROWS_M > 2:
                            part2 = f * x2[:, None, :]
                            xs2 = x2
                            xo2 = x2 * OFFSET
                            part3 = f * x3[:, None, :]
                            xs3 = x3
                            xo3 = x3 * OFFSET
                    else:
                        part0 += f * x0[:, None, :]
                        xs0 += x0
                        if OFFSET > 0.0:
                            xo0 += x0 * OFFSET
                        if ROWS_M > 1:
                            part1 += f * x1[:, None, :]
                            xs1 += x1
                            if OFFSET > 0.0:
                                xo1 += x1 * OFFSET
                        if ROWS_M > 2:
                            part2 += f * x2[:, None, :]
                            xs2 += x2
                            part3 += f * x3[:, None, :]
                            xs3 += x3
                            if OFFSET > 0.0:
                                xo2 += x2 * OFFSET
                                xo3 += x3 * OFFSET
                    if j % PG == PG - 1:  # the group ends: sum (code - zero) * x = part - sum offset*x - zero * sum x
                        grp = (kc + j * PLANE_) // GS
                        g_ok = (c_ok & (grp < G))[:, None] & n_ok[None, :]
                        s = tl.load(S + rows64[None, :] * G + grp[:, None], mask=g_ok, other=0.0).to(tl.float32)
                        z = tl.load(Z + rows64[None, :] * G + grp[:, None], mask=g_ok, other=0.0).to(tl.float32)
                        s3 = s[:, :, None]
                        z3 = z[:, :, None]
                        acc0 += (part0 - xo0[:, None, :] - z3 * xs0[:, None, :]) * s3
                        if ROWS_M > 1:
                            acc1 += (part1 - xo1[:, None, :] - z3 * xs1[:, None, :]) * s3
                        if ROWS_M > 2:
                            acc2 += (part2 - xo2[:, None, :] - z3 * xs2[:, None, :]) * s3
                            acc3 += (part3 - xo3[:, None, :] - z3 * xs3[:, None, :]) * s3
                else:  # per-column groups from g_idx
                    gi = tl.load(GI + cols, mask=c_ok[:, None], other=0)
                    off = rows64[None, :, None] * G + gi[:, None, :]
                    g_ok = c_ok[:, None, None] & n_ok[None, :, None]
                    s = tl.load(S + off, mask=g_ok, other=0.0).to(tl.float32)
                    z = tl.load(Z + off, mask=g_ok, other=0.0).to(tl.float32)
                    d = (f - (OFFSET + z)) * s  # (code - zero) * scale, the subtraction exact
                    acc0 += d * x0[:, None, :]
                    if ROWS_M > 1:
                        acc1 += d * x1[:, None, :]
                    if ROWS_M > 2:
                        acc2 += d * x2[:, None, :]
                        acc3 += d * x3[:, None, :]
        # one split stores the rows in Y's dtype; several store fp32 partials, the last split of the tile adds them
        out = Y if SPLITS == 1 else WS + tl.program_id(1) * M * N
        tl.store(out + rows, tl.sum(tl.sum(acc0, axis=2), axis=0).to(out.dtype.element_ty), mask=n_ok)
        if ROWS_M > 1:
            tl.store(out + N + rows, tl.sum(tl.sum(acc1, axis=2), axis=0).to(out.dtype.element_ty), mask=n_ok & (M > 1))
        if ROWS_M > 2:
            tl.store(out + 2 * N + rows, tl.sum(tl.sum(acc2, axis=2), axis=0).to(out.dtype.element_ty),
                     mask=n_ok & (M > 2))
            tl.store(out + 3 * N + rows, tl.sum(tl.sum(acc3, axis=2), axis=0).to(out.dtype.element_ty),
                     mask=n_ok & (M > 3))
        if SPLITS > 1:
            ms = tl.arange(0, ROWS_M)
            sum_splits(Y, WS, CNT, tl.program_id(0), ms[:, None] * N + rows[None, :],
                       (ms < M)[:, None] & n_ok[None, :], M * N, SPLITS)

    @triton.jit
    def fp8_fma_kernel(X, W, S, Y, M, N, K, stride_xm, stride_wn,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS_M: tl.constexpr, PREFETCH: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rows < N
        w_rows = W + rows.to(tl.int64)[:, None] * stride_wn
        acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        if ROWS_M > 1:
            acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        if ROWS_M > 2:
            acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            acc3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        kk = tl.arange(0, BLOCK_K)
        if PREFETCH:
            nxt = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & (kk < K)[None, :], other=0.0,
                          eviction_policy="evict_first")
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + kk
            k_ok = cols < K
            if PREFETCH:  # register double buffer: the next tile is in flight while this one computes
                wt = nxt.to(tl.float32)
                nxt = tl.load(w_rows + (cols + BLOCK_K)[None, :],
                              mask=n_ok[:, None] & (cols + BLOCK_K < K)[None, :], other=0.0,
                              eviction_policy="evict_first")
            else:
                wt = tl.load(w_rows + cols[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                             eviction_policy="evict_first").to(tl.float32)
            acc0 += wt * tl.load(X + cols, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            if ROWS_M > 1:
                acc1 += wt * tl.load(X + stride_xm + cols, mask=k_ok & (M > 1), other=0.0).to(tl.float32)[None, :]
            if ROWS_M > 2:
                acc2 += wt * tl.load(X + 2 * stride_xm + cols, mask=k_ok & (M > 2), other=0.0).to(tl.float32)[None, :]
                acc3 += wt * tl.load(X + 3 * stride_xm + cols, mask=k_ok & (M > 3), other=0.0).to(tl.float32)[None, :]
        scale = tl.load(S + rows, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(Y + rows, (tl.sum(acc0, axis=1) * scale).to(Y.dtype.element_ty), mask=n_ok)
        if ROWS_M > 1:
            tl.store(Y + N + rows, (tl.sum(acc1, axis=1) * scale).to(Y.dtype.element_ty), mask=n_ok & (M > 1))
        if ROWS_M > 2:
            tl.store(Y + 2 * N + rows, (tl.sum(acc2, axis=1) * scale).to(Y.dtype.element_ty), mask=n_ok & (M > 2))
            tl.store(Y + 3 * N + rows, (tl.sum(acc3, axis=1) * scale).to(Y.dtype.element_ty), mask=n_ok & (M > 3))

    @triton.jit
    def fp8_dot_kernel(X, W, S, Y, M, N, K, stride_xm, stride_wn,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # tensor cores: fp8 -> fp16 (a packed conversion) and a [BLOCK_N, BK] x [BK, 16] dot per step
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rows < N
        xm = tl.arange(0, 16)
        w_rows = W + rows.to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            k_ok = cols < K
            wt = tl.load(w_rows + cols[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                         eviction_policy="evict_first").to(tl.float16)
            xt = tl.load(X + cols[:, None] + xm[None, :] * stride_xm, mask=k_ok[:, None] & (xm < M)[None, :],
                         other=0.0).to(tl.float16)
            acc = tl.dot(wt, xt, acc)
        scale = tl.load(S + rows, mask=n_ok, other=0.0).to(tl.float32)
        y = acc * scale[:, None]
        tl.store(Y + xm[None, :] * N + rows[:, None], y.to(Y.dtype.element_ty), mask=n_ok[:, None] & (xm < M)[None, :])

    return SimpleNamespace(int4=int4_rows_kernel, fp8_fma=fp8_fma_kernel, fp8_dot=fp8_dot_kernel)


@dataclass(frozen=True)
class LowbitConfig:
    """One launch configuration: `block_n` output rows per program, `block_k` columns per loop step
    (int4: a multiple of CHUNK), warps, pipeline stages, the fp8 variant ("fma", "fma_prefetch"
    or "dot"), and (int4) how many K ranges `split_k` the rows are cut into, summed in the same launch
    (split_k > 1: tested under the Triton interpreter; slower than one range at one row on the H200, session 15)."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    variant: str = "fma"
    split_k: int = 1


def _default(interpret: bool, fp8: bool) -> LowbitConfig:
    if interpret:
        return LowbitConfig(8, 32 if fp8 else CHUNK, 1, 1)
    # the H200 winners on every Llama-3.1-8B shape (benchmarks/h200/lowbit_gemv.py, session 7 call 5:
    # int4 72.6 us, fp8 73.4 us per layer vs 116.5 us bf16 Triton GEMV)
    return LowbitConfig(8, 1024, 4, 1, "fma") if fp8 else LowbitConfig(32, 1024, 8, 1)


def _check_x(x: torch.Tensor, k: int, what: str) -> None:
    if x.dim() != 2 or x.shape[1] != k or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"{what}: x must be [M<={MAX_ROWS}, {k}], got {tuple(x.shape)}")


# the float exponent bits of 2^15, 2^11 and 2^7 (mantissa unit 1 at bit 8, 12, 16) as int32 arguments:
# with both the nibble mask and them immediates the compiler emits two LOP3s per nibble instead of one
_MAGICS = ((127 + 15) << 23, (127 + 11) << 23, (127 + 7) << 23)


def _rows_m(m: int) -> int:
    return 1 if m == 1 else (2 if m == 2 else 4)


def int4_gemv(x: torch.Tensor, r: RowInt4, config: LowbitConfig | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, columns already permuted for act-order) @ W -> [M, N] in x's dtype."""
    K, N = r.in_features, r.out_features
    _check_x(x, K, "int4_gemv")
    cfg = config or _default(_interpreting(), fp8=False)
    if cfg.block_k % CHUNK:
        raise ValueError(f"int4_gemv: block_k must be a multiple of {CHUNK}, got {cfg.block_k}")
    kp = r.codes.shape[1] * 8
    ch = min(cfg.block_k // CHUNK, 1 << (kp // CHUNK - 1).bit_length())  # no wider than the row
    g = r.group_size
    xc = x.contiguous()
    y = torch.empty((x.shape[0], N), dtype=x.dtype, device=x.device)
    tiles = -(-N // cfg.block_n)
    # K ranges of whole loop steps (ch chunks); one output tile along M
    splits, per_split = plan_split_k(1, N, kp, 1, cfg.block_n, ch * CHUNK, x.device, cfg.split_k)
    if splits > 1 and (r.tile_counters is None or r.tile_counters.numel() < tiles):
        raise ValueError(f"int4_gemv: split_k needs {tiles} tile counters (made by repack_int4)")
    # one split (the default): no workspace, the kernel never touches WS or CNT
    ws = torch.empty((splits, x.shape[0], N), dtype=torch.float32, device=x.device) if splits > 1 else y
    _kernels(_interpreting()).int4[(tiles, splits)](
        xc, r.codes, r.scales, r.zeros, r.g_idx, y, ws, r.tile_counters if splits > 1 else r.codes,
        x.shape[0], N, K, kp // 8, r.scales.shape[1],
        xc.stride(0), *_MAGICS, per_split, splits,
        BLOCK_N=cfg.block_n, CH=ch, PG=min(g, CHUNK) // PLANE if g else 0, GS=max(g, 1), ROWS_M=_rows_m(x.shape[0]),
        PLANE_=PLANE, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
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
    kern = _kernels(_interpreting())
    if cfg.variant == "dot":
        kern.fp8_dot[grid](xc, weight, scale_rows, y, x.shape[0], N, K, xc.stride(0), weight.stride(0),
                           BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
                           num_stages=cfg.num_stages)
    elif cfg.variant in ("fma", "fma_prefetch"):
        kern.fp8_fma[grid](xc, weight, scale_rows, y, x.shape[0], N, K, xc.stride(0), weight.stride(0),
                           BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ROWS_M=_rows_m(x.shape[0]),
                           PREFETCH=cfg.variant == "fma_prefetch",
                           num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        raise ValueError(f"fp8_gemv: unknown variant {cfg.variant!r} (expected 'fma', 'fma_prefetch' or 'dot')")
    return y
