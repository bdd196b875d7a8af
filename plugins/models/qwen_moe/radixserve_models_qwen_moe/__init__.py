"""RadixServe plugin: models qwen_moe (mixture of experts)."""
