"""Small-batch int4 GEMM on tensor cores over the row layout of `lowbit_gemv` (`RowInt4`).

For 3..64 activation rows (batched decode; `quant_int4.GEMV_MAX_ROWS` routes fewer to the GEMV) the
batch-1 GEMV would read each weight once per row group of 4 and slows down 3x from 1 to 4 rows, and the
split-K dequantizing kernel of `int4_triton` unpacks the sequential [K/8, N] packing with per-row
reloads (0.40x bf16 at batch 32 on the H200). Here each program owns
`block_n` output rows and a range of 128-column chunks of the row layout: it loads a chunk's codes
[block_n, 16 int32] once (ahead of use: Triton's software pipelining, or a register prefetch), and for
each of the 8 nibble planes (16 contiguous columns) it

1. moves the nibble to bits 16..19 (one shift) and ORs in the exponent of 2^7 (one LOP3 with the
   mask), which reads as the float 128 + code exactly (no int->float conversion);
2. dequantizes with one FMA, (128 + code) * scale + bias with bias = -(128 + zero) * scale per
   (row, group) -- the same value as (code - zero) * scale up to fp32 rounding of the bias
   (~1e-5 of the scale), so the bf16 weight equals the dequantized reference's almost always;
3. multiplies the [block_n, 16] weights by the [16, block_m] activations on tensor cores
   (fp32 accumulation).

Only uniform groups that never straddle a plane (the `RowInt4.group_size` fast path: multiples of
16 dividing 128, or multiples of 128) run here; `quant_int4.int4_linear` sends anything else to the
GEMV (up to 4 rows) or `int4_triton.fused_gemm`.
K is split across programs when the output alone has too few tiles to fill the GPU: each split
writes an fp32 partial, added up after the kernel by torch (the default, measured on the H200) or,
with `reduce="kernel"`, by the last split of each tile to finish (a per-tile counter in
`RowInt4.tile_counters`, reset by that split), which makes a call one launch and means a weight's
GEMM runs one call at a time (a model's forward pass is sequential; that mode is tested under the
Triton interpreter and not yet run on a GPU). Launch-only: CUDA-graph safe. Triton is imported on
first use.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from radixserve.layers.lowbit_gemv import CHUNK, PLANE, RowInt4
from radixserve.layers.split_k import cdiv, jit_sum_splits, plan_split_k
from radixserve.layers.triton_support import interpreting as _interpreting

triton = tl = sum_splits = None  # imported / made by `_kernels` on first use

MAX_ROWS = 64  # above this `quant_int4` dequantizes once into a bf16 GEMM (compute-bound)
_MAGIC_2_7 = (127 + 7) << 23  # float exponent of 2^7: a code at bits 16..19 reads as 128 + code


# how a chunk reaches the tensor cores: "planes" (8 dots of 16 columns, one per nibble plane), "chunk" (the
# chunk's 128 columns unpacked by broadcasting, one dot), "chunk_xfirst" (the same with the activations as the
# first operand, padded to 64 rows: on Hopper a warpgroup MMA that reads the weights from shared memory),
# "joined" (the planes unpacked as in "planes" and joined into one [rows, 128] tile: one dot; compiled for
# sm_90 with register prefetch its loop has 2 warpgroup fences/waits and 6 barriers a chunk where "planes" has
# 16 and 20, at 5.0 instructions a weight against 5.6: benchmarks/lowbit_sass.py; not yet timed on a GPU)
VARIANTS = ("planes", "chunk", "chunk_xfirst", "joined")
# how K splits are added up: "torch" (a sum and a cast after the kernel: three launches, the path measured on the
# H200) or "kernel" (each tile's last split adds the partials, counted in RowInt4.tile_counters: one launch;
# tested under the Triton interpreter, not yet run on a GPU)
REDUCES = ("torch", "kernel")


@dataclass(frozen=True)
class RowsGemmConfig:
    """One launch configuration: `block_n` output rows per program, warps, pipeline stages,
    whether the next chunk's codes are loaded into registers ahead (`prefetch`), the K split
    (`split_k`: None plans it from the SM count, `waves` programs per SM at most), how a chunk
    reaches the tensor cores (`variant`, one of VARIANTS) and how the splits are added up (`reduce`,
    one of REDUCES). The defaults are the H200's best summed over the Llama-3.1-8B shapes at 4-32 rows
    (benchmarks/h200/int4_rows_gemm.py, session 12 call 1; session 15 picked the same tiles with the splits
    added inside the kernel: AWQ decode at batch 16 went 0.73x -> 0.94x bf16)."""
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3  # no register prefetch: Triton pipelines the code loads (they end in a dot)
    prefetch: bool = False
    split_k: int | None = None
    waves: int = 4
    variant: str = "planes"
    reduce: str = "kernel"

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"RowsGemmConfig.variant={self.variant!r}: expected one of {', '.join(VARIANTS)}")
        if self.reduce not in REDUCES:
            raise ValueError(f"RowsGemmConfig.reduce={self.reduce!r}: expected one of {', '.join(REDUCES)}")


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    global triton, tl, sum_splits
    import triton
    import triton.language as tl

    from radixserve.layers import triton_interpreter

    sum_splits = jit_sum_splits(interpret)  # `interpret` is the cache key only: @triton.jit reads the env

    triton_interpreter.apply()  # the chunk loop's bound is a run-time scalar

    @triton.jit
    def rows_dot_kernel(X, C, S, Z, Y, WS, CNT, M, N, K, KW, G, stride_xm, MG, CHUNKS_PER_SPLIT,
                        SPLITS, REDUCE_HERE: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_M: tl.constexpr, PG: tl.constexpr, GS: tl.constexpr, PLANE_: tl.constexpr,
                        CK: tl.constexpr, PREFETCH: tl.constexpr, ONE_DOT: tl.constexpr, X_FIRST: tl.constexpr,
                        JOINED: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        pid_k = tl.program_id(1)
        n_ok = rows < N
        rows64 = rows.to(tl.int64)
        ms = tl.arange(0, BLOCK_M)
        m_ok = ms < M
        w = tl.arange(0, PLANE_)
        n_chunks = KW // PLANE_
        if X_FIRST:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        c_first = pid_k * CHUNKS_PER_SPLIT
        c_ptr = C + rows64[:, None] * KW + w[None, :]  # [BLOCK_N, PLANE] int32s of chunk 0
        if PREFETCH:
            nxt = tl.load(c_ptr + c_first * PLANE_, mask=n_ok[:, None] & (c_first < n_chunks), other=0,
                          eviction_policy="evict_first")
        for i in range(0, CHUNKS_PER_SPLIT):
            c = c_first + i
            c_ok = c < n_chunks  # the last split may be short: its codes and activations are masked
            if PREFETCH:  # register double buffer: the next chunk is in flight while this one computes
                p = nxt
                nxt = tl.load(c_ptr + (c + 1) * PLANE_, mask=n_ok[:, None] & (c + 1 < n_chunks)
                              & (i + 1 < CHUNKS_PER_SPLIT), other=0, eviction_policy="evict_first")
            else:
                p = tl.load(c_ptr + c * PLANE_, mask=n_ok[:, None] & c_ok, other=0, eviction_policy="evict_first")
            if ONE_DOT:
                # the whole chunk at once: [rows, 8 planes, 16] codes in column order (plane j = columns 16j..),
                # code | 2^23's exponent reads as 2^23 + code, one exact subtraction; scales per plane's group
                codes = (p[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF
                f = (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                grp = (c * CK + tl.arange(0, 8) * PLANE_) // GS
                g_ok = n_ok[:, None] & c_ok & (grp < G)[None, :]
                s = tl.load(S + rows64[:, None] * G + grp[None, :], mask=g_ok, other=0.0).to(tl.float32)
                zs = tl.load(Z + rows64[:, None] * G + grp[None, :], mask=g_ok, other=0.0).to(tl.float32) * s
                wt = tl.reshape((f * s[:, :, None] - zs[:, :, None]).to(X.dtype.element_ty), (BLOCK_N, CK))
                cols = c * CK + tl.arange(0, CK)
                if X_FIRST:  # [BLOCK_M >= 64, CK] x [CK, BLOCK_N]: Hopper's warpgroup MMA reads W from shared memory
                    xt = tl.load(X + ms[:, None] * stride_xm + cols[None, :],
                                 mask=m_ok[:, None] & (cols < K)[None, :], other=0.0)
                    acc = tl.dot(xt, tl.trans(wt), acc)
                else:
                    xt = tl.load(X + ms[None, :] * stride_xm + cols[:, None],
                                 mask=(cols < K)[:, None] & m_ok[None, :], other=0.0)
                    acc = tl.dot(wt, xt, acc)
            else:  # "planes" (a dot per plane) or "joined" (the planes joined into one tile, one dot)
                for j in tl.static_range(8):
                    if j % PG == 0:  # a group starts: its scale and the bias that folds zero and the 128 offset
                        grp = (c * CK + j * PLANE_) // GS
                        g_ok = n_ok & c_ok & (grp < G)
                        s = tl.load(S + rows64 * G + grp, mask=g_ok, other=0.0).to(tl.float32)[:, None]
                        b = -(tl.load(Z + rows64 * G + grp, mask=g_ok, other=0.0).to(tl.float32)[:, None] + 128.0) * s
                    if j < 4:
                        q = p << (16 - 4 * j)
                    elif j == 4:
                        q = p
                    else:
                        q = p >> (4 * j - 16)  # sign-extension bits land above bit 19: masked off
                    f = ((q & 0xF0000) | MG).to(tl.float32, bitcast=True)  # 128 + code
                    wt = (f * s + b).to(X.dtype.element_ty)
                    if not JOINED:
                        cols = c * CK + j * PLANE_ + w  # this plane's 16 activation columns
                        xt = tl.load(X + ms[None, :] * stride_xm + cols[:, None],
                                     mask=(cols < K)[:, None] & m_ok[None, :], other=0.0)
                        acc = tl.dot(wt, xt, acc)
                    elif j == 0:  # Triton has no lists of tensors: one name per plane
                        w0 = wt
                    elif j == 1:
                        w1 = wt
                    elif j == 2:
                        w2 = wt
                    elif j == 3:
                        w3 = wt
                    elif j == 4:
                        w4 = wt
                    elif j == 5:
                        w5 = wt
                    elif j == 6:
                        w6 = wt
                    else:
                        w7 = wt
                if JOINED:
                    # join's new last axis: [rows, 16, b0, b1, b2] holds plane b0 + 2 b1 + 4 b2; to [rows, plane, 16]
                    joined = tl.join(tl.join(tl.join(w0, w1), tl.join(w2, w3)),
                                     tl.join(tl.join(w4, w5), tl.join(w6, w7)))
                    wt = tl.reshape(tl.permute(joined, (0, 4, 3, 2, 1)), (BLOCK_N, CK))
                    cols = c * CK + tl.arange(0, CK)
                    xt = tl.load(X + ms[None, :] * stride_xm + cols[:, None],
                                 mask=(cols < K)[:, None] & m_ok[None, :], other=0.0)
                    acc = tl.dot(wt, xt, acc)
        if X_FIRST:
            offs = ms[:, None] * N + rows[None, :]
            ok = m_ok[:, None] & n_ok[None, :]
        else:
            offs = ms[None, :] * N + rows[:, None]
            ok = n_ok[:, None] & m_ok[None, :]
        # SPLITS is a run-time value (one compiled kernel for every split count): the two branches only store
        if SPLITS == 1:
            tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=ok)
        else:  # an fp32 partial to the workspace, added up by the tile's last split or by torch afterwards
            tl.store(WS + pid_k * M * N + offs, acc, mask=ok)
            if REDUCE_HERE:
                sum_splits(Y, WS, CNT, tl.program_id(0), offs, ok, M * N, SPLITS)

    return SimpleNamespace(rows_dot=rows_dot_kernel)


def supports(r: RowInt4) -> bool:
    """Whether `r`'s grouping runs here (uniform groups aligned to the nibble planes)."""
    return r.group_size > 0


