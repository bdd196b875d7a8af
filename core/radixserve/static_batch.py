"""Drive a ModelRunner outside the scheduler: prefill a fixed set of prompts, then decode them together.

The one loop every caller without a scheduler uses: `radixserve generate` (streams one request),
the runner's warm-up, `bench one-batch` (timings) and the model tests (logits). No prefix cache, no
admission: KV slots and rows are taken from the runner's pools as the scheduler contract says
(slots written into the request's row before the forward) and all given back at the end.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from radixserve.state import ForwardMode, Req, SamplingParams, ScheduledBatch


@dataclass
class StaticBatchResult:
    output_ids: list[list[int]]  # per prompt: its new tokens (a finished one stops growing)
    prefill_s: float = 0.0  # wall time of the prefill forward(s)
    decode_step_s: list[float] = field(default_factory=list)  # wall time of each decode forward
    used_cuda_graph: bool = False  # whether the last decode ran as a CUDA graph
    # with keep_logits: per prompt, the fp32 [vocab] logits each token was taken from
    logits: list[list[torch.Tensor]] = field(default_factory=list)


class StaticBatch:
    """One static batch. `steps()` yields, after every forward that samples, each prompt's new token
    (None once that prompt finished); `result` holds the ids and timings so far.

    A prompt finishes at `max_new_tokens`, or on an EOS / stop token id once it has `min_new_tokens`
    (unless `sampling.ignore_eos`). `keep_logits` takes greedy tokens from `forward_logits` and keeps
    the logits (sampling must be greedy). `prefill_chunk` prefills in chunks of at most that many
    tokens per prompt; every prompt must need the same number of chunks."""

    def __init__(
        self,
        runner,
        prompts: list[list[int]],
        sampling: SamplingParams | None = None,
        max_new_tokens: int | None = None,
        *,
        keep_logits: bool = False,
        prefill_chunk: int | None = None,
    ) -> None:
        if not prompts or any(not p for p in prompts):
            raise ValueError("a static batch needs at least one prompt and no empty prompt")
        params = sampling or SamplingParams(temperature=0.0, ignore_eos=True)
        self.max_new_tokens = params.max_new_tokens if max_new_tokens is None else max_new_tokens
        self.params = params
        self.runner = runner
        self.prompts = [list(p) for p in prompts]
        if keep_logits and not params.is_greedy:
            raise ValueError("keep_logits takes greedy tokens from the logits; use temperature 0")
        self.keep_logits = keep_logits
        self.chunk = prefill_chunk or max(len(p) for p in self.prompts)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(runner.eos_token_ids))
        self.stop_ids = frozenset(stops)
        self.result = StaticBatchResult(output_ids=[[] for _ in prompts], logits=[[] for _ in prompts])

    def _sync(self) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)

    def _forward(self, mode: ForwardMode, reqs: list[Req], pieces: list[list[int]], sample: list[bool]) -> list:
        r = self.runner
        slots = r.token_allocator.alloc(sum(len(p) for p in pieces))
        if slots is None:
            raise RuntimeError("the static batch does not fit the KV pool; raise scheduler.max_total_tokens")
        self._owned.append(slots)
        offset = 0
        for req, piece in zip(reqs, pieces, strict=True):
            r.req_to_token_pool.write(req.req_pool_idx, req.kv_len, slots[offset : offset + len(piece)])
            offset += len(piece)
        sb = ScheduledBatch(
            mode=mode,
            reqs=reqs,
            input_ids=[t for p in pieces for t in p],
            req_pool_indices=[req.req_pool_idx for req in reqs],
            prefix_lens=[req.kv_len for req in reqs],
            extend_lens=[len(p) for p in pieces],
            out_cache_loc=slots,
            sample_mask=sample,
        )
        if self.keep_logits:
            logits = r.forward_logits(sb)
            tokens = [int(t) if s else None for t, s in zip(logits.argmax(dim=-1).tolist(), sample, strict=True)]
            for req, row, s in zip(reqs, logits, sample, strict=True):
                if s:
                    self.result.logits[int(req.rid)].append(row.clone())
        else:
            tokens = r.run_batch(sb).next_token_ids
        for req, piece in zip(reqs, pieces, strict=True):
            req.kv_len += len(piece)
        return tokens

    def steps(self) -> Iterator[list[int | None]]:
        r, res = self.runner, self.result
        reqs = [
            Req(rid=str(i), origin_input_ids=p, sampling_params=self.params, eos_token_ids=self.stop_ids)
            for i, p in enumerate(self.prompts)
        ]
        self._owned: list[torch.Tensor] = []
        try:
            for req in reqs:
                req.req_pool_idx = r.req_to_token_pool.alloc()
                if req.req_pool_idx is None:
                    raise RuntimeError("the static batch has more prompts than the runner has request rows")
            if self.max_new_tokens <= 0:
                return
            self._sync()
            t0 = time.perf_counter()
            tokens: list = []
            while any(req.kv_len < len(req.origin_input_ids) for req in reqs):
                ends = [min(req.kv_len + self.chunk, len(req.origin_input_ids)) for req in reqs]
                if any(req.kv_len >= len(req.origin_input_ids) for req in reqs):
                    raise ValueError("prefill_chunk: every prompt must need the same number of chunks")
                sample = [e == len(req.origin_input_ids) for e, req in zip(ends, reqs, strict=True)]
                pieces = [req.origin_input_ids[req.kv_len : e] for req, e in zip(reqs, ends, strict=True)]
                tokens = self._forward(ForwardMode.EXTEND, reqs, pieces, sample)
            self._sync()
            res.prefill_s = time.perf_counter() - t0
            live = reqs
            while True:
                for req, tok in zip(live, tokens, strict=True):
                    req.output_ids.append(int(tok))
                    n = len(req.output_ids)
                    if n >= self.max_new_tokens or (tok in self.stop_ids and n >= self.params.min_new_tokens):
                        req.finished_reason = {"type": "length" if tok not in self.stop_ids else "stop"}
                for i, req in enumerate(reqs):
                    res.output_ids[i] = req.output_ids
                yield [tokens[live.index(req)] if req in live else None for req in reqs]
                live = [req for req in live if not req.finished]
                if not live:
                    return
                self._sync()
                t0 = time.perf_counter()
                tokens = self._forward(ForwardMode.DECODE, live, [[req.output_ids[-1]] for req in live], [True] * len(live))
                self._sync()
                res.decode_step_s.append(time.perf_counter() - t0)
                res.used_cuda_graph = bool(getattr(r, "last_run_used_cuda_graph", False))
        finally:
            for slots in self._owned:
                r.token_allocator.free(slots)
            for req in reqs:
                if req.req_pool_idx is not None:
                    r.req_to_token_pool.free(req.req_pool_idx)


def run_static_batch(
    runner,
    prompts: list[list[int]],
    sampling: SamplingParams | None = None,
    max_new_tokens: int | None = None,
    *,
    keep_logits: bool = False,
    prefill_chunk: int | None = None,
) -> StaticBatchResult:
    """Run `prompts` to the end as one static batch (see StaticBatch); returns ids and timings.
    Default sampling: greedy, EOS ignored; `max_new_tokens` overrides the sampling params'."""
    batch = StaticBatch(runner, prompts, sampling, max_new_tokens, keep_logits=keep_logits, prefill_chunk=prefill_chunk)
    for _ in batch.steps():
        pass
    return batch.result
