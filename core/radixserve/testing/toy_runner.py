"""A toy ModelRunner for scheduler tests: same API as `radixserve.model_runner.ModelRunner`,
a deterministic "model" whose next token is a hash of every previous token.

Why it catches KV bugs: the toy reads each request's history *through its KV slots* (the token id and
position stored at each slot when it was written), never from the request object. A slot that is
reused while still referenced, a row pointing at the wrong slot, or a skipped chunk changes the
output, so comparing with `toy_reference` checks the scheduler's memory bookkeeping end to end.
"""

from __future__ import annotations

import dataclasses

import torch

from radixserve.memory import ReqToTokenPool, TokenAllocator
from radixserve.state import BatchResult, LaunchedBatch, ScheduledBatch

_WEIGHTS = torch.randint(1, 1 << 20, (1 << 14,), generator=torch.Generator().manual_seed(1234), dtype=torch.int64)


def toy_next_token(ids: list[int] | torch.Tensor, vocab_size: int) -> int:
    t = torch.as_tensor(ids, dtype=torch.int64)
    n = int(t.numel())
    return int(((t * _WEIGHTS[:n]).sum() + 7919 * n) % vocab_size)


def toy_prompt_logprob(history: list[int] | torch.Tensor, target: int, vocab_size: int) -> float:
    """The toy's logprob of `target` after `history` (prompt logprobs): 0 for the toy's own next
    token, lower the further `target` is from it (mod the vocabulary)."""
    return -(toy_prompt_rank(history, target, vocab_size) - 1) / vocab_size


def toy_prompt_rank(history: list[int] | torch.Tensor, target: int, vocab_size: int) -> int:
    """`target`'s rank after `history`: 1 for the toy's own next token, then by distance from it."""
    return (target - toy_next_token(history, vocab_size)) % vocab_size + 1


def toy_prompt_logprobs(prompt: list[int], vocab_size: int) -> list[float]:
    """What a correct scheduler reports as `prompt` token i+1's logprob, for each position i."""
    return [toy_prompt_logprob(prompt[: i + 1], prompt[i + 1], vocab_size) for i in range(len(prompt) - 1)]


def toy_prompt_ranks(prompt: list[int], vocab_size: int) -> list[int]:
    """What a correct scheduler reports as `prompt` token i+1's rank, for each position i."""
    return [toy_prompt_rank(prompt[: i + 1], prompt[i + 1], vocab_size) for i in range(len(prompt) - 1)]


def toy_reference(
    prompt: list[int], max_new_tokens: int, vocab_size: int, eos: frozenset[int] = frozenset()
) -> list[int]:
    """The greedy output a correct scheduler must produce for `prompt` with the toy model."""
    ids, out = list(prompt), []
    while len(out) < max_new_tokens:
        tok = toy_next_token(ids, vocab_size)
        out.append(tok)
        ids.append(tok)
        if tok in eos:
            break
    return out


