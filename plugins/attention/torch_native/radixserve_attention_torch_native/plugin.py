"""Entry-point module of radixserve-attention-torch_native: declares its components; cheap to import (no torch)."""

from radixserve.plugins import hookimpl

PLUGIN_API = ">=1,<2"


@hookimpl
def radixserve_register(registry) -> None:
    registry.register(
        "attention",
        "torch_native",
        "radixserve_attention_torch_native.backend:TorchNativeBackend",
        devices=("cpu", "cuda"),
        priority=10,
        description="reference attention in plain torch (per-request SDPA); any device",
    )
