"""RadixServe plugin: cache radix."""
