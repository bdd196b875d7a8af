"""Entry-point module of radixserve-attention-cpu_batched: declares its component; cheap to import (no torch)."""

from radixserve.plugins import hookimpl

PLUGIN_API = ">=1,<2"


@hookimpl
def radixserve_register(registry) -> None:
    registry.register(
        "attention",
        "cpu_batched",
        "radixserve_attention_cpu_batched.backend:CPUBatchedBackend",
        devices=("cpu",),
        # below torch_native (10) until reviewed: select it with stack.attention=cpu_batched
        priority=5,
        description="decode of the whole batch in one SDPA call (padded gather, GQA without repeat); "
        "prefill as torch_native",
    )
