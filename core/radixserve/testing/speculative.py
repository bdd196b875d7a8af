"""Test helpers for drafters built on `PooledDrafter` (radixserve.scheduler.speculative.draft_state):
the scheduler set-up, requests and prompts, and the checks both the EAGLE and MTP plugins' tests
run. Import from `radixserve.testing.speculative`.

Added in plugin API 1.4."""

from __future__ import annotations

import random
from collections.abc import Callable

from radixserve.config import Config
from radixserve.interfaces.drafter import DraftProposal
from radixserve.runtime.messages import GenerateRequest
from radixserve.state import SamplingParams


class RecordingDrafter:
    """Mix in before a `PooledDrafter` subclass (`class R(RecordingDrafter, MyDrafter): pass`):
    keeps every proposal as `(num_requests, num_draft_tokens, proposal)` in `proposals`, and per
    finished request the draft rows it had run or pending in `rows_run`.

    Added in plugin API 1.4."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.proposals: list = []
        self.rows_run: dict[str, int] = {}

    def on_finished(self, req) -> None:
        st = self.states.get(req.rid)
        if st is not None:
            self.rows_run[req.rid] = len(st.slots) + len(st.pending_pos)
        super().on_finished(req)

    def propose(self, reqs, k):
        p = super().propose(reqs, k)
        self.proposals.append((len(reqs), k, p))
        return p


def target_runner(path: str, *, max_total_tokens: int = 6000, max_running_requests: int = 64, impl: str = "auto"):
    """A target `ModelRunner` for drafter tests: `path` in fp32 on the CPU (one thread) with
    torch_native attention, which verifies trees and serves latent models too. `impl`: model.impl.

    Added in plugin API 1.12."""
    from radixserve.model_runner import ModelRunner

    return ModelRunner(Config.build({
        "model": {"path": path, "impl": impl},
        "stack": {"attention": "torch_native"},
        "runtime": {"device": "cpu", "dtype": "float32", "num_threads": 1},
        "scheduler": {"max_total_tokens": max_total_tokens, "max_running_requests": max_running_requests},
    }), show_progress=False)


def speculative_scheduler(runner, cfg: Config | None, make_drafter: Callable):
    """A Scheduler over `runner` with the radix cache and FCFS; the drafter is
    `make_drafter(info, cfg)` (info from `drafter_info`) when `cfg.stack.speculative` is set, else
    none. `cfg` None: no speculation, 6000 tokens.

    Added in plugin API 1.4."""
    from radixserve.plugins.registry import Registry
    from radixserve.scheduler import Scheduler
    from radixserve.scheduler.speculative.setup import drafter_info

    reg = Registry.discover()
    cfg = cfg or Config.build({"stack": {"prefix_cache": "radix"}, "scheduler": {"max_total_tokens": 6000}})
    drafter = make_drafter(drafter_info(cfg, runner), cfg) if cfg.stack.speculative else None
    cache = reg.load("prefix_cache", "radix")(runner.req_to_token_pool, runner.token_allocator)
    return Scheduler(cfg, runner, cache, reg.load("policy", "fcfs")(), drafter=drafter)


def greedy_request(rid: str, prompt: list[int], n: int) -> GenerateRequest:
    """A greedy request for exactly `n` new tokens (EOS ignored). Added in plugin API 1.4."""
    return GenerateRequest(rid=rid, input_ids=prompt,
                           sampling_params=SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))


def shared_prefix_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`n` random prompts of ids below `vocab`; every second one starts with the same 12 tokens
    (the radix cache serves that prefix to the later ones). Added in plugin API 1.4."""
    rng = random.Random(seed)
    base = [rng.randrange(vocab) for _ in range(12)]
    return [(base if i % 2 else []) + [rng.randrange(vocab) for _ in range(rng.randint(3, 15))] for i in range(n)]


def assert_drafter_released(drafter) -> None:
    """A `PooledDrafter` after its requests finished: no state, every pool slot free, nothing left
    in the target-states capture. Added in plugin API 1.4."""
    assert drafter.states == {}
    assert drafter.pool.free_slots() == drafter.pool.capacity
    assert drafter.target._rows == {}


def trees_with_wrong_siblings(chains: list[list[int]], num_draft_tokens: int, vocab: int,
                              shift: int = 1) -> DraftProposal:
    """Tree drafts from chains: before each chain node a wrong sibling (`(token + shift) % vocab`)
    under the same parent, the chain continuing below the right one; at most `num_draft_tokens`
    nodes per request (whole pairs). Exercises tree verify where only the second child is accepted.

    Added in plugin API 1.4."""
    tokens, parents = [], []
    for chain in chains:
        t, p, prev = [], [], -1
        for tok in chain:
            if len(t) + 2 > num_draft_tokens:
                break
            t += [(tok + shift) % vocab, tok]
            p += [prev, prev]
            prev = len(t) - 1
        tokens.append(t)
        parents.append(p)
    return DraftProposal(tokens, parents)
