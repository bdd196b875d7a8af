"""Conformance kit for schedule policies: `order` returns exactly the waiting requests (no drops,
additions or duplicates), leaves the prefix cache's locks and slots as they were, stores only true
matches on the requests, and gives the same order for the same input; then the scheduler with the
toy model serves every request correctly under the policy."""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable

from radixserve.interfaces.policy import SchedulePolicy
from radixserve.memory import ReqToTokenPool, TokenAllocator
from radixserve.state import Req, SamplingParams
from radixserve.testing._hooks import call_hook
from radixserve.testing._threads import single_threaded


def _default_cache() -> Callable:
    try:
        return importlib.import_module("radixserve_cache_radix.radix_cache").RadixCache
    except ImportError as e:
        raise RuntimeError("check_schedule_policy needs a prefix cache: pass cache=YourCache, or install "
                           "radixserve-cache-radix") from e


def _queue(rng: random.Random, n: int, stems: list[list[int]]) -> list[dict]:
    """Specs of n waiting requests: prompts sharing stems, distinct arrivals, mixed priorities and lengths."""
    arrivals = rng.sample(range(1, 10 * n + 2), n)
    specs = []
    for i in range(n):
        stem = rng.choice(stems)
        prompt = stem[: rng.randint(0, len(stem))] + [rng.randint(0, 9) for _ in range(rng.randint(1, 6))]
        specs.append(dict(rid=f"r{i}", prompt=prompt, arrival=float(arrivals[i]), priority=rng.randint(-1, 2),
                          max_new=rng.randint(1, 64)))
    return specs


def _reqs(specs: list[dict]) -> list[Req]:
    out = []
    for s in specs:
        r = Req(s["rid"], list(s["prompt"]), SamplingParams(max_new_tokens=s["max_new"]), priority=s["priority"],
                arrival_time=s["arrival"])
        r.fill_ids = r.all_ids()  # as the scheduler sets it before ordering
        out.append(r)
    return out


def _check_order(policy_factory, cache_factory, seed: int) -> None:
    rng = random.Random(seed)
    stems = [[rng.randint(0, 9) for _ in range(rng.randint(2, 8))] for _ in range(3)]
    cache = cache_factory(ReqToTokenPool(2, 64), TokenAllocator(256, debug_checks=True))
    for stem in stems:  # some prompts then have cached prefixes of different lengths
        key = stem[: rng.randint(1, len(stem))]
        slots = cache.allocator.alloc(len(key))
        cache.allocator.free(slots[: cache.insert(key, slots)])
    for n in (0, 1, rng.randint(5, 12)):
        specs = _queue(rng, n, stems)
        waiting = _reqs(specs)
        name = type(policy_factory()).__name__
        where = f"{name}.order (seed {seed}, {n} waiting)"
        before = (cache.allocator.available_size(), cache.evictable_size(), cache.protected_size())
        out = call_hook(policy_factory().order, list(waiting), cache, where=f"{where}: order()")
        assert isinstance(out, list), f"{where} returned {type(out).__name__}, not a list"
        ids = [id(r) for r in out]
        assert len(set(ids)) == len(ids), f"{where} returned a request twice: {[r.rid for r in out]}"
        assert set(ids) == {id(r) for r in waiting}, (
            f"{where} must return the waiting requests themselves, each once: got {[r.rid for r in out]} for "
            f"{[r.rid for r in waiting]}")
        after = (cache.allocator.available_size(), cache.evictable_size(), cache.protected_size())
        assert after == before, f"{where} changed the cache (free, evictable, protected) {before} -> {after}"
        for r in out:
            if r.prefix_indices is not None:
                fresh = cache.match_prefix(r.fill_ids).kv_indices.tolist()
                assert r.prefix_indices.tolist() == fresh, (
                    f"{where}: request {r.rid} carries prefix_indices that are not cache.match_prefix(req.fill_ids)")
        again = call_hook(policy_factory().order, _reqs(specs), cache, where=f"{where}: order() called again")
        assert [r.rid for r in again] == [r.rid for r in out], (
            f"{where} is not deterministic: {[r.rid for r in out]} then {[r.rid for r in again]} for the same input")


@single_threaded
def check_schedule_policy(
    policy: Callable[[], SchedulePolicy],
    *,
    cache: Callable | None = None,
    seeds: tuple[int, ...] = (0, 1, 2),
    end_to_end: bool = True,
) -> None:
    """Run a schedule policy against its contract; raise AssertionError naming the first violation.

    :param policy: the class (built with no arguments) or a callable returning a configured
        instance, e.g. `lambda: MyPolicy(seed=3)`; it is called once per check, so a random policy
        must take its seed from there.
    :param cache: the prefix cache (class or callable `(req_to_token_pool, allocator)`) the policy
        is run with; default: the radix cache of radixserve-cache-radix.
    :param seeds: one random waiting queue (of 0, 1 and several requests) per seed.
    :param end_to_end: also serve requests through the scheduler with the toy model.
    """
    cache_factory = cache or _default_cache()
    for seed in seeds:
        _check_order(policy, cache_factory, seed)
    if end_to_end:
        from radixserve.testing.end_to_end import check_scheduler_outputs

        check_scheduler_outputs(cache_factory, policy, seed=seeds[0])
