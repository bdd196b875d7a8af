"""Where each request's rows lie in an EXTEND batch's packed tensors, as the Triton extend
kernels (plugins triton and mla_triton) read them: the token offsets and, for speculative verify
of draft trees, the offsets of each request's block in the flat `ForwardBatch.tree_mask`.

torch only, no host sync beyond the host lengths the batch already carries. Added in plugin API 1.4."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixserve.state import ForwardBatch


def packed_starts(lens: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sum of `lens` (same dtype and device): where item i starts when the items
    are packed back to back. Added in plugin API 1.4."""
    starts = torch.zeros_like(lens)
    if lens.shape[0] > 1:
        torch.cumsum(lens[:-1], 0, out=starts[1:])
    return starts


def extend_starts(batch: ForwardBatch) -> tuple[torch.Tensor, list[int]]:
    """(offset of each request's first new token in the packed tokens, the new-token counts as a
    host list: `extend_lens_cpu`, else read from the device). Added in plugin API 1.4."""
    lens = batch.extend_lens_cpu or batch.extend_lens.tolist()  # host copy avoids a device sync
    return packed_starts(batch.extend_lens), lens


def tree_mask_starts(batch: ForwardBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For a batch with `tree_mask` set: (the mask as uint8 on `device`, where request i's
    `[e_i, e_i]` block starts in it). Added in plugin API 1.4."""
    return (batch.tree_mask.to(device=device, dtype=torch.uint8),
            packed_starts(batch.extend_lens * batch.extend_lens))
