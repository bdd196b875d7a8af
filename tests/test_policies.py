"""Schedule policies: each returns a permutation of the waiting queue in its documented order,
and the cache-aware ones store their matches without locking anything."""

from __future__ import annotations

import pytest
from radixserve.interfaces import SchedulePolicy
from radixserve.memory.allocator import TokenAllocator
from radixserve.memory.req_to_token import ReqToTokenPool
from radixserve.plugins.registry import Registry
from radixserve.state import Req, SamplingParams
from radixserve_cache_chunk.chunk_cache import ChunkCache
from radixserve_cache_radix.radix_cache import RadixCache
from radixserve_policies.dfs_weight import DFSWeightPolicy
from radixserve_policies.lof import LOFPolicy
from radixserve_policies.lpm import LPMPolicy
from radixserve_policies.priority import PriorityPolicy
from radixserve_policies.random_order import RandomPolicy

NAMES = ("fcfs", "lpm", "dfs-weight", "lof", "priority", "random")


def mk(rid: str, prompt: list[int], t: float, max_new: int = 16, priority: int = 0) -> Req:
    r = Req(rid, list(prompt), SamplingParams(max_new_tokens=max_new), priority=priority, arrival_time=t)
    r.fill_ids = r.all_ids()  # the scheduler sets this before ordering
    return r


def radix_with(*keys: list[int]) -> RadixCache:
    cache = RadixCache(ReqToTokenPool(2, 64), TokenAllocator(256, debug_checks=True))
    for key in keys:
        slots = cache.allocator.alloc(len(key))
        cache.allocator.free(slots[: cache.insert(key, slots)])
    return cache


def rids(reqs: list[Req]) -> list[str]:
    return [r.rid for r in reqs]


@pytest.mark.parametrize("name", NAMES)
def test_registered_and_returns_a_permutation(name):
    cls = Registry.discover().load("policy", name)
    assert issubclass(cls, SchedulePolicy)
    waiting = [mk(f"r{i}", [i % 3, i], t=float(i % 4), max_new=i, priority=i % 2) for i in range(10)]
    cache = radix_with([0, 1, 2], [1, 1])
    out = cls().order(list(waiting), cache)
    assert sorted(map(id, out)) == sorted(map(id, waiting))
    assert cache.protected_size() == 0  # no policy locks anything


def test_lpm_longest_cached_prefix_first_ties_by_arrival():
    cache = radix_with([1, 2, 3, 4, 5], [7, 7])
    waiting = [
        mk("none", [9, 9, 9], t=0),
        mk("two", [1, 2, 8], t=1),
        mk("five", [1, 2, 3, 4, 5, 6], t=3),
        mk("two-again", [7, 7, 1], t=0.5),
    ]
    out = LPMPolicy().order(waiting, cache)
    assert rids(out) == ["five", "two-again", "two", "none"]
    for r in out:  # matches are stored for the scheduler, equal to a fresh match
        assert r.prefix_indices.tolist() == cache.match_prefix(r.fill_ids).kv_indices.tolist()
        assert r.last_node is cache.match_prefix(r.fill_ids).last_node
    assert cache.protected_size() == 0


def test_lpm_falls_back_to_fcfs_on_long_queues_without_matching():
    cache = radix_with([1, 2, 3])
    waiting = [mk("late", [1, 2, 3], t=5), mk("early", [4], t=1), mk("mid", [1, 2], t=2)]
    out = LPMPolicy(fcfs_threshold=2).order(waiting, cache)
    assert rids(out) == ["early", "mid", "late"]
    assert all(r.prefix_indices is None for r in out)
    assert cache.stats()["queried_tokens"] == 0


def test_dfs_weight_groups_shared_prefixes_heaviest_subtree_first():
    # tree: [1,1,1] -> {[2,2], [3,3]} and [5,5,5]
    cache = radix_with([1, 1, 1, 2, 2], [1, 1, 1, 3, 3], [5, 5, 5])
    waiting = [
        mk("b1", [5, 5, 5, 0], t=0),  # earliest, but its subtree has weight 1
        mk("none", [9], t=1),
        mk("a-shallow", [1, 1, 1, 4], t=2),
        mk("a3", [1, 1, 1, 3, 3, 0], t=3),
        mk("a2", [1, 1, 1, 2, 2, 0], t=4),
        mk("a2b", [1, 1, 1, 2, 2, 1], t=5),
    ]
    out = rids(DFSWeightPolicy().order(waiting, cache))
    # [1,1,1] subtree (4 requests) first; inside it the [2,2] branch (2) before [3,3] (1), and the
    # request that ends at [1,1,1] itself after its children; then the [5,5,5] branch; unmatched last
    assert out == ["a2", "a2b", "a3", "a-shallow", "b1", "none"]
    assert cache.protected_size() == 0


