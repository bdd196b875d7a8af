"""Which hidden rows get logits: the last new token of each request (EXTEND) or every row (DECODE)."""

from __future__ import annotations

import torch

from radixserve.state import ForwardBatch, ForwardMode


def last_token_rows(extend_lens: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """Index of each request's last packed token: cumsum(extend_lens) - 1."""
    ends = torch.tensor(extend_lens, dtype=torch.int64).cumsum(0) - 1
    return ends.to(device, non_blocking=True)


def select_logit_rows(hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """One row per request: its next-token hidden state."""
    if batch.mode is ForwardMode.DECODE:
        return hidden
    return hidden.index_select(0, last_token_rows(batch.extend_lens_cpu, hidden.device))
