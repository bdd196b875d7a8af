"""Split-KV planning shared by the Triton decode kernels (plugins triton and mla_triton).

torch only: runs on the device without a host sync, so CUDA-graph replays can re-plan in place.
"""

from __future__ import annotations

import torch


def compute_num_kv_splits(
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    num_kv_heads: int,
    max_splits: int,
    min_split_tokens: int,
    target_programs: int,
) -> None:
    """Fill `out` (int32 [bs]) with each request's KV split count, on the device, without a host sync.

    One split length serves the whole batch: the batch's KV tokens (times KV heads, one program per
    KV head and split) spread over about `target_programs` programs, but no split shorter than
    `min_split_tokens`. Long requests thus get more splits than short ones, which also evens out a
    batch mixing long and short contexts. Each count is then clamped to [1, max_splits].
    """
    total = seq_lens.sum() * num_kv_heads
    split_len = torch.div(total + (target_programs - 1), target_programs, rounding_mode="floor").clamp_(
        min=min_split_tokens
    )
    splits = torch.div(seq_lens + split_len - 1, split_len, rounding_mode="floor")
    out.copy_(splits.clamp_(1, max_splits))
