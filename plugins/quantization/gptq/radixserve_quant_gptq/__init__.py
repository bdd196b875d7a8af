"""RadixServe plugin: GPTQ int4 weight-only quantization (`quant_method: gptq`)."""
