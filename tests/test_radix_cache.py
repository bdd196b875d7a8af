"""RadixCache specifics: edge splits, LRU eviction order, stats and the request-level helpers' exact
sharing. The contract's invariants under random operations (sizes add up, every slot owned once,
locked never evicted, free == total after reset) are the prefix-cache kit's, run by
tests/test_conformance.py."""

from __future__ import annotations

import pytest
import torch
from radixserve.memory.allocator import TokenAllocator
from radixserve.memory.req_to_token import ReqToTokenPool
from radixserve.state import Req, SamplingParams
from radixserve_cache_radix.radix_cache import RadixCache


def make_cache(size: int = 64) -> RadixCache:
    return RadixCache(ReqToTokenPool(4, 32), TokenAllocator(size, debug_checks=True))


def put(cache: RadixCache, key: list[int]) -> torch.Tensor:
    """Insert `key` with fresh slots the way a caller must: duplicates go back to the allocator."""
    slots = cache.allocator.alloc(len(key))
    n = cache.insert(key, slots)
    cache.allocator.free(slots[:n])
    return slots


def test_empty_cache_matches_nothing():
    cache = make_cache()
    m = cache.match_prefix([1, 2, 3])
    assert m.length == 0 and m.kv_indices.dtype == torch.int64
    cache.inc_lock_ref(m.last_node)  # locking an empty match is harmless
    cache.dec_lock_ref(m.last_node)
    assert cache.protected_size() == 0


def test_match_returns_inserted_slots_for_longest_prefix_and_splits():
    cache = make_cache()
    slots = put(cache, [1, 2, 3, 4, 5])
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).kv_indices.tolist() == slots.tolist()
    assert cache.match_prefix([1, 2, 3, 9]).kv_indices.tolist() == slots[:3].tolist()  # split inside an edge
    assert cache.match_prefix([2, 3]).length == 0
    other = put(cache, [1, 2, 7])  # shares two tokens
    assert cache.match_prefix([1, 2, 7]).kv_indices.tolist() == slots[:2].tolist() + other[2:].tolist()
    assert cache.match_prefix([1, 2, 3, 4, 5]).kv_indices.tolist() == slots.tolist()
    assert cache.evictable_size() == 6


def test_insert_returns_already_cached_length():
    cache = make_cache()
    put(cache, [1, 2, 3])
    slots = cache.allocator.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], slots) == 3
    assert cache.insert([1, 2], slots[:2]) == 2  # a prefix that ends inside an edge
    cache.allocator.free(slots[:3])
    assert cache.evictable_size() == 5
    assert cache.allocator.available_size() == 64 - 5


def test_lock_protects_path_and_sizes_move():
    cache = make_cache()
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 5])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(m.last_node)
    assert (cache.protected_size(), cache.evictable_size()) == (4, 1)
    assert cache.evict(100) == 1  # only the unlocked [5] branch can go
    assert cache.match_prefix([1, 2, 3, 4]).length == 4
    cache.dec_lock_ref(m.last_node)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 4)
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(m.last_node)


def test_node_handle_survives_later_split():
    cache = make_cache()
    put(cache, [1, 2, 3, 4])
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(node)
    cache.match_prefix([1, 2])  # splits the locked edge above `node`
    assert cache.protected_size() == 4 and cache.evictable_size() == 0
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4


def test_evict_least_recently_used_leaf_first():
    cache = make_cache()
    put(cache, [1, 1])
    put(cache, [2, 2])
    put(cache, [3, 3])
    cache.match_prefix([1, 1])  # now [2, 2] is the least recently used
    assert cache.evict(1) == 2  # a whole leaf goes
    assert cache.match_prefix([2, 2]).length == 0
    assert cache.match_prefix([1, 1]).length == 2 and cache.match_prefix([3, 3]).length == 2
    assert cache.stats()["evicted_tokens"] == 2


def test_evict_cascades_to_parent_that_becomes_a_leaf():
    cache = make_cache(8)
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 4])
    assert cache.evict(5) == 4
    assert cache.evictable_size() == 0 and cache.allocator.available_size() == 8


