"""Model-test helpers over `radixserve.static_batch` (the one loop that drives a ModelRunner
outside the scheduler): greedy generation with the logits kept."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from radixserve.state import SamplingParams, ScheduledBatch
from radixserve.static_batch import run_static_batch


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # fp32 [vocab] per generated token


def _batch(mode, reqs, input_ids, rows, prefix_lens, extend_lens, slots) -> ScheduledBatch:
    return ScheduledBatch(mode=mode, reqs=reqs, input_ids=input_ids, req_pool_indices=rows,
                          prefix_lens=prefix_lens, extend_lens=extend_lens, out_cache_loc=slots)


def greedy_generate(runner, prompts: list[list[int]], max_new_tokens: int, keep_logits: bool = False,
                    prefill_chunk: int | None = None) -> list[Generation]:
    """Greedy-decode every prompt together (EOS ignored): one EXTEND batch (or several chunks of at
    most `prefill_chunk` tokens per request), then DECODE steps. Returns per-request tokens (+ logits)."""
    alloc = runner.token_allocator
    res = run_static_batch(runner, prompts, SamplingParams(temperature=0.0, ignore_eos=True), max_new_tokens,
                           keep_logits=keep_logits, prefill_chunk=prefill_chunk)
    assert alloc.available_size() == alloc.size, "KV slots leaked"
    return [Generation(tokens, logits) for tokens, logits in zip(res.output_ids, res.logits, strict=True)]
