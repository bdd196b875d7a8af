"""cpu_batched against the attention contract (radixserve.testing's conformance kit): with the
native kernel (head_dim 64, fp32) and without it (padded SDPA decode, reference extend)."""

from __future__ import annotations

import torch
from radixserve.interfaces import AttentionRunnerInfo
from radixserve.memory import KVPool, ReqToTokenPool
from radixserve.testing import check_attention_backend
from radixserve_attention_cpu_batched.backend import CPUBatchedBackend


def test_conforms_with_the_native_kernel():
    info = AttentionRunnerInfo(torch.device("cpu"), torch.float32, 1, 8, 2, 64, ReqToTokenPool(2, 8),
                               KVPool(8, 1, 2, 64, torch.float32), 2, 8)
    assert CPUBatchedBackend(info).uses_native_kernel, "the kit would only check the fallback path"
    check_attention_backend(CPUBatchedBackend)


def test_conforms_without_the_native_kernel():
    check_attention_backend(lambda info: CPUBatchedBackend(info, use_native=False))


def test_conforms_on_a_bf16_pool():
    """runtime.kv_cache_dtype: bfloat16 under an fp32 model: the native kernel and the fallback."""
    check_attention_backend(CPUBatchedBackend, kv_dtype=torch.bfloat16)
    check_attention_backend(lambda info: CPUBatchedBackend(info, use_native=False), kv_dtype=torch.bfloat16,
                            heads=((4, 2, 64),), seeds=(0,))
