"""Sampler: logits of one batch -> next token per request, every parameter applied per row.

Order of operations for each row (a documented contract the tests hold us to):
0. structured output (done by the runner before `sample`): tokens the row's grammar forbids get -inf;
1. penalties on the raw logits: repetition (HF semantics: over prompt + output tokens, a positive
   logit is divided by the penalty and a negative one multiplied), then frequency and presence
   (OpenAI semantics: over output tokens only, `logit -= freq * count + presence * (count > 0)`),
   then `logit_bias` is added, then stop tokens are banned while fewer than `min_new_tokens` were made
   (not in constrained rows: there the grammar decides when the output may end);
2. logprobs, when asked, are `log_softmax` of these processed logits -- before temperature and
   before top-k/top-p/min-p truncation (vLLM's "raw" convention after penalties);
3. greedy rows (temperature 0 or top_k 1) take the argmax of the processed logits;
4. other rows: softmax(logits / temperature), then top-k, then top-p on the top-k-renormalised
   distribution, then min-p (drop tokens below min_p * the top probability), then one draw.

A draw is the exponential race argmax(p / E) with E ~ Exp(1) i.i.d., which samples exactly from p.
A row with a seed draws E from its own generator seeded by (seed, tokens generated so far), so its
tokens do not depend on the other rows of the batch. On CPU fp32 logits without top-k/top-p/min-p
the draw is one fused kernel instead (sampling/cpu_draw.py: an inverse-CDF draw from the same p,
one uniform per row from the row's key: the seeded row's step seed, else a draw from this
sampler's stream).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.layers import cpu_ops, triton_argmax
from radixserve.sampling import cpu_draw
from radixserve.sampling.batch import SamplingBatch


@dataclass
class SampleOutput:
    """`next_token_ids` [bs] int64; `token_logprobs` [bs] float32 (meaningful for rows that asked)
    and `top_logprobs` (per row, (token id, logprob) best first; empty for rows that did not ask)
    are None unless some row asked for logprobs."""

    next_token_ids: torch.Tensor
    token_logprobs: torch.Tensor | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


class Sampler:
    """Stateless apart from the generator of unseeded rows (seeded by `seed` when given)."""

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, sb: SamplingBatch) -> SampleOutput:
        """Sample one token per row of `logits` [bs, V] (V may exceed sb.vocab_size by padding)."""
        if logits.shape[-1] != sb.vocab_size:
            logits = logits[:, : sb.vocab_size]
        logits = process_logits(logits.float(), sb)
        if sb.is_all_greedy:
            next_ids = greedy_argmax(logits)
        else:
            next_ids = self._sample_rows(logits, sb)
        if not sb.need_logprobs:
            return SampleOutput(next_ids)
        return _with_logprobs(next_ids, torch.log_softmax(logits, dim=-1), sb)

    # ---- random draws ---------------------------------------------------------------------
    def _sample_rows(self, logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        if not (sb.need_top_k or sb.need_top_p or sb.need_min_p) and cpu_draw.available(logits):
            return self._fused_rows(logits, sb)
        return self._torch_rows(logits, sb)

    def _fused_rows(self, logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        """The fused CPU draw (cpu_draw): unseeded rows are keyed by one draw each from this
        sampler's stream, a seeded row by its step seed (its draw depends on nothing else)."""
        keys = torch.randint(0, (1 << cpu_draw.KEY_BITS) - 1, (logits.shape[0],), dtype=torch.int64,
                             generator=self._generator(logits.device))
        for i, s in enumerate(sb.step_seeds or ()):
            if s is not None:
                keys[i] = s & ((1 << cpu_draw.KEY_BITS) - 1)
        ids = cpu_draw.sample_rows(logits, sb.temperatures, sb.greedy, keys)
        bad = ids < 0  # a NaN or +inf logit, or a row of -inf: the torch path's answer for it
        if bool(bad.any()):
            ids = torch.where(bad, self._torch_rows(logits, sb), ids)
        return ids

    def _torch_rows(self, logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        probs = torch.softmax(logits / sb.temperatures[:, None], dim=-1)
        if sb.need_top_k or sb.need_top_p or sb.need_min_p:
            probs = truncate(probs, sb)
        noise = torch.empty_like(probs).exponential_(generator=self._generator(probs.device))
        for i, s in enumerate(sb.step_seeds or ()):
            if s is not None:
                g = torch.Generator(device=probs.device)
                g.manual_seed(s)
                noise[i] = torch.empty_like(noise[i]).exponential_(generator=g)
        sampled = torch.argmax(probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny), dim=-1)
        return torch.where(sb.greedy, torch.argmax(logits, dim=-1), sampled)

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None  # torch's default stream
        g = self._generators.get(device)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            self._generators[device] = g
        return g


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1), same result, on the kernel for the device: the native CPU one,
    the two-launch Triton one on CUDA (layers/triton_argmax.py; torch's one-block reduction took
    27.6 us of a batch-1 Llama-3.1-8B step on the H200), else torch's."""
    if cpu_ops.available(logits):
        return cpu_ops.argmax_rows(logits)
    if triton_argmax.available(logits):
        return triton_argmax.argmax_rows(logits)
    return torch.argmax(logits, dim=-1)


def process_logits(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Apply penalties, logit bias and min-new-token bans (step 1 of the module contract).
    Returns a new tensor when anything applies; never modifies `logits` in place."""
    if sb.seen_mask is not None and sb.repetition_penalties is not None:
        pen = sb.repetition_penalties[:, None]
        penalised = torch.where(logits > 0, logits / pen, logits * pen)
        logits = torch.where(sb.seen_mask, penalised, logits)
    if sb.output_counts is not None:
        counts = sb.output_counts
        logits = logits - sb.frequency_penalties[:, None] * counts - sb.presence_penalties[:, None] * (counts > 0)
    if sb.logit_bias is not None:
        logits = logits + sb.logit_bias
    if sb.stop_suppress_mask is not None:
        logits = logits.masked_fill(sb.stop_suppress_mask, float("-inf"))
    return logits


def truncate(probs: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Zero the probabilities that top-k, then top-p, then min-p exclude (not renormalised)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if sb.need_top_k:
        ranks = torch.arange(sorted_p.shape[-1], device=probs.device)
        keep &= ranks[None, :] < sb.top_ks[:, None]
        sorted_p = sorted_p * keep
    if sb.need_top_p:
        renorm = sorted_p / sorted_p.sum(dim=-1, keepdim=True)
        mass_before = renorm.cumsum(dim=-1) - renorm
        top_p = sb.top_ps[:, None]
        # a row with top_p == 1 keeps everything, whatever the float rounding of the cumsum
        keep &= (mass_before < top_p) | (top_p >= 1.0)
    if sb.need_min_p:
        keep &= sorted_p >= sb.min_ps[:, None] * sorted_p[:, :1]
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p * keep)


def _with_logprobs(next_ids: torch.Tensor, logprobs: torch.Tensor, sb: SamplingBatch) -> SampleOutput:
    token_lp = logprobs.gather(1, next_ids[:, None]).squeeze(1)
    nums = sb.top_logprobs_nums or [0] * sb.batch_size
    top: list[list[tuple[int, float]]] = [[] for _ in nums]
    k = max(nums, default=0)
    if k > 0:
        vals, ids = logprobs.topk(k, dim=-1)
        vals, ids = vals.cpu().tolist(), ids.cpu().tolist()
        for i, n in enumerate(nums):
            top[i] = list(zip(ids[i][:n], vals[i][:n], strict=True))
    return SampleOutput(next_ids, token_lp, top)