def test_dfs_weight_equal_weights_by_earliest_arrival_and_chunk_cache_is_fcfs():
    cache = radix_with([1, 1], [2, 2])
    waiting = [mk("x2", [2, 2, 0], t=0), mk("x1", [1, 1, 0], t=1)]
    assert rids(DFSWeightPolicy().order(waiting, cache)) == ["x2", "x1"]
    chunk = ChunkCache(ReqToTokenPool(2, 8), TokenAllocator(8))
    waiting = [mk("b", [1], t=2), mk("a", [2], t=1), mk("c", [3], t=3)]
    assert rids(DFSWeightPolicy().order(waiting, chunk)) == ["a", "b", "c"]


def test_lof_longest_max_new_tokens_first_ties_by_arrival():
    waiting = [
        mk("short", [1], t=0, max_new=4),
        mk("long-late", [1], t=2, max_new=64),
        mk("long", [1], t=1, max_new=64),
    ]
    assert rids(LOFPolicy().order(waiting, radix_with())) == ["long", "long-late", "short"]


def test_priority_higher_first_ties_by_arrival():
    waiting = [
        mk("low", [1], t=0, priority=0),
        mk("high-late", [1], t=3, priority=5),
        mk("neg", [1], t=-1, priority=-2),
        mk("high", [1], t=1, priority=5),
    ]
    assert rids(PriorityPolicy().order(waiting, radix_with())) == ["high", "high-late", "low", "neg"]


def test_random_is_seeded_and_actually_shuffles():
    waiting = [mk(f"r{i}", [i], t=float(i)) for i in range(20)]
    cache = radix_with()
    a, b, c = RandomPolicy(seed=1), RandomPolicy(seed=1), RandomPolicy(seed=2)
    first = [rids(a.order(waiting, cache)) for _ in range(3)]
    assert first == [rids(b.order(waiting, cache)) for _ in range(3)]  # same seed, same sequence
    assert first != [rids(c.order(waiting, cache)) for _ in range(3)]
    assert rids(waiting) not in first and len({tuple(x) for x in first}) == 3


def test_options_are_checked():
    with pytest.raises(ValueError, match="takes no options"):
        LOFPolicy(fcfs_threshold=3)
    with pytest.raises(ValueError):
        LPMPolicy(fcfs_threshold=-1)


# ---- end to end: the scheduler keeps its invariants under every policy ----------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("cache", ["radix", "chunk"])
def test_scheduler_under_policy_gives_reference_outputs_and_leaks_nothing(name, cache):
    import random

    from radixserve.config import Config
    from radixserve.runtime.messages import GenerateRequest
    from radixserve.scheduler import Scheduler
    from radixserve.scheduler.testing import ToyRunner, toy_reference
    from radixserve.state import SamplingParams

    vocab = 500
    # a small pool forces heavy eviction; chunking exercises cache_unfinished_req
    runner = ToyRunner(vocab_size=vocab, max_total_tokens=200)
    config = Config.build({"stack": {"prefix_cache": cache, "policy": name}, "scheduler": {"chunked_prefill_size": 16}})
    sched = Scheduler.from_config(config, runner, Registry.discover())
    rng = random.Random(1)
    shared = [rng.randrange(vocab) for _ in range(30)]
    reqs = []
    for i in range(16):
        prompt = ([] if i % 2 else shared[: rng.randint(5, 30)]) + [
            rng.randrange(vocab) for _ in range(rng.randint(2, 40))
        ]
        reqs.append((f"r{i}", prompt, rng.randint(1, 30)))
        params = SamplingParams(max_new_tokens=reqs[-1][2], temperature=0)
        sched.add_request(GenerateRequest(rid=f"r{i}", input_ids=prompt, sampling_params=params, priority=i % 3))
    got: dict[str, list[int]] = {}
    for _ in range(10_000):
        if not sched.has_work():
            break
        for out in sched.step():
            got.setdefault(out.rid, []).extend(out.new_ids)
    assert not sched.has_work()
    for rid, prompt, max_new in reqs:
        assert got[rid] == toy_reference(prompt, max_new, vocab), rid
    assert sched.flush_cache()
    assert sched.allocator.available_size() == sched.allocator.size
    assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size
