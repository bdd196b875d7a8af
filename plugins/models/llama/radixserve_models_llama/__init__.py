"""RadixServe plugin: models llama."""
