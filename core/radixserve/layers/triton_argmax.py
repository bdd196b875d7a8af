"""Row-wise argmax of the logits on the GPU in two short launches: the greedy sampler's last step.

At batch 1 the greedy token is the argmax of one row of 128,256 fp32 logits (Llama 3). torch's
`argmax` reduces such a row in one block: 27.6 us per decode step on the H200 (session 6 profile,
`reduce_kernel<ArgMaxOps>`), against ~0.5 MB read. Here stage 1 splits each row into `BLOCK`-wide
chunks, one program each (126 programs for one Llama-3 row), and writes each chunk's maximum and its
first index; stage 2 (one program per row) takes the first chunk holding the row's maximum.
Semantics are torch.argmax's: the first index of the maximum; a NaN counts as greater than every
number (the first NaN wins).

Triton is imported on first use (the module imports on machines without it).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from radixserve.layers.triton_support import interpreting as _interpreting

BLOCK = 1024  # logits per stage-1 program


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    del interpret  # only part of the cache key (see triton_gemv._kernels)
    import triton
    import triton.language as tl

    @triton.jit
    def chunk_argmax_kernel(X, MaxOut, IdxOut, V, stride_row, n_chunks, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + row.to(tl.int64) * stride_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        # torch.argmax ranks NaN above everything: map it to +inf and keep a flag so that a NaN
        # beats a real +inf that comes earlier in the row
        nan = x != x
        key = tl.where(nan, float("inf"), x)
        best = tl.max(key, axis=0)
        has_nan = tl.max(nan.to(tl.int32), axis=0)
        # first index of the chunk's winner: the first NaN if any, else the first maximum
        winner = tl.where(has_nan > 0, nan, key == best)
        idx = tl.min(tl.where(winner, cols, 2147483647), axis=0)
        # a NaN chunk is ranked above an all-finite chunk whose max is +inf: store NaN itself
        tl.store(MaxOut + row * n_chunks + chunk, tl.where(has_nan > 0, float("nan"), best))
        tl.store(IdxOut + row * n_chunks + chunk, idx)

    @triton.jit
    def reduce_chunks_kernel(MaxIn, IdxIn, Out, n_chunks, CHUNKS: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, CHUNKS)
        mask = offs < n_chunks
        m = tl.load(MaxIn + row * n_chunks + offs, mask=mask, other=float("-inf"))
        idx = tl.load(IdxIn + row * n_chunks + offs, mask=mask, other=2147483647)
        nan = (m != m) & mask
        key = tl.where(nan, float("inf"), m)
        best = tl.max(key, axis=0)
        has_nan = tl.max(nan.to(tl.int32), axis=0)
        winner = tl.where(has_nan > 0, nan, (key == best) & mask)
        # chunks are in index order, so the smallest winning index is the row's first maximum
        tl.store(Out + row, tl.min(tl.where(winner, idx, 2147483647), axis=0).to(tl.int64))

    return SimpleNamespace(chunk=chunk_argmax_kernel, reduce=reduce_chunks_kernel)


def available(logits: torch.Tensor) -> bool:
    """True when the sampler should use `argmax_rows` for `logits`: a CUDA float matrix with unit
    stride on its columns and fewer than 2**31 columns, and Triton imports."""
    from radixserve.layers.triton_support import triton_importable

    if logits.dim() != 2 or logits.stride(1) != 1 or not logits.is_floating_point() or logits.shape[1] >= 2**31:
        return False
    return logits.is_cuda and triton_importable()


def argmax_rows(logits: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """`torch.argmax(logits, dim=-1)` (int64 [rows]) for a float [rows, V] matrix with unit stride on
    V (rows may be strided: a slice of padded logits is read in place). Launch-only: no host sync.
    Raises ValueError for another layout (check `available` first)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"argmax_rows: need a [rows, V] matrix with unit stride on V, got {tuple(logits.shape)} "
                         f"with strides {logits.stride()}")
    rows, v = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if v == 0:
        raise ValueError("argmax_rows: an empty row has no argmax")
    n_chunks = -(-v // block)
    maxes = torch.empty((rows, n_chunks), dtype=torch.float32, device=logits.device)
    idxs = torch.empty((rows, n_chunks), dtype=torch.int32, device=logits.device)
    k = _kernels(_interpreting())
    k.chunk[(rows, n_chunks)](logits, maxes, idxs, v, logits.stride(0), n_chunks, BLOCK=block, num_warps=4)
    k.reduce[(rows,)](maxes, idxs, out, n_chunks, CHUNKS=max(16, 1 << (n_chunks - 1).bit_length()), num_warps=4)
    return out
