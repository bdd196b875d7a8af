"""Entry-point module of radixserve-attention-mla_triton: declares its component; cheap to import (no torch)."""

from radixserve.plugins import hookimpl

PLUGIN_API = ">=1.4,<2"  # the latent-attention contract (LatentKVPool, forward_latent_*)


@hookimpl
def radixserve_register(registry) -> None:
    registry.register(
        "attention",
        "mla_triton",
        "radixserve_attention_mla_triton.backend:MlaTritonBackend",
        devices=("cuda",),
        dtypes=("bfloat16", "float16"),
        priority=15,  # below triton (20): a latent-only backend must not be the default for standard models
        capabilities=("cuda_graph", "latent_attention", "split_kv_decode", "tree_mask"),
        description="latent attention (MLA) only: absorbed split-KV Triton decode over the latent rows, "
        "absorbed Triton extend (prefix + causal or tree-masked new tokens)",
    )
