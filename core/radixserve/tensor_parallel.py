"""Tensor parallelism in the executor: rank 0 schedules, the other ranks follow.

Rank 0 (the scheduler process) runs the one Scheduler, its prefix cache and allocator. Before
each forward its ModelRunner broadcasts a `TPStep`: the batch's forward inputs plus every
ReqToTokenPool write made since the previous step (`JournaledReqToTokenPool`). A follower rank
(`follow`) replays the writes into its own pool (so its attention reads the same KV slots, which
hold its own heads) and runs the same forward, joining the model's collectives. Only rank 0
samples; the followers never see a request, a tokenizer or a detokenizer. Why this design and not
"every rank schedules": docs/parallelism.md."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.memory import ReqToTokenPool
from radixserve.state import ForwardMode, FutureTokens, PromptLogprobRows, ScheduledBatch, SpecVerify

logger = logging.getLogger(__name__)


class JournaledReqToTokenPool(ReqToTokenPool):
    """Rank 0's pool: every write is also kept in `journal` until `take_journal()`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.journal: list[tuple] = []

    def write(self, idx: int, start: int, slots: torch.Tensor) -> None:
        super().write(idx, start, slots)
        self.journal.append(("row", int(idx), int(start), slots.to("cpu", torch.int64).tolist()))

    def write_positions(self, rows: list[int], cols: list[int], slots: torch.Tensor) -> None:
        super().write_positions(rows, cols, slots)
        self.journal.append(("cells", list(rows), list(cols), slots.to("cpu", torch.int64).tolist()))

    def take_journal(self) -> list[tuple]:
        out, self.journal = self.journal, []
        return out


def replay_journal(pool: ReqToTokenPool, journal: list[tuple]) -> None:
    for kind, a, b, slots in journal:
        t = torch.tensor(slots, dtype=torch.int64)
        if kind == "row":
            pool.write(a, b, t)
        else:
            pool.write_positions(a, b, t)


@dataclass
class TPStep:
    """One forward as rank 0 broadcasts it (host data only: a few ints per token)."""

    mode: str
    input_ids: list[int]
    req_pool_indices: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: list[int]
    greedy_ids: bool
    future: bool  # input ids follow as a device-tensor broadcast (overlap: not on the host yet)
    spec_parents: list[list[int]] | None = None
    journal: list[tuple] = field(default_factory=list)
    prompt_logprob_rows: PromptLogprobRows | None = None  # scored rows: their logits are collectives too

    @classmethod
    def of(cls, sb: ScheduledBatch, greedy_ids: bool, journal: list[tuple]) -> TPStep:
        future = sb.future_inputs is not None
        return cls(
            mode=sb.mode.name, input_ids=[] if future else list(sb.input_ids),
            req_pool_indices=list(sb.req_pool_indices), prefix_lens=list(sb.prefix_lens),
            extend_lens=list(sb.extend_lens), out_cache_loc=sb.out_cache_loc.to("cpu", torch.int64).tolist(),
            greedy_ids=greedy_ids, future=future,
            spec_parents=[list(p) for p in sb.spec.parents] if sb.spec is not None else None, journal=journal,
            prompt_logprob_rows=sb.prompt_logprob_rows,
        )

    def to_batch(self, device: torch.device) -> ScheduledBatch:
        """The follower's ScheduledBatch (no requests: it only runs the forward)."""
        n = len(self.req_pool_indices)
        future = None
        if self.future:  # placeholders: the real ids arrive by broadcast right after `prepare`
            future = FutureTokens(torch.zeros(n, dtype=torch.int64, device=device), list(range(n)))
        return ScheduledBatch(
            mode=ForwardMode[self.mode], reqs=[None] * n, input_ids=list(self.input_ids),
            req_pool_indices=list(self.req_pool_indices), prefix_lens=list(self.prefix_lens),
            extend_lens=list(self.extend_lens), out_cache_loc=torch.tensor(self.out_cache_loc, dtype=torch.int64),
            future_inputs=future, spec=SpecVerify(self.spec_parents) if self.spec_parents is not None else None,
            prompt_logprob_rows=self.prompt_logprob_rows,
        )


class TPRankLost(SystemExit):
    """A collective with the other ranks failed: a rank died. Ends this process (exit code 1)."""

    def __init__(self, error: BaseException) -> None:
        logger.error("tensor parallelism: lost contact with another rank (%r); exiting", error)
        super().__init__(1)


def follow(runner: Any) -> None:
    """A follower rank's loop: run every forward rank 0 broadcasts, until it broadcasts None."""
    group = runner.tp_group
    logger.info("tensor-parallel rank %d/%d following rank 0", group.rank, group.size)
    with torch.inference_mode():
        while True:
            try:
                step = group.broadcast_object(None)
            except RuntimeError as e:
                raise TPRankLost(e) from e
            if step is None:
                return
            replay_journal(runner.req_to_token_pool, step.journal)
            runner._forward(step.to_batch(runner.device), step.greedy_ids)
