"""The plugin kinds. Torch-free on purpose: plugin discovery (and so `radixserve serve`'s main
process and `radixserve plugins`) must not import torch just to check a kind's name."""

KINDS = (
    "attention", "model", "quantization", "policy", "prefix_cache", "drafter", "grammar", "tool_parser", "reasoning_parser",
)
