"""RadixServe plugin: FP8 (e4m3) weights and activations (`quant_method: fp8`, or online)."""