def _first_allowed_from(bitmask_row: torch.Tensor, tok: int, vocab_size: int) -> int:
    """Structured output on the toy: its token if the bitmask allows it, else the next allowed id."""
    words = bitmask_row.tolist()
    for k in range(vocab_size):
        t = (tok + k) % vocab_size
        if (words[t // 32] >> (t % 32)) & 1:
            return t
    return tok  # nothing allowed: the grammar will refuse it


class ToyRunner:
    """Fake ModelRunner: real ReqToTokenPool/TokenAllocator, a fake KV pool of (token, position)."""

    def __init__(
        self,
        max_total_tokens: int = 4096,
        context_len: int = 1024,
        vocab_size: int = 1000,
        max_running_requests: int = 64,
        eos_token_ids: tuple[int, ...] = (),
        supports_tree_mask: bool = True,
    ) -> None:
        self.max_total_tokens = max_total_tokens
        self.context_len = context_len
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device = torch.device("cpu")
        self.tokenizer = None
        self.req_to_token_pool = ReqToTokenPool(max_running_requests, context_len)
        self.token_allocator = TokenAllocator(max_total_tokens, debug_checks=True)
        self.kv_pool = torch.full((max_total_tokens + 1, 2), -1, dtype=torch.int64)  # (token, position)
        self.forward_tokens = 0  # tokens that went through a forward (prefill + decode)
        self.batches: list[ScheduledBatch] = []
        self.events: list[tuple[str, int]] = []  # ("launch" | "result", batch number)
        self.supports_tree_mask = supports_tree_mask  # verify batches may carry tree drafts

    def run_batch(self, sb: ScheduledBatch) -> BatchResult:
        return self.launch_batch(sb).result()

    def launch_batch(self, sb: ScheduledBatch) -> LaunchedBatch:
        """Computes at once, like a device executing batches in launch order; `events` records the
        order of launches and of result() calls, so tests can check what overlapped."""
        n = len(self.batches)
        self.events.append(("launch", n))
        self.batches.append(sb)  # as scheduled (with its future inputs)
        if sb.future_inputs is not None:
            f = sb.future_inputs
            assert not sb.input_ids and len(f.rows) == len(sb.reqs), "future batch carries host input ids"
            sb = dataclasses.replace(sb, input_ids=f.tokens[f.rows].tolist(), future_inputs=None)
        if sb.token_bitmask_ready is not None:
            sb.token_bitmask_ready()
        if sb.token_bitmask is not None:  # the scheduler reuses the buffer: keep the mask this batch used
            self.batches[n] = dataclasses.replace(self.batches[n], token_bitmask=sb.token_bitmask.clone())
        result = self._compute(sb)
        tokens = torch.tensor([t if t is not None else -1 for t in result.next_token_ids], dtype=torch.int64)

        def resolve() -> BatchResult:
            self.events.append(("result", n))
            return result

        return LaunchedBatch(tokens, resolve)

    def _compute(self, sb: ScheduledBatch) -> BatchResult:
        assert len(sb.input_ids) == sum(sb.extend_lens) == int(sb.out_cache_loc.numel())
        assert len(sb.reqs) == len(sb.req_pool_indices) == len(sb.prefix_lens) == len(sb.sample_mask)
        self.forward_tokens += len(sb.input_ids)
        table = self.req_to_token_pool.req_to_token
        loc = sb.out_cache_loc.to(torch.int64)
        if sb.spec is not None:
            assert sb.spec.has_tree is False or self.supports_tree_mask, "tree draft sent to a chain-only runner"
            return self._compute_verify(sb)
        positions = torch.cat(
            [torch.arange(p, p + e, dtype=torch.int64) for p, e in zip(sb.prefix_lens, sb.extend_lens)]
        )
        self.kv_pool[loc, 0] = torch.tensor(sb.input_ids, dtype=torch.int64)
        self.kv_pool[loc, 1] = positions
        out: list[int | None] = []
        logprobs: list[float | None] = []
        tops: list[list[tuple[int, float]] | None] = []
        start = 0
        for i, row in enumerate(sb.req_pool_indices):
            p, e = sb.prefix_lens[i], sb.extend_lens[i]
            assert torch.equal(table[row, p : p + e], loc[start : start + e]), "row does not hold out_cache_loc"
            start += e
            if not sb.sample_mask[i]:
                out.append(None)
                logprobs.append(None)
                tops.append(None)
                continue
            kv = self.kv_pool[table[row, : p + e]]
            assert torch.equal(kv[:, 1], torch.arange(p + e)), "KV slot holds another position (stale slot)"
            tok = toy_next_token(kv[:, 0], self.vocab_size)
            if sb.token_bitmask is not None:
                tok = _first_allowed_from(sb.token_bitmask[i], tok, self.vocab_size)
            out.append(tok)
            logprobs.append(-0.1 * (tok % 7))
            tops.append([(tok, -0.1 * (tok % 7)), ((tok + 1) % self.vocab_size, -5.0)])
        result = BatchResult(next_token_ids=out, token_logprobs=logprobs, top_logprobs=tops)
        if sb.prompt_logprob_rows is not None:
            self._score_prompt(sb, result)
        return result

    def _score_prompt(self, sb: ScheduledBatch, result: BatchResult) -> None:
        """Prompt logprobs of the scored rows, each reading its history through its request's KV
        slots (`toy_prompt_logprob`); alternatives: the toy's own next token at logprob 0."""
        table = self.req_to_token_pool.req_to_token
        starts = torch.tensor([0, *sb.extend_lens]).cumsum(0).tolist()
        scored = sb.prompt_logprob_rows
        result.prompt_token_logprobs, result.prompt_token_ranks, result.prompt_top_logprobs = [], [], []
        for r, target in zip(scored.rows, scored.targets, strict=True):
            i = max(k for k in range(len(sb.extend_lens)) if starts[k] <= r)  # the request of packed row r
            position = sb.prefix_lens[i] + r - starts[i]
            history = self.kv_pool[table[sb.req_pool_indices[i], : position + 1], 0]
            result.prompt_token_logprobs.append(toy_prompt_logprob(history, target, self.vocab_size))
            result.prompt_token_ranks.append(toy_prompt_rank(history, target, self.vocab_size))
            result.prompt_top_logprobs.append([(toy_next_token(history, self.vocab_size), 0.0)][: scored.top])

    def _compute_verify(self, sb: ScheduledBatch) -> BatchResult:
        """A verify batch: the toy token after every new token, reading its history through the
        prefix's KV slots and the slots of its ancestors in the draft tree."""
        table = self.req_to_token_pool.req_to_token
        loc = sb.out_cache_loc.to(torch.int64)
        spec_ids: list[list[int]] = []
        start = 0
        for i, row in enumerate(sb.req_pool_indices):
            p, e, parents = sb.prefix_lens[i], sb.extend_lens[i], sb.spec.parents[i]
            assert len(parents) == e and parents[0] == -1
            slots = loc[start : start + e]
            assert torch.equal(table[row, p : p + e], slots), "row does not hold out_cache_loc"
            depth = [0] * e
            for j in range(1, e):
                assert 0 <= parents[j] < j
                depth[j] = depth[parents[j]] + 1
            self.kv_pool[slots, 0] = torch.tensor(sb.input_ids[start : start + e], dtype=torch.int64)
            self.kv_pool[slots, 1] = torch.tensor([p + d for d in depth], dtype=torch.int64)
            start += e
            prefix = self.kv_pool[table[row, :p]]
            assert torch.equal(prefix[:, 1], torch.arange(p)), "KV slot holds another position (stale slot)"
            out = []
            for j in range(e):
                path, node = [], j
                while node >= 0:
                    path.append(int(slots[node]))
                    node = parents[node]
                hist = torch.cat([prefix[:, 0], self.kv_pool[torch.tensor(path[::-1]), 0]])
                out.append(toy_next_token(hist, self.vocab_size))
            spec_ids.append(out)
        logprobs = [[-0.1 * (t % 7) for t in ids] for ids in spec_ids]
        tops = [[[(t, -0.1 * (t % 7)), ((t + 1) % self.vocab_size, -5.0)] for t in ids] for ids in spec_ids]
        return BatchResult(
            next_token_ids=[None] * len(sb.reqs), spec_token_ids=spec_ids, spec_logprobs=logprobs, spec_top_logprobs=tops
        )