def test_reset_frees_everything_and_refuses_while_locked():
    cache = make_cache(16)
    put(cache, [1, 2, 3])
    put(cache, [4, 5])
    node = cache.match_prefix([4, 5]).last_node
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.dec_lock_ref(node)
    cache.reset()
    assert cache.allocator.available_size() == 16
    assert cache.match_prefix([1, 2, 3]).length == 0


def test_stats_count_hits_and_queries():
    cache = make_cache()
    put(cache, [1, 2, 3])
    cache.match_prefix([1, 2, 3, 4])
    cache.match_prefix([9])
    s = cache.stats()
    assert (s["hit_tokens"], s["queried_tokens"]) == (3, 5)


def test_registered_as_prefix_cache_radix():
    from radixserve.plugins.registry import Registry

    assert Registry.discover().load("prefix_cache", "radix") is RadixCache


# ---- request-level helpers, driven the way the scheduler drives them ------------------------------


def new_req(cache: RadixCache, prompt: list[int], use_cache: bool = True) -> Req:
    """Admit a request: match + lock its prefix, take a row, allocate and write its new prompt slots."""
    req = Req(rid=str(prompt), origin_input_ids=list(prompt), sampling_params=SamplingParams())
    req.fill_ids = list(prompt)
    m = cache.match_prefix(req.fill_ids) if use_cache else cache.match_prefix([])
    req.prefix_indices, req.last_node = m.kv_indices, m.last_node
    cache.inc_lock_ref(req.last_node)
    req.req_pool_idx = cache.req_to_token_pool.alloc()
    prefill(cache, req, len(prompt))
    return req


def prefill(cache: RadixCache, req: Req, end: int) -> None:
    """Run the prompt up to position `end`: slots for [kv_len or prefix, end) are allocated and written."""
    start = max(req.kv_len, len(req.prefix_indices))
    table = cache.req_to_token_pool.req_to_token
    table[req.req_pool_idx, : len(req.prefix_indices)] = req.prefix_indices
    table[req.req_pool_idx, start:end] = cache.allocator.alloc(end - start)
    req.kv_len = end


def decode(cache: RadixCache, req: Req, token: int) -> None:
    """The sampled token is appended; the next forward writes its KV."""
    req.output_ids.append(token)
    if req.kv_len < len(req.all_ids()) - 1:
        cache.req_to_token_pool.req_to_token[req.req_pool_idx, req.kv_len] = int(cache.allocator.alloc(1)[0])
        req.kv_len += 1


def finish(cache: RadixCache, req: Req) -> None:
    cache.cache_finished_req(req)
    cache.req_to_token_pool.free(req.req_pool_idx)
    req.req_pool_idx = None


def row(cache: RadixCache, req: Req, n: int) -> list[int]:
    return cache.req_to_token_pool.req_to_token[req.req_pool_idx, :n].tolist()


def test_finished_requests_share_prefix_and_all_slots_return_after_reset():
    cache = make_cache(32)
    a = new_req(cache, [1, 2, 3, 4, 5])
    a_slots = row(cache, a, 5)
    for t in (9, 10):
        decode(cache, a, t)  # KV of 9 is written, 10 is sampled but never forwarded
    finish(cache, a)
    assert cache.evictable_size() == 6 and cache.protected_size() == 0
    assert cache.allocator.available_size() == 32 - 6

    b = new_req(cache, [1, 2, 3, 7])
    assert b.prefix_indices.tolist() == a_slots[:3]
    assert cache.protected_size() == 3
    decode(cache, b, 8)
    finish(cache, b)
    assert cache.evictable_size() == 7 and cache.protected_size() == 0
    assert cache.allocator.available_size() == 32 - 7

    # a request that did not use the cache computed duplicates of cached tokens: they are freed
    c = new_req(cache, [1, 2, 3, 4, 5, 9, 11], use_cache=False)
    decode(cache, c, 0)
    finish(cache, c)
    assert cache.evictable_size() == 8
    assert cache.allocator.available_size() == 32 - 8
    cache.reset()
    assert cache.allocator.available_size() == 32


