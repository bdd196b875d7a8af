"""Entry-point module of radixserve-spec-eagle: declares its component; cheap to import (no torch)."""

from radixserve.plugins import hookimpl

PLUGIN_API = ">=1.4,<2"  # 1.4: PooledDrafter / DraftSlotStack (target_states and tree drafts came in 1.1)


@hookimpl
def radixserve_register(registry) -> None:
    registry.register(
        "drafter",
        "eagle",
        "radixserve_spec_eagle.drafter:EagleDrafter",
        devices=("cpu", "cuda"),
        capabilities=("chain", "tree"),
        description="EAGLE-2 / EAGLE-3 draft head fed the target's hidden states "
        "(speculative.draft_model_path); chains, or dynamic top-k trees",
    )
