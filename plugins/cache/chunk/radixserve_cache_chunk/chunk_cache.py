"""ChunkCache: the no-sharing prefix cache. Nothing is ever matched; a finished request's KV slots
go straight back to the allocator. It still supports chunked prefill: after a chunk, the request's
own slots become its `prefix_indices` so the next chunk extends them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from radixserve.interfaces import MatchResult, PrefixCache

if TYPE_CHECKING:
    from radixserve.state import Req


class ChunkCache(PrefixCache):
    supports_tensor_parallel = True  # lives on rank 0; rows written through ReqToTokenPool (replayed)
    shares_prefixes = False

    def match_prefix(self, key: list[int]) -> MatchResult:
        return MatchResult(kv_indices=torch.empty(0, dtype=torch.int64), last_node=None)

    def insert(self, key: list[int], kv_indices: torch.Tensor) -> int:
        """Nothing is cached: the slots handed over (all of them, as 0 is returned) are freed."""
        self.allocator.free(kv_indices)
        return 0

    def inc_lock_ref(self, node: Any) -> None:
        pass

    def dec_lock_ref(self, node: Any) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset(self) -> None:
        pass

    def cache_unfinished_req(self, req: Req) -> None:
        """The request keeps its slots; they become its prefix for the next chunk."""
        assert req.req_pool_idx is not None
        req.prefix_indices = self.req_to_token_pool.read(req.req_pool_idx, len(req.fill_ids))
        req.last_node = None

    def cache_finished_req(self, req: Req) -> None:
        """Frees the request's KV slots (positions [0, kv_len) of its row)."""
        if req.req_pool_idx is not None and req.kv_len > 0:
            self.allocator.free(self.req_to_token_pool.read(req.req_pool_idx, req.kv_len))
        req.last_node = None
