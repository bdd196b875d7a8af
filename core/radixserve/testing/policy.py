"""Conformance kit for schedule policies: `order` returns exactly the waiting requests (no drops,
additions or duplicates), leaves the prefix cache's locks and slots as they were, stores only true
matches on the requests, and gives the same order for the same input; then the scheduler with the
toy model serves every request correctly under the policy.

The waiting requests carry `arrival_time`s as the scheduler gives them (plugin API 1.15):
`time.monotonic()` seconds, a few seconds old at most, so an aging or deadline rule is exercised
on both sides of its threshold (`waits=`, `clock=`)."""

from __future__ import annotations

import importlib
import random
import time
from collections.abc import Callable

from radixserve.interfaces.policy import SchedulePolicy
from radixserve.memory import ReqToTokenPool, TokenAllocator
from radixserve.plugins.registry import class_problem
from radixserve.state import Req, SamplingParams
from radixserve.testing._hooks import call_hook
from radixserve.testing._threads import single_threaded


def _default_cache() -> Callable:
    try:
        return importlib.import_module("radixserve_cache_radix.radix_cache").RadixCache
    except ImportError as e:
        raise RuntimeError("check_schedule_policy needs a prefix cache: pass cache=YourCache, or install "
                           "radixserve-cache-radix") from e


def _queue(rng: random.Random, n: int, stems: list[list[int]], now: float, waits: tuple[float, float]) -> list[dict]:
    """Specs of n waiting requests: prompts sharing stems, mixed priorities and lengths, and distinct
    arrivals `now - wait` (monotonic seconds, waits spread over `waits`), not in rid order."""
    ages = sorted(rng.uniform(*waits) for _ in range(n))
    for j in range(1, n):  # distinct, as the scheduler's stamps are (strictly increasing)
        ages[j] = max(ages[j], ages[j - 1] + 1e-6)
    rng.shuffle(ages)  # arrival order is not rid order
    specs = []
    for i in range(n):
        stem = rng.choice(stems)
        prompt = stem[: rng.randint(0, len(stem))] + [rng.randint(0, 9) for _ in range(rng.randint(1, 6))]
        specs.append(dict(rid=f"r{i}", prompt=prompt, arrival=now - ages[i], priority=rng.randint(-1, 2),
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


def _check_order(policy_factory, cache_factory, seed: int, clock: Callable[[], float],
                 waits: tuple[float, float]) -> None:
    rng = random.Random(seed)
    stems = [[rng.randint(0, 9) for _ in range(rng.randint(2, 8))] for _ in range(3)]
    cache = cache_factory(ReqToTokenPool(2, 64), TokenAllocator(256, debug_checks=True))
    for stem in stems:  # some prompts then have cached prefixes of different lengths
        key = stem[: rng.randint(1, len(stem))]
        slots = cache.allocator.alloc(len(key))
        cache.allocator.free(slots[: cache.insert(key, slots)])
    for n in (0, 1, rng.randint(5, 12)):
        specs = _queue(rng, n, stems, float(clock()), waits)
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


def _checked_factory(policy: Callable[[], SchedulePolicy]) -> Callable[[], SchedulePolicy]:
    """`policy` as the kit calls it: a class checked first as the core checks the class a stack selects
    (`radixserve.plugins.registry.class_problem`: a SchedulePolicy subclass implementing order());
    building it and what it builds checked at each call, every failure an AssertionError."""
    label = f"{policy.__module__}.{policy.__qualname__}" if isinstance(policy, type) else repr(policy)
    if isinstance(policy, type):
        problem = class_problem("policy", policy)
        if problem is not None:
            raise AssertionError(f"{label} {problem} (the core refuses it when a stack selects it)")

    def build() -> SchedulePolicy:
        built = call_hook(policy, where=f"building the policy ({label}{'()' if isinstance(policy, type) else ''})")
        if not isinstance(built, SchedulePolicy):
            raise AssertionError(f"{label} built {type(built).__name__}, not a "
                                 "radixserve.interfaces.SchedulePolicy (the core refuses that class)")
        return built

    return build


@single_threaded
def check_schedule_policy(
    policy: Callable[[], SchedulePolicy],
    *,
    cache: Callable | None = None,
    seeds: tuple[int, ...] = (0, 1, 2),
    end_to_end: bool = True,
    waits: tuple[float, float] = (0.0, 5.0),
    clock: Callable[[], float] | None = None,
) -> None:
    """Run a schedule policy against its contract; raise AssertionError naming the first violation.

    :param policy: the class (built with no arguments) or a callable returning a configured
        instance, e.g. `lambda: MyPolicy(seed=3)`; it is called once per check, so a random policy
        must take its seed from there. A class is first checked as the core checks the class a
        stack selects (a `SchedulePolicy` subclass that implements `order`), and an exception from
        building it is an AssertionError naming it.
    :param cache: the prefix cache (class or callable `(req_to_token_pool, allocator)`) the policy
        is run with; default: the radix cache of radixserve-cache-radix.
    :param seeds: one random waiting queue (of 0, 1 and several requests) per seed.
    :param end_to_end: also serve requests through the scheduler with the toy model.
    :param waits: (shortest, longest) wait in seconds: each request of a queue arrived a random,
        distinct number of seconds in that range before the queue is ordered (`arrival_time =
        clock() - wait`, as the scheduler's `time.monotonic()` stamps). An aging or deadline rule
        should see its threshold inside the range, e.g. `waits=(0, 2 * max_wait_s)`. Plugin API 1.19.
    :param clock: what "now" is for those arrival times (default `time.monotonic`, read when each
        queue is built). A policy that reads its clock from a parameter gets deterministic ages
        from the same clock: `check_schedule_policy(lambda: MyPolicy(clock=fake), clock=fake)` with
        `fake = lambda: 1000.0`. Plugin API 1.19.
    """
    low, high = waits
    if not 0 <= low <= high:
        raise ValueError(f"waits={waits!r}: (shortest, longest) seconds with 0 <= shortest <= longest")
    clock = clock or (lambda: time.monotonic())  # looked up at each call: a monkeypatched clock is seen
    build = _checked_factory(policy)
    cache_factory = cache or _default_cache()
    for seed in seeds:
        _check_order(build, cache_factory, seed, clock, (float(low), float(high)))
    if end_to_end:
        from radixserve.testing.end_to_end import check_scheduler_outputs

        check_scheduler_outputs(cache_factory, build, seed=seeds[0])