def test_chunked_prefill_moves_lock_and_rewrites_row_to_cached_slots():
    cache = make_cache(32)
    shared = put(cache, [20, 21, 22])  # cached earlier by someone else
    req = new_req(cache, [20, 21, 22, 23, 24, 25, 26, 27], use_cache=False)
    # first chunk: its own slots for [20..23]; the first three duplicate the cache
    req.kv_len = 0
    req.fill_ids = req.origin_input_ids[:4]
    own = row(cache, req, 8)
    cache.allocator.free(torch.tensor(own[4:]))  # new_req allocated the whole prompt; keep the chunk only
    req.kv_len = 4
    cache.cache_unfinished_req(req)
    assert row(cache, req, 4) == shared.tolist() + own[3:4]
    assert req.prefix_indices.tolist() == row(cache, req, 4)
    assert cache.protected_size() == 4 and cache.evictable_size() == 0
    assert cache.allocator.available_size() == 32 - 4  # 3 duplicates went back

    req.fill_ids = list(req.origin_input_ids)  # second (last) chunk
    prefill(cache, req, 8)
    decode(cache, req, 1)
    finish(cache, req)
    assert cache.protected_size() == 0 and cache.evictable_size() == 8
    assert cache.match_prefix(req.origin_input_ids).length == 8
    cache.reset()
    assert cache.allocator.available_size() == 32


def _scan_order(cache: RadixCache) -> list[int]:
    """The eviction order by definition: evictable leaves by (last access, id), a parent joining
    once its last child is gone (what evict did with a full scan of the tree at each call)."""
    import heapq

    heap = [(n.last_access, n.id, n) for n in cache._nodes() if n.is_leaf and n.lock_ref == 0]
    heapq.heapify(heap)
    order, gone = [], set()
    while heap:
        _, _, leaf = heapq.heappop(heap)
        order.append(leaf.id)
        gone.add(leaf.id)
        parent = leaf.parent
        if not parent.is_root and parent.lock_ref == 0 and all(c.id in gone for c in parent.children.values()):
            heapq.heappush(heap, (parent.last_access, parent.id, parent))
    return order


@pytest.mark.parametrize("seed", range(6))
def test_evict_takes_leaves_in_lru_order_however_the_tree_changed(seed):
    """Candidates are kept as the tree changes (not scanned for): after random inserts, matches
    (splits, touches), locks and partial evictions, each evict frees the leaves a full scan of the
    tree would pick, in the same order, and the sizes stay consistent."""
    import random

    rng = random.Random(seed)
    cache = make_cache(4096)
    alloc = cache.allocator
    locked = []
    for step in range(300):
        op = rng.random()
        key = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]  # small alphabet: shared prefixes, splits
        if op < 0.45 and alloc.available_size() >= len(key):
            put(cache, key)
        elif op < 0.65:
            m = cache.match_prefix(key)
            if rng.random() < 0.5 and m.kv_indices.numel():
                cache.inc_lock_ref(m.last_node)
                locked.append(m.last_node)
        elif op < 0.8 and locked:
            cache.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        else:
            want = rng.randrange(1, 16)
            order = _scan_order(cache)
            before = {n.id for n in cache._nodes()}
            freed = cache.evict(want)
            evicted = [i for i in order if i in before - {n.id for n in cache._nodes()}]
            assert evicted == order[: len(evicted)], f"step {step}: not the least recently used leaves first"
            assert freed >= want or not _scan_order(cache), f"step {step}: stopped with evictable leaves left"
        assert cache.evictable_size() + cache.protected_size() == sum(len(n) for n in cache._nodes())
        assert len(cache._candidates) <= 4 * cache._num_nodes + 256 + 1
    for node in locked:
        cache.dec_lock_ref(node)
    cache.evict(10**6)
    assert cache.total_size() == 0 and not list(cache._nodes()) and alloc.available_size() == alloc.size


def test_common_prefix_len_finds_the_first_difference_anywhere():
    import random

    from radixserve_cache_radix.tree import common_prefix_len

    rng = random.Random(0)
    for _ in range(3000):
        a = tuple(rng.randrange(3) for _ in range(rng.randrange(0, 300)))
        start = rng.randrange(0, 5)
        tail = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        b = [rng.randrange(3) for _ in range(start)] + list(a[: rng.randrange(0, len(a) + 1)]) + tail
        want = 0
        while want < min(len(a), len(b) - start) and a[want] == b[start + want]:
            want += 1
        assert common_prefix_len(a, b, start) == want
        assert common_prefix_len(a, tuple(b), start) == want