def _block_m(m: int) -> int:
    return 16 if m <= 16 else (32 if m <= 32 else 64)


def _default(interpret: bool) -> RowsGemmConfig:
    return RowsGemmConfig(block_n=16, num_warps=1, num_stages=1) if interpret else RowsGemmConfig()


def int4_rows_gemm(x: torch.Tensor, r: RowInt4, config: RowsGemmConfig | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, columns already permuted for act-order) @ W -> [M, N] in x's dtype."""
    K, N = r.in_features, r.out_features
    if x.dim() != 2 or x.shape[1] != K or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"int4_rows_gemm: x must be [M<={MAX_ROWS}, {K}], got {tuple(x.shape)}")
    if not supports(r):
        raise ValueError("int4_rows_gemm: the weight's groups are not uniform (act-order with uneven groups); "
                         "use int4_triton.fused_gemm")
    cfg = config or _default(_interpreting())
    M = x.shape[0]
    n_tiles = cdiv(N, cfg.block_n)
    # one output tile along M (BLOCK_M >= M); K blocks are the row layout's 128-column chunks
    split, cols_per_split = plan_split_k(1, N, r.codes.shape[1] * 8, 1, cfg.block_n, CHUNK, x.device, cfg.split_k,
                                         cfg.waves)
    reduce_here = split > 1 and cfg.reduce == "kernel"
    if reduce_here and (r.tile_counters is None or r.tile_counters.numel() < n_tiles):
        raise ValueError(f"int4_rows_gemm: the weight needs {n_tiles} tile counters (made by lowbit_gemv.repack_int4)")
    g = r.group_size
    xc = x.contiguous()
    # several splits write fp32 partials here (one split: no workspace, the kernel never touches WS or CNT)
    ws = torch.empty((split, M, N), dtype=torch.float32, device=x.device) if split > 1 else None
    y = ws if split > 1 and not reduce_here else torch.empty((M, N), dtype=x.dtype, device=x.device)
    _kernels(_interpreting()).rows_dot[(n_tiles, split)](
        xc, r.codes, r.scales, r.zeros, y, y if ws is None else ws, r.tile_counters if reduce_here else r.codes,
        M, N, K, r.codes.shape[1], r.scales.shape[1], xc.stride(0), _MAGIC_2_7, cols_per_split // CHUNK, split,
        reduce_here,
        BLOCK_N=cfg.block_n, BLOCK_M=max(_block_m(M), 64 if cfg.variant == "chunk_xfirst" else 16),
        PG=min(g, CHUNK) // PLANE, GS=g, PLANE_=PLANE, CK=CHUNK, PREFETCH=cfg.prefetch,
        ONE_DOT=cfg.variant in ("chunk", "chunk_xfirst"), X_FIRST=cfg.variant == "chunk_xfirst",
        JOINED=cfg.variant == "joined", num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return ws.sum(0).to(x.dtype) if split > 1 and not reduce_here else y
