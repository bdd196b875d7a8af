"""Scheduler counters, exposed through `Scheduler.stats()` (and from there get_stats / /metrics)."""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field


@dataclass
class SchedulerMetrics:
    """Monotonic counters since start (or the last `flush_cache`, which does not reset them)."""

    prefill_tokens_computed: int = 0  # prompt (and recomputed) tokens that went through a forward
    prefill_tokens_cached: int = 0  # prompt tokens served from the prefix cache at admission
    generated_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    failed_requests: int = 0  # ended with an internal error after running alone (failure isolation)
    rejected_requests: int = 0
    retractions: int = 0
    prefill_batches: int = 0
    decode_batches: int = 0
    mixed_batches: int = 0
    overlapped_batches: int = 0  # decode batches launched before the previous batch was processed
    # speculative decoding: verify batches, and per request-step with a draft: drafts proposed/accepted
    spec_verify_batches: int = 0
    spec_verifies: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_invalid_draft_tokens: int = 0  # draft tokens dropped for breaking the contract (out of the vocabulary, ...)
    # where a busy scheduler's time goes: whole steps, and the part of them spent waiting on forwards
    # (launch to result; the non-overlapped path only: an overlapped step's forward runs under host work)
    steps: int = 0
    step_seconds: float = 0.0
    forward_seconds: float = 0.0
    # (time, generated_tokens) samples for a sliding-window throughput
    _window: deque = field(default_factory=lambda: deque(maxlen=64))

    def record_step(self, now: float | None = None) -> None:
        self._window.append((time.monotonic() if now is None else now, self.generated_tokens))

    def throughput(self) -> float:
        """Generated tokens per second over the recent window (0 until two samples exist)."""
        if len(self._window) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._window[0], self._window[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def spec_accept_length(self) -> float:
        """Mean tokens a verify produced per request (accepted drafts + the target's own); 0 before any."""
        return (self.spec_accepted_tokens + self.spec_verifies) / self.spec_verifies if self.spec_verifies else 0.0

    def cache_hit_rate(self) -> float:
        total = self.prefill_tokens_computed + self.prefill_tokens_cached
        return self.prefill_tokens_cached / total if total else 0.0


class StepTrace:
    """One line per forward appended to the file that `RADIXSERVE_STEP_TRACE` names: its start
    (`time.perf_counter()`), decode rows, the other new tokens (prompt chunks; a speculative verify's
    tokens count here too) and seconds, space-separated. Without overlap (the CPU's path) the seconds
    are the forward's, launch to result; with overlap (CUDA's default) a step runs from the previous
    step's tokens arriving (or its own launch onto an idle device) to its own tokens arriving.
    Where a served run's time goes, by batch kind and size, beside an offline one
    (`python benchmarks/step_trace_summary.py FILE`); off unless the variable is set."""

    ENV = "RADIXSERVE_STEP_TRACE"

    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get(cls.ENV)
        return cls(path) if path else None

    def record(self, start: float, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        # opened per line (tens of microseconds, a profiling run only): no handle outlives the
        # scheduler, and a killed process leaves whole lines
        with open(self.path, "a") as f:
            f.write(f"{start:.6f} {decode_rows} {prefill_tokens} {seconds:.6f}\n")
