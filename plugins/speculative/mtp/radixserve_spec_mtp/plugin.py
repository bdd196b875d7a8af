"""Entry-point module of radixserve-spec-mtp: declares its component; cheap to import (no torch)."""

from radixserve.plugins import hookimpl

PLUGIN_API = ">=1.4,<2"  # 1.4: PooledDrafter / DraftSlotStack (target_states came in 1.1)


@hookimpl
def radixserve_register(registry) -> None:
    registry.register(
        "drafter",
        "mtp",
        "radixserve_spec_mtp.drafter:MtpDrafter",
        devices=("cpu", "cuda"),
        capabilities=("chain",),
        description="DeepSeek-V3 multi-token-prediction (NextN) layer of the target checkpoint "
        "(model.layers.{num_hidden_layers}.*), fed the target's last hidden state; greedy chains",
    )
