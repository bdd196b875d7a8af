"""runtime.kv_cache_dtype=bfloat16: an fp32 model's KV pool in bf16 (half the bytes, twice the
tokens in the same memory), on the backends that declare supports_bf16_kv_cache."""

from __future__ import annotations

import pytest
import torch
from radixserve.config import Config, ConfigError
from radixserve.model_runner import ModelRunner
from radixserve.plugins.registry import Registry
from radixserve.plugins.stack import effective_kv_cache_dtype, resolve_stack, supports_kv_cache_dtype
from radixserve_attention_cpu_batched.backend import CPUBatchedBackend
from radixserve_attention_torch_native.backend import TorchNativeBackend
from runner_driver import greedy_generate


def _config(path: str | None = None, **runtime) -> Config:
    data = {"runtime": {"device": "cpu", **runtime}}
    if path is not None:
        data["model"] = {"path": path}
        data["scheduler"] = {"max_running_requests": 8, "cpu_kv_cache_gb": 0.01}
    return Config.build(data)


def test_config_key():
    assert _config(kv_cache_dtype="bfloat16").runtime.kv_cache_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="runtime.kv_cache_dtype.*float16"):
        _config(kv_cache_dtype="float16")


def test_a_bf16_cache_of_a_bf16_model_is_the_model_dtype():
    assert effective_kv_cache_dtype(_config(kv_cache_dtype="bfloat16", dtype="bfloat16"), "cpu") == "auto"
    assert effective_kv_cache_dtype(_config(kv_cache_dtype="bfloat16"), "cpu") == "bfloat16"  # fp32 on the CPU


def test_backends_declare_it_and_subclasses_must_redeclare():
    assert supports_kv_cache_dtype(CPUBatchedBackend, "bfloat16")
    assert supports_kv_cache_dtype(TorchNativeBackend, "bfloat16")

    class Custom(TorchNativeBackend):  # replaces the kernels the promise is about
        name = "custom"

    assert not supports_kv_cache_dtype(Custom, "bfloat16") and supports_kv_cache_dtype(Custom, "auto")


def test_the_cpu_default_backend_takes_it():
    cfg = _config(kv_cache_dtype="bfloat16")
    assert resolve_stack(cfg, Registry.from_config(cfg), "cpu").attention.name == "cpu_batched"


def test_a_model_on_a_bf16_pool(tiny_llama_dir):
    path = tiny_llama_dir("llama", head_dim=64, num_attention_heads=4, num_key_value_heads=2, hidden_size=128)
    fp32 = ModelRunner(_config(path, dtype="float32", num_threads=1), show_progress=False)
    bf16 = ModelRunner(_config(path, dtype="float32", num_threads=1, kv_cache_dtype="bfloat16"),
                       show_progress=False)
    assert bf16.kv_pool.dtype == torch.bfloat16 and bf16.attn_backend.uses_native_kernel
    assert bf16.kv_bytes_per_token() * 2 == fp32.kv_bytes_per_token()
    assert bf16.max_total_tokens >= 2 * fp32.max_total_tokens - 2  # the same memory holds twice the tokens
    prompts = [[5, 9, 2, 7, 11], [3] * 30, [8, 1]]
    got = greedy_generate(bf16, prompts, 12, keep_logits=True)
    assert greedy_generate(bf16, [prompts[1]], 12)[0].tokens == got[1].tokens  # rows do not see each other
    ref = greedy_generate(fp32, prompts, 12, keep_logits=True)
    first_step = (got[0].logits[0] - ref[0].logits[0]).abs().max().item()
    assert 0 < first_step < 0.05, first_step  # the keys and values rounded to bf16: close, not equal
