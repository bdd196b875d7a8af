"""The scheduler with the toy model (`radixserve.testing.toy_runner`) over a given prefix cache
and policy: every greedy output must equal the toy reference, and no KV slot or request row may be
left over once the cache is flushed. Shared by the prefix-cache and policy kits."""

from __future__ import annotations

import random
from collections.abc import Callable

from radixserve.interfaces.policy import SchedulePolicy
from radixserve.interfaces.prefix_cache import PrefixCache
from radixserve.state import Req


class ArrivalOrder(SchedulePolicy):
    """First come, first served: the policy the prefix-cache kit runs the scheduler with."""

    def order(self, waiting: list[Req], cache: PrefixCache) -> list[Req]:
        return sorted(waiting, key=lambda r: r.arrival_time)


def run_to_completion(sched, reqs: list, max_steps: int = 100_000) -> dict[str, list[int]]:
    """Add `reqs` (GenerateRequest) to the scheduler `sched`, step it until it has no work, and
    return each request's output ids by rid. Raises AssertionError when a request fails, when the
    scheduler does not finish in `max_steps`, or when a KV slot is still held once the cache is
    flushed (a leak). Added in plugin API 1.2."""
    for r in reqs:
        sched.add_request(r)
    res: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_work():
            break
        for out in sched.step():
            assert not getattr(out, "error", None), f"request {out.rid} failed: {out.error}"
            res.setdefault(out.rid, []).extend(out.new_ids)
    assert not sched.has_work(), f"the scheduler still has work after {max_steps} steps"
    refusal = sched.flush_refusal()
    assert refusal is None, f"flush_cache() refused with every request finished: {refusal}"
    assert sched.allocator.available_size() == sched.allocator.size, "KV slots leaked"
    return res


def check_scheduler_outputs(
    cache_factory: Callable, policy_factory: Callable[[], SchedulePolicy], seed: int = 0, num_requests: int = 12
) -> None:
    """Serve `num_requests` greedy requests (half sharing prompt prefixes, random priorities) with a
    pool of 200 KV slots and 16-token prefill chunks, so the cache evicts, the scheduler chunks and
    may retract; raise AssertionError naming the first request whose output differs."""
    from radixserve.config import Config
    from radixserve.runtime.messages import GenerateRequest
    from radixserve.scheduler import Scheduler
    from radixserve.state import SamplingParams
    from radixserve.testing.toy_runner import ToyRunner, toy_reference

    vocab = 500
    runner = ToyRunner(vocab_size=vocab, max_total_tokens=200)
    config = Config.build({"scheduler": {"chunked_prefill_size": 16}})
    cache = cache_factory(runner.req_to_token_pool, runner.token_allocator)
    policy = policy_factory()
    sched = Scheduler(config, runner, cache, policy)
    names = f"{type(cache).__name__} + {type(policy).__name__} (seed {seed})"
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(30)]
    expected: dict[str, list[int]] = {}
    for i in range(num_requests):
        prompt = ([] if i % 2 else shared[: rng.randint(5, 30)]) + [rng.randrange(vocab) for _ in range(rng.randint(2, 40))]
        max_new = rng.randint(1, 30)
        expected[f"r{i}"] = toy_reference(prompt, max_new, vocab)
        params = SamplingParams(max_new_tokens=max_new, temperature=0)
        sched.add_request(GenerateRequest(rid=f"r{i}", input_ids=prompt, sampling_params=params, priority=i % 3))
    got: dict[str, list[int]] = {}
    for _ in range(10_000):
        if not sched.has_work():
            break
        for out in sched.step():
            assert not getattr(out, "error", None), f"{names}: request {out.rid} failed: {out.error}"
            got.setdefault(out.rid, []).extend(out.new_ids)
    assert not sched.has_work(), f"{names}: the scheduler still has work after 10,000 steps"
    for rid, want in expected.items():
        assert got.get(rid) == want, f"{names}: request {rid} produced {got.get(rid)}, the toy model gives {want}"
    refusal = sched.flush_refusal()
    assert refusal is None, f"{names}: flush_cache() refused with every request finished: {refusal}"
    free, total = runner.token_allocator.available_size(), runner.token_allocator.size
    assert free == total, f"{names}: {total - free} KV slots leaked after every request finished and a flush"
    rows = runner.req_to_token_pool
    assert rows.available_size() == rows.size, f"{names}: {rows.size - rows.available_size()} request rows leaked"
