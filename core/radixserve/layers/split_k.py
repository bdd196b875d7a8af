"""Split-K planning shared by the Triton GEMM/GEMV kernels (int4 in the core, FP8 in its plugin).

At small M a GEMM has too few output tiles to occupy the GPU, so the K loop is split across
programs that each write an fp32 partial, summed afterwards (by torch, or inside the same launch
through `jit_sum_splits`). Plugins may use this for their own kernels. Added in plugin API 1.2
(`jit_sum_splits`: session 12, used by the core's int4 kernels, not yet timed on a GPU)."""

from __future__ import annotations

import functools

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def plan_split_k(m: int, n: int, k: int, block_m: int, block_n: int, block_k: int, device: torch.device,
                 split_k: int | None = None, waves: int = 4) -> tuple[int, int]:
    """(split_k, k_per_split): how many K ranges the kernel's grid covers and how many K elements
    each holds (a multiple of `block_k`; the last range may be short).

    :param split_k: a requested number of splits (clamped to the K blocks), or None to choose:
        enough programs to cover every SM about `waves` times, each keeping >= 2 K blocks so the
        partial sums stay worth their extra traffic. Off CUDA (interpreter tests) 4 "SMs" are assumed.
    """
    tiles = cdiv(m, block_m) * cdiv(n, block_n)
    k_blocks = cdiv(k, block_k)
    if split_k is None:
        sms = _num_sms(device.index or 0) if device.type == "cuda" else 4
        split_k = max(1, min(k_blocks // 2, (waves * sms) // max(tiles, 1)))
    split_k = max(1, min(split_k, k_blocks))
    k_per_split = cdiv(k_blocks, split_k) * block_k
    return cdiv(k, k_per_split), k_per_split


tl = None  # triton.language, imported by `jit_sum_splits` on first use (jitted helpers resolve it as a global)


@functools.cache
def jit_sum_splits(interpret: bool):
    """A `@triton.jit` helper for split-K kernels that reduce in the same launch:
    `sum_splits(Y, WS, CNT, tile, offs, ok, MN, SPLITS)`. Call it after this program stored its fp32
    partial at `WS + split * MN + offs` (mask `ok`): it counts the split as done in `CNT[tile]` (int32,
    zero between calls), and the tile's last split to finish adds all partials, stores them in Y's
    dtype at `Y + offs` and resets the counter. One call of the kernel per counter buffer at a time.
    Kernels that call it must bind it to a module global (Triton resolves helpers by global name).
    `interpret` (whether TRITON_INTERPRET is on) is the cache key only: `@triton.jit` reads it itself."""
    del interpret
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def sum_splits(Y, WS, CNT, tile, offs, ok, MN, SPLITS):
        tl.debug_barrier()  # every thread's partial is written before the count (release, GPU scope)
        done = tl.atomic_add(CNT + tile, 1, sem="acq_rel", scope="gpu")
        if done == SPLITS - 1:
            total = tl.load(WS + offs, mask=ok, other=0.0, cache_modifier=".cg")
            for k in range(1, SPLITS):
                total += tl.load(WS + k * MN + offs, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(Y + offs, total.to(Y.dtype.element_ty), mask=ok)
            tl.atomic_xchg(CNT + tile, 0, sem="relaxed", scope="gpu")

    return sum_splits
