"""RadixServe plugin: attention torch_native."""
