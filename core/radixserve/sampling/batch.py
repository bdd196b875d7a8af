"""SamplingBatch: the per-request sampling parameters of one batch, as tensors on the device.

Dense [bs, vocab] tensors (penalty counts, logit bias, min-token masks) are built only when at least
one request of the batch needs them, so a plain batch costs a handful of small [bs] tensors.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from radixserve.state import Req

_MASK64 = (1 << 64) - 1


def step_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed for token number `step` of a request seeded with `seed`.

    Depends only on (seed, step), so a seeded request draws the same random numbers whether it runs
    alone or batched. splitmix64 mixing keeps neighbouring steps' streams unrelated."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass
class SamplingBatch:
    """Per-request sampling state for one forward pass; row i belongs to request i.

    Greedy rows (temperature 0 or top_k 1) have temperature 1 here and are taken by argmax.
    `top_ks` holds the vocabulary size where top-k is disabled."""

    vocab_size: int
    temperatures: torch.Tensor  # [bs] float32
    top_ps: torch.Tensor  # [bs] float32
    top_ks: torch.Tensor  # [bs] int64
    min_ps: torch.Tensor  # [bs] float32
    greedy: torch.Tensor  # [bs] bool
    is_all_greedy: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    # [bs] penalties and the dense state they act on; None when no row uses them
    repetition_penalties: torch.Tensor | None = None  # [bs] float32
    seen_mask: torch.Tensor | None = None  # [bs, V] bool: token occurs in prompt or output
    frequency_penalties: torch.Tensor | None = None  # [bs] float32
    presence_penalties: torch.Tensor | None = None  # [bs] float32
    output_counts: torch.Tensor | None = None  # [bs, V] float32: occurrences in the output so far
    logit_bias: torch.Tensor | None = None  # [bs, V] float32
    stop_suppress_mask: torch.Tensor | None = None  # [bs, V] bool: stop tokens banned (min_new_tokens)
    # per-row generator seeds for this step (None: the shared, unseeded stream)
    step_seeds: list[int | None] | None = None
    # logprobs: rows that want them, and how many alternatives each wants
    return_logprob: list[bool] | None = None
    top_logprobs_nums: list[int] | None = None

    @property
    def batch_size(self) -> int:
        return int(self.temperatures.shape[0])

    @property
    def need_logprobs(self) -> bool:
        return self.return_logprob is not None and any(self.return_logprob)

    @property
    def is_plain_greedy(self) -> bool:
        """Every row is the argmax of the raw logits: all greedy, and nothing else reads or changes
        the logits (no logprobs, penalties, logit bias or banned stop tokens)."""
        return (
            self.is_all_greedy
            and not self.need_logprobs
            and self.repetition_penalties is None
            and self.frequency_penalties is None
            and self.logit_bias is None
            and self.stop_suppress_mask is None
        )

    @classmethod
    def from_reqs(cls, reqs: list[Req], vocab_size: int, device: torch.device | str) -> SamplingBatch:
        """Pack the sampling parameters of `reqs` (one row each, same order) for logits of width `vocab_size`."""
        params = [r.sampling_params for r in reqs]
        bs = len(reqs)
        greedy = [p.is_greedy for p in params]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        top_ks = [vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size) for p in params]
        sampled = [p for p, g in zip(params, greedy, strict=True) if not g]

        def on_device(xs: list, dtype: torch.dtype) -> torch.Tensor:
            # built on the host and copied without blocking: torch.tensor(..., device=cuda) would wait
            # for the batch in flight (overlap scheduling)
            return torch.tensor(xs, dtype=dtype).to(device, non_blocking=True)

        def f32(xs: list[float]) -> torch.Tensor:
            return on_device(xs, torch.float32)

        sb = cls(
            vocab_size=vocab_size,
            temperatures=f32(temps),
            top_ps=f32([p.top_p for p in params]),
            top_ks=on_device(top_ks, torch.int64),
            min_ps=f32([p.min_p for p in params]),
            greedy=on_device(greedy, torch.bool),
            is_all_greedy=all(greedy),
            need_top_p=any(p.top_p < 1.0 for p in sampled),
            need_top_k=any(0 < p.top_k < vocab_size for p in sampled),
            need_min_p=any(p.min_p > 0.0 for p in sampled),
        )
        if any(p.repetition_penalty != 1.0 for p in params):
            sb.repetition_penalties = f32([p.repetition_penalty for p in params])
            sb.seen_mask = _token_mask([r.all_ids() for r in reqs], bs, vocab_size, device)
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            sb.frequency_penalties = f32([p.frequency_penalty for p in params])
            sb.presence_penalties = f32([p.presence_penalty for p in params])
            sb.output_counts = _token_counts([r.output_ids for r in reqs], bs, vocab_size, device)
        if any(p.logit_bias for p in params):
            bias = torch.zeros(bs, vocab_size, dtype=torch.float32)
            for i, p in enumerate(params):
                for tok, b in (p.logit_bias or {}).items():
                    if 0 <= tok < vocab_size:
                        bias[i, tok] += b
            sb.logit_bias = bias.to(device, non_blocking=True)
        stop_rows = [_stop_tokens_to_suppress(r) for r in reqs]
        if any(stop_rows):
            sb.stop_suppress_mask = _token_mask(stop_rows, bs, vocab_size, device)
        if any(p.seed is not None for p in sampled):
            sb.step_seeds = [
                None if g or p.seed is None else step_seed(p.seed, len(r.output_ids))
                for r, p, g in zip(reqs, params, greedy, strict=True)
            ]
        want = [p.logprobs or p.top_logprobs > 0 for p in params]
        if any(want):
            sb.return_logprob = want
            sb.top_logprobs_nums = [p.top_logprobs if w else 0 for p, w in zip(params, want, strict=True)]
        return sb


class DraftHistory:
    """A request seen as if some draft tokens were already in its output: what `from_reqs` reads
    (parameters, history, seeds by output length) for the row that scores the token after them.
    Verify batches sample every draft position this way, so penalties, min_new_tokens bans and
    per-step seeds are those of plain decoding at that position."""

    __slots__ = ("sampling_params", "eos_token_ids", "origin_input_ids", "output_ids")

    def __init__(self, req: Req, draft_path: list[int]) -> None:
        self.sampling_params = req.sampling_params
        self.eos_token_ids = req.eos_token_ids
        self.origin_input_ids = req.origin_input_ids
        self.output_ids = req.output_ids + draft_path if draft_path else req.output_ids

    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids


def sampling_reads_history(req: Req) -> bool:
    """True when `from_reqs` reads `req`'s generated tokens (penalties, per-step seeds, stop-token
    suppression before min_new_tokens), so its next row cannot be built before the previous token
    is on the host. Overlap scheduling asks this before launching a decode ahead."""
    p = req.sampling_params
    return (
        p.repetition_penalty != 1.0
        or p.frequency_penalty != 0.0
        or p.presence_penalty != 0.0
        or (p.seed is not None and not p.is_greedy)
        or len(req.output_ids) < p.min_new_tokens
    )


def _stop_tokens_to_suppress(req: Req) -> list[int]:
    """Tokens that would end `req`, while it has fewer than min_new_tokens outputs (else none)."""
    p = req.sampling_params
    if len(req.output_ids) >= p.min_new_tokens or getattr(req, "grammar", None) is not None:
        return []  # a grammar decides when its output may end (banning EOS could leave no token)
    stops = set(p.stop_token_ids)
    if not p.ignore_eos:
        stops |= set(req.eos_token_ids)
    return sorted(stops)


def _flat_index(rows: list[list[int]], vocab_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs of all in-vocabulary tokens. Built with numpy (torch.tensor on long
    Python lists costs ~10x more) and moved to the device in one copy."""
    lens = [len(ids) for ids in rows]
    cols = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=sum(lens))
    flat = np.stack([np.repeat(np.arange(len(rows), dtype=np.int64), lens), cols])
    flat = torch.from_numpy(flat[:, (cols >= 0) & (cols < vocab_size)]).to(device)
    return flat[0], flat[1]


def _token_mask(rows: list[list[int]], bs: int, vocab_size: int, device) -> torch.Tensor:
    """[bs, V] bool: True where the token occurs in the row's list."""
    mask = torch.zeros(bs, vocab_size, dtype=torch.bool, device=device)
    r, c = _flat_index(rows, vocab_size, device)
    mask[r, c] = True
    return mask


def _token_counts(rows: list[list[int]], bs: int, vocab_size: int, device) -> torch.Tensor:
    """[bs, V] float32: occurrences of each token in the row's list."""
    counts = torch.zeros(bs, vocab_size, dtype=torch.float32, device=device)
    r, c = _flat_index(rows, vocab_size, device)
    counts.index_put_((r, c), torch.ones_like(c, dtype=torch.float32), accumulate=True)
    return counts
