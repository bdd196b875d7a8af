"""Split-K planning shared by the Triton GEMM/GEMV kernels (int4 in the core, FP8 in its plugin).

At small M a GEMM has too few output tiles to occupy the GPU, so the K loop is split across
programs that each write an fp32 partial, summed afterwards. Plugins may use this for their own
kernels. Added in plugin API 1.2."""

from __future__ import annotations

import functools

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def plan_split_k(m: int, n: int, k: int, block_m: int, block_n: int, block_k: int, device: torch.device,
                 split_k: int | None = None) -> tuple[int, int]:
    """(split_k, k_per_split): how many K ranges the kernel's grid covers and how many K elements
    each holds (a multiple of `block_k`; the last range may be short).

    :param split_k: a requested number of splits (clamped to the K blocks), or None to choose:
        enough programs to cover every SM about four times, each keeping >= 2 K blocks so the
        partial sums stay worth their extra traffic. Off CUDA (interpreter tests) 4 "SMs" are assumed.
    """
    tiles = cdiv(m, block_m) * cdiv(n, block_n)
    k_blocks = cdiv(k, block_k)
    if split_k is None:
        sms = _num_sms(device.index or 0) if device.type == "cuda" else 4
        split_k = max(1, min(k_blocks // 2, (4 * sms) // max(tiles, 1)))
    split_k = max(1, min(split_k, k_blocks))
    k_per_split = cdiv(k_blocks, split_k) * block_k
    return cdiv(k, k_per_split), k_per_split
