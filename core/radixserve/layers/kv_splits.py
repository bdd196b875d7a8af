"""Split-KV planning shared by the Triton decode kernels (plugins triton and mla_triton).

torch only: runs on the device without a host sync, so CUDA-graph replays can re-plan in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.state import ForwardMode


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



def split_planning_defaults(device: torch.device, min_split_tokens: int | None, sm_count: int | None,
                            interpret: bool) -> tuple[int, int]:
    """(min_split_tokens, sm_count) for `compute_num_kv_splits`, each the caller's value when given:
    else 128 tokens (16 under the Triton interpreter) and the CUDA device's multiprocessor count
    (8 off CUDA: the interpreter, where only the split count depends on it).

    Added in plugin API 1.4."""
    if min_split_tokens is None or min_split_tokens == 0:
        min_split_tokens = 16 if interpret else 128
    if sm_count is None:
        if device.type == "cuda":
            sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        else:
            sm_count = 8
    return min_split_tokens, sm_count


@dataclass
class SplitKVDecodeMetadata:
    """A split-KV decode's per-request buffers: the split counts and the stage-1 partial results
    the stage-2 reduction reads. Shared by the Triton decode backends (triton, mla_triton).

    `num_kv_splits`: int32 [bs]; `mid_o`: float32 [bs, H, max_splits, width] (width: head_dim, or
    kv_lora_rank for latent attention); `mid_lse`: float32 [bs, H, max_splits], log2-sum-exp.

    Added in plugin API 1.4."""

    num_kv_splits: torch.Tensor
    mid_o: torch.Tensor
    mid_lse: torch.Tensor

    @classmethod
    def allocate(cls, bs: int, num_heads: int, max_splits: int, width: int, device: torch.device,
                 zeroed: bool = False) -> SplitKVDecodeMetadata:
        """Fresh buffers for `bs` requests; `zeroed` (CUDA-graph static state): splits 1 and
        zeros, else uninitialised (the planner fills the splits before a kernel reads them)."""
        if zeroed:
            return cls(torch.ones(bs, dtype=torch.int32, device=device),
                       torch.zeros(bs, num_heads, max_splits, width, dtype=torch.float32, device=device),
                       torch.zeros(bs, num_heads, max_splits, dtype=torch.float32, device=device))
        return cls(torch.empty(bs, dtype=torch.int32, device=device),
                   torch.empty(bs, num_heads, max_splits, width, dtype=torch.float32, device=device),
                   torch.empty(bs, num_heads, max_splits, dtype=torch.float32, device=device))

    def graph_slice(self, batch, backend: str) -> SplitKVDecodeMetadata:
        """The first `batch.batch_size` rows of these static (CUDA-graph) buffers, as views: what
        `init_forward_metadata_capture` / `_replay` plan into. Raises ValueError naming the
        backend for a batch that is not DECODE or is larger than the buffers.

        Added in plugin API 1.4."""
        if batch.mode is not ForwardMode.DECODE:
            raise ValueError(f"the {backend} backend captures decode batches only, got {batch.mode}")
        bs, max_bs = batch.batch_size, self.num_kv_splits.shape[0]
        if bs > max_bs:
            raise ValueError(f"batch size {bs} exceeds the graph state's max_bs {max_bs}")
        return type(self)(self.num_kv_splits[:bs], self.mid_o[:bs], self.mid_lse[:bs])
