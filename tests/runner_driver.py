"""A minimal scheduler stand-in for model tests: drive a ModelRunner through prefill + decode.

It allocates KV slots and ReqToTokenPool rows exactly as the scheduler contract says (slots written
into the row before the forward), ignores EOS, and frees everything at the end."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from radixserve.state import ForwardMode, Req, SamplingParams, ScheduledBatch


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # fp32 [vocab] per generated token


def _batch(mode, reqs, input_ids, rows, prefix_lens, extend_lens, slots) -> ScheduledBatch:
    return ScheduledBatch(mode=mode, reqs=reqs, input_ids=input_ids, req_pool_indices=rows,
                          prefix_lens=prefix_lens, extend_lens=extend_lens, out_cache_loc=slots)


def greedy_generate(runner, prompts: list[list[int]], max_new_tokens: int, keep_logits: bool = False,
                    prefill_chunk: int | None = None) -> list[Generation]:
    """Greedy-decode every prompt together: one EXTEND batch (or several chunks of at most
    `prefill_chunk` tokens per request), then DECODE steps. Returns per-request tokens (+ logits)."""
    pool, alloc = runner.req_to_token_pool, runner.token_allocator
    reqs = [Req(rid=str(i), origin_input_ids=list(p), sampling_params=SamplingParams(temperature=0.0))
            for i, p in enumerate(prompts)]
    rows = [pool.alloc() for _ in prompts]
    assert None not in rows, "ReqToTokenPool too small for the test batch"
    owned: list[torch.Tensor] = []
    gens = [Generation() for _ in prompts]
    kv_lens = [0] * len(prompts)

    def step(mode, pieces: list[list[int]]) -> torch.Tensor:
        slots = alloc.alloc(sum(len(p) for p in pieces))
        assert slots is not None, "KV pool too small for the test batch"
        owned.append(slots)
        offset = 0
        for i, piece in enumerate(pieces):
            pool.write(rows[i], kv_lens[i], slots[offset : offset + len(piece)])
            offset += len(piece)
        sb = _batch(mode, reqs, [t for p in pieces for t in p], rows, list(kv_lens), [len(p) for p in pieces], slots)
        logits = runner.forward_logits(sb)
        for i, piece in enumerate(pieces):
            kv_lens[i] += len(piece)
        return logits

    chunk = prefill_chunk or max(len(p) for p in prompts)
    logits = None
    while any(kv_lens[i] < len(p) for i, p in enumerate(prompts)):
        # every request still in prefill contributes its next chunk; finished ones are not in this batch
        active = [i for i, p in enumerate(prompts) if kv_lens[i] < len(p)]
        assert len(active) == len(prompts), "test prompts must be chunked in lockstep; use equal chunk counts"
        logits = step(ForwardMode.EXTEND, [prompts[i][kv_lens[i] : kv_lens[i] + chunk] for i in active])
    for _ in range(max_new_tokens):
        next_ids = logits.argmax(dim=-1).tolist()
        for g, t, row in zip(gens, next_ids, logits, strict=True):
            g.tokens.append(int(t))
            if keep_logits:
                g.logits.append(row.clone())
        if len(gens[0].tokens) == max_new_tokens:
            break
        logits = step(ForwardMode.DECODE, [[t] for t in next_ids])
    for row in rows:
        pool.free(row)
    for slots in owned:
        alloc.free(slots)
    assert alloc.available_size() == alloc.size, "KV slots leaked"
    return gens
