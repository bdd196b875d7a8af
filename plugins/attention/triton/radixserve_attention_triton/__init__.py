"""RadixServe plugin: attention triton."""
