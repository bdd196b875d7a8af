"""cpu_batched against the attention contract (radixserve.testing's conformance kit): with the
native kernel (head_dim 64, fp32) and without it (padded SDPA decode, reference extend)."""

from __future__ import annotations

import pytest
import torch
from radixserve.interfaces import AttentionRunnerInfo
from radixserve.memory import KVPool, ReqToTokenPool
from radixserve.testing import check_attention_backend
from radixserve_attention_cpu_batched.backend import CPUBatchedBackend, load_kernels


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


def test_conforms_with_bf16_products():
    """runtime.cpu_matmul_precision: medium over a bf16 pool: on AVX-512 BF16 CPUs the native kernel
    rounds queries and softmax weights to bf16 for its products (fp32 sums); the kit holds it to the
    medium tolerance, and chains passed as trees must still equal its own causal extends exactly."""
    if not getattr(load_kernels(), "bf16_products_available", False):
        pytest.skip("this CPU's native build has no AVX-512 BF16 (the backend then keeps exact products)")
    info = AttentionRunnerInfo(torch.device("cpu"), torch.float32, 1, 8, 2, 64, ReqToTokenPool(2, 8),
                               KVPool(8, 1, 2, 64, torch.bfloat16), 2, 8, matmul_precision="medium")
    assert CPUBatchedBackend(info)._bf16_products, "the kit would check the exact products"
    fp32_pool = AttentionRunnerInfo(torch.device("cpu"), torch.float32, 1, 8, 2, 64, ReqToTokenPool(2, 8),
                                    KVPool(8, 1, 2, 64, torch.float32), 2, 8, matmul_precision="medium")
    assert not CPUBatchedBackend(fp32_pool)._bf16_products, "an fp32 pool keeps its exact products"
    check_attention_backend(CPUBatchedBackend, kv_dtype=torch.bfloat16, matmul_precision="medium",
                            heads=((4, 2, 64), (8, 1, 64), (9, 3, 64), (4, 2, 128)))
