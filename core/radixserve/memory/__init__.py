"""KV memory: request-to-token table, token-slot allocator and the per-layer KV pools (standard
K/V, or one latent row per token for MLA models)."""

from radixserve.memory.allocator import TokenAllocator
from radixserve.memory.fp8_kv import FP8_KV_DTYPE, KV_CACHE_DTYPES, dequantize_fp8, quantize_fp8
from radixserve.memory.kv_pool import KVPool, kv_bytes_per_token, tokens_for_budget
from radixserve.memory.latent_pool import LatentKVPool, latent_bytes_per_token
from radixserve.memory.req_to_token import ReqToTokenPool

__all__ = [
    "FP8_KV_DTYPE", "KV_CACHE_DTYPES", "dequantize_fp8", "quantize_fp8",
    "KVPool", "LatentKVPool", "ReqToTokenPool", "TokenAllocator", "kv_bytes_per_token", "latent_bytes_per_token",
    "tokens_for_budget",
]
