"""Which layers of an HF decoder use sliding-window attention, and with which window.

Added in plugin API 1.3."""

from __future__ import annotations

from typing import Any

SLIDING = "sliding_attention"


def sliding_window_for_layer(config: Any, layer_id: int) -> int | None:
    """The attention window of layer `layer_id` as HF's config describes it, or None (full attention).

    A config with `layer_types` (Gemma 2/3, Qwen2/3, Ministral ...) windows exactly the layers typed
    "sliding_attention", with `config.sliding_window`; a config without it but with a
    `sliding_window` (Mistral, Phi-3) windows every layer. Window W: a query sees its W most recent
    positions, itself included.
    """
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None:
        if layer_id >= len(types):
            raise ValueError(f"config.layer_types has {len(types)} entries; layer {layer_id} has none")
        return int(window) if types[layer_id] == SLIDING else None
    return int(window)
