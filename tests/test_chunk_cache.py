"""ChunkCache: never shares, frees finished requests' KV, keeps a chunked request's own slots."""

from __future__ import annotations

import torch
from radixserve.memory.allocator import TokenAllocator
from radixserve.memory.req_to_token import ReqToTokenPool
from radixserve.state import Req, SamplingParams
from radixserve_cache_chunk.chunk_cache import ChunkCache


def make_cache(size: int = 16) -> ChunkCache:
    return ChunkCache(ReqToTokenPool(2, 16), TokenAllocator(size, debug_checks=True))


def admit(cache: ChunkCache, prompt: list[int], upto: int) -> Req:
    req = Req(rid="r", origin_input_ids=prompt, sampling_params=SamplingParams())
    req.fill_ids = prompt[:upto]
    m = cache.match_prefix(req.fill_ids)
    req.prefix_indices, req.last_node = m.kv_indices, m.last_node
    req.req_pool_idx = cache.req_to_token_pool.alloc()
    cache.req_to_token_pool.req_to_token[req.req_pool_idx, :upto] = cache.allocator.alloc(upto)
    req.kv_len = upto
    return req


def test_finished_request_slots_go_back_and_nothing_is_shared():
    cache = make_cache()
    req = admit(cache, [1, 2, 3, 4], 4)
    assert req.prefix_indices.numel() == 0
    req.output_ids = [5]  # sampled, KV never written
    cache.cache_finished_req(req)
    assert cache.allocator.available_size() == 16
    assert cache.match_prefix([1, 2, 3, 4]).length == 0
    assert cache.evictable_size() == 0 and cache.protected_size() == 0 and cache.evict(10) == 0


def test_chunked_request_keeps_its_slots_as_prefix_until_finished():
    cache = make_cache()
    req = admit(cache, [1, 2, 3, 4, 5, 6], 3)
    cache.cache_unfinished_req(req)
    first = cache.req_to_token_pool.req_to_token[req.req_pool_idx, :3]
    assert torch.equal(req.prefix_indices, first)
    assert cache.allocator.available_size() == 13  # still the request's
    req.fill_ids = list(req.origin_input_ids)
    cache.req_to_token_pool.req_to_token[req.req_pool_idx, 3:6] = cache.allocator.alloc(3)
    req.kv_len = 6
    req.output_ids = [7]
    cache.cache_finished_req(req)
    assert cache.allocator.available_size() == 16


def test_insert_takes_and_frees_all_slots():
    cache = make_cache()
    slots = cache.allocator.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], slots) == 0
    assert cache.allocator.available_size() == 16


def test_registered_as_prefix_cache_chunk():
    from radixserve.plugins.registry import Registry

    assert Registry.discover().load("prefix_cache", "chunk") is ChunkCache
