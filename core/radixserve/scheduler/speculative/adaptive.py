"""The low-acceptance safeguard: how many draft tokens a decode batch asks for.

Verifying k drafts costs a forward over k + 1 tokens per request. At small batches that forward
costs about as much as a plain decode (memory-bound), so speculation never loses; at large
batches it is compute-bound and drafts that are rejected are wasted work. The rule:

- batches smaller than `adaptive_batch_size` (or a value of 0): always `num_draft_tokens`;
- larger batches: ask for round(mean accepted drafts) + 1 tokens (at most `num_draft_tokens`),
  where the mean is an exponential moving average over recent verifies; while it is below
  `min_accepted_drafts`, the batch decodes without drafts, except one probe verify every
  PROBE_INTERVAL such steps that keeps the estimate current.
"""

from __future__ import annotations

EMA_WEIGHT = 0.2  # weight of the newest verify step in the moving average
PROBE_INTERVAL = 16  # plain decode steps between probe verifies while speculation is paused


class DraftLengthControl:
    def __init__(self, num_draft_tokens: int, adaptive_batch_size: int, min_accepted_drafts: float) -> None:
        self.max_tokens = num_draft_tokens
        self.batch_threshold = adaptive_batch_size
        self.min_accepted = min_accepted_drafts
        self.mean_accepted = float(num_draft_tokens)  # optimistic start: measure before cutting
        self._paused_steps = 0

    def tokens_for(self, batch_size: int) -> int:
        """Draft tokens per request for a decode batch of `batch_size` requests (0: no drafts)."""
        if self.batch_threshold == 0 or batch_size < self.batch_threshold:
            return self.max_tokens
        if self.mean_accepted < self.min_accepted:
            self._paused_steps += 1
            if self._paused_steps < PROBE_INTERVAL:
                return 0
            self._paused_steps = 0
            return 1
        return max(1, min(self.max_tokens, round(self.mean_accepted) + 1))

    def record(self, accepted_drafts: list[int]) -> None:
        """One verify step: the drafts accepted by each request that had a draft."""
        if not accepted_drafts:
            return
        step_mean = sum(accepted_drafts) / len(accepted_drafts)
        self.mean_accepted = (1 - EMA_WEIGHT) * self.mean_accepted + EMA_WEIGHT * step_mean
