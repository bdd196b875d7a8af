"""RadixServe plugin: cache chunk."""
