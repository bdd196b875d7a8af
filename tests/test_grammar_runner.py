"""Structured output through the real ModelRunner (tiny random Llama, CPU): the mask reaches the
logits of constrained rows only, also in batches that mix decode rows, prefill chunks that sample
nothing, greedy and seeded sampling. The grammar is a test backend (any GrammarBackend plugs in)."""

from __future__ import annotations

import pytest
from radixserve.config import Config
from radixserve.interfaces import GrammarBackend, GrammarMatcher
from radixserve.model_runner import ModelRunner
from radixserve.plugins.registry import Registry
from radixserve.runtime.messages import GenerateRequest
from radixserve.scheduler import Scheduler
from radixserve.scheduler.grammar import GrammarService
from radixserve.state import SamplingParams

STOP = 1
LENGTH = 5


class EvenMatcher(GrammarMatcher):
    """Exactly LENGTH even tokens, then the stop token."""

    max_rollback_tokens = 16

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size, self.n, self.done = vocab_size, 0, False

    def fill_bitmask(self, bitmask, row):
        if self.n < LENGTH:
            bitmask[row] = 0x55555555  # bits 0, 2, 4, ...: even token ids
            if self.vocab_size % 32:  # ids past the vocabulary are never allowed
                bitmask[row, -1] &= (1 << (self.vocab_size % 32)) - 1
        else:
            bitmask[row] = 0
            bitmask[row, STOP // 32] = 1 << (STOP % 32)

    def accept_token(self, token_id):
        ok = (token_id % 2 == 0) if self.n < LENGTH else token_id == STOP
        if ok:
            self.n += 1
            self.done = self.n > LENGTH
        return ok

    def rollback(self, num_tokens):
        self.n -= num_tokens
        self.done = self.n > LENGTH

    def is_terminated(self):
        return self.done


class EvenBackend(GrammarBackend):
    supported_kinds = ("regex",)

    def compile(self, kind, text):
        return text

    def new_matcher(self, compiled):
        return EvenMatcher(self.vocab_size)


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    cfg = Config.build({
        "model": {"path": tiny_llama_dir("llama")},
        "runtime": {"device": "cpu", "num_threads": 1},
        "scheduler": {"max_total_tokens": 2048, "max_running_requests": 8},
    })
    return ModelRunner(cfg, show_progress=False)


def serve(runner, requests: dict[str, tuple[list[int], SamplingParams]], chunk: int = 4) -> dict[str, list[int]]:
    config = Config.build({"scheduler": {"chunked_prefill_size": chunk, "max_total_tokens": 2048}})
    reg = Registry.discover()
    cache = reg.load("prefix_cache", "radix")(runner.req_to_token_pool, runner.token_allocator)
    service = GrammarService("even", lambda: EvenBackend(None, runner.vocab_size, [STOP]))
    s = Scheduler(config, runner, cache, reg.load("policy", "fcfs")(), None, grammar=service)
    for rid, (prompt, sp) in requests.items():
        s.add_request(GenerateRequest(rid=rid, input_ids=prompt, sampling_params=sp))
    got: dict[str, list[int]] = {rid: [] for rid in requests}
    for _ in range(2000):
        if not s.has_work():
            break
        for out in s.step():
            assert out.error is None, out.error
            got[out.rid].extend(out.new_ids)
    assert not s.has_work() and s.flush_cache()
    return got


def test_mask_applies_to_constrained_rows_only(runner):
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    prompts = {"a": [5, 9, 13, 2, 7, 7, 3, 11, 4], "b": [6, 6, 2, 9]}
    alone = serve(runner, {rid: (p, greedy) for rid, p in prompts.items()})
    constrained = SamplingParams(max_new_tokens=12, temperature=0, regex="even")
    seeded = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7, regex="even")
    mixed = serve(runner, {
        "a": (prompts["a"], greedy),
        "c": ([3, 3, 3, 8, 1, 5, 5, 2, 9, 9, 4], constrained),  # prefilled over three 4-token chunks
        "b": (prompts["b"], greedy),
        "s": ([7, 2, 2], seeded),
    })
    assert mixed["a"] == alone["a"] and mixed["b"] == alone["b"]  # unconstrained rows: unchanged
    for rid in ("c", "s"):
        out = mixed[rid]
        assert len(out) == LENGTH + 1 and out[-1] == STOP and all(t % 2 == 0 for t in out[:-1]), (rid, out)
