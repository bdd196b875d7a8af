"""Entry-point module of radixserve-attention-triton: declares its components; cheap to import (no torch)."""

from radixserve.plugins import hookimpl

PLUGIN_API = ">=1,<2"


@hookimpl
def radixserve_register(registry) -> None:
    registry.register(
        "attention",
        "triton",
        "radixserve_attention_triton.backend:TritonAttentionBackend",
        devices=("cuda",),
        dtypes=("bfloat16", "float16"),
        priority=20,  # above torch_native (10): the default on CUDA when installed
        capabilities=("cuda_graph", "gqa", "prefix_extend", "split_kv_decode", "fp8_kv_cache"),
        description="Triton extend (prefix + causal new tokens) and split-KV decode kernels over the token-slot KV pool",
    )
