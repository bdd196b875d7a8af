"""RadixServe plugin: AWQ int4 weight-only quantization (`quant_method: awq`, GEMM layout)."""
