"""Greedy stand-in with the sampler's API, used until radixserve.sampling exists."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GreedySamplingBatch:
    want_logprobs: bool
    top_k: list[int]

    @classmethod
    def from_reqs(cls, reqs, vocab_size: int, device) -> GreedySamplingBatch:
        return cls(
            want_logprobs=any(r.sampling_params.logprobs for r in reqs),
            top_k=[r.sampling_params.top_logprobs for r in reqs],
        )


@dataclass
class GreedySampleOutput:
    next_token_ids: torch.Tensor
    token_logprobs: torch.Tensor | None
    top_logprobs: list[list[tuple[int, float]]] | None


class GreedySampler:
    def sample(self, logits: torch.Tensor, sbatch: GreedySamplingBatch) -> GreedySampleOutput:
        ids = logits.argmax(dim=-1)
        if not sbatch.want_logprobs:
            return GreedySampleOutput(ids, None, None)
        logp = torch.log_softmax(logits.float(), dim=-1)
        token_lp = logp.gather(1, ids[:, None])[:, 0]
        tops = []
        for row, k in zip(logp, sbatch.top_k, strict=True):
            v, i = row.topk(k) if k else (row[:0], row[:0].long())
            tops.append(list(zip(i.tolist(), v.tolist(), strict=True)))
        return GreedySampleOutput(ids, token_lp, tops)
