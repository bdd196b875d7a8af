"""KV memory: request-to-token table, token-slot allocator and the per-layer KV pool."""

from radixserve.memory.allocator import TokenAllocator
from radixserve.memory.kv_pool import KVPool, kv_bytes_per_token, tokens_for_budget
from radixserve.memory.req_to_token import ReqToTokenPool

__all__ = ["KVPool", "ReqToTokenPool", "TokenAllocator", "kv_bytes_per_token", "tokens_for_budget"]
