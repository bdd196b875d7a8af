"""RadixServe plugin: quantization gguf."""
