"""Schedule policies: each orders the waiting queue as documented. The contract (a permutation,
no locks, true matches, deterministic, correct outputs through the scheduler) is checked by the
policy kit in tests/test_conformance.py."""

from __future__ import annotations

import pytest
from radixserve.memory.allocator import TokenAllocator
from radixserve.memory.req_to_token import ReqToTokenPool
from radixserve.state import Req, SamplingParams
from radixserve_cache_chunk.chunk_cache import ChunkCache
from radixserve_cache_radix.radix_cache import RadixCache
from radixserve_policies.dfs_weight import DFSWeightPolicy
from radixserve_policies.lof import LOFPolicy
from radixserve_policies.lpm import LPMPolicy
from radixserve_policies.priority import PriorityPolicy
from radixserve_policies.random_order import RandomPolicy


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
