"""Entry-point module of radixserve-attention-flashinfer: declares its component; cheap to import
(neither torch nor flashinfer)."""

from radixserve.plugins import hookimpl

PLUGIN_API = ">=1,<2"


@hookimpl
def radixserve_register(registry) -> None:
    registry.register(
        "attention",
        "flashinfer",
        "radixserve_attention_flashinfer.backend:FlashInferAttentionBackend",
        devices=("cuda",),
        dtypes=("bfloat16", "float16"),
        # below triton (20): selected only by name (stack.attention=flashinfer) until the H200
        # figures show it faster (benchmarks/h200/s5_flashinfer.sh)
        priority=15,
        capabilities=("cuda_graph", "gqa", "prefix_extend", "tree_mask"),
        description="FlashInfer batch prefill (ragged fresh prompts, page-size-1 paged prefixes, tree masks) "
                    "and batch decode over the token-slot KV pool (needs flashinfer-python and a CUDA GPU)",
    )
