"""RadixServe plugin: models mixtral (mixture of experts)."""
