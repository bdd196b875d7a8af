"""Which distribution provides a well-known component, to tell users what to pip install."""

_KNOWN = {
    ("attention", "torch_native"): "radixserve-attention-torch_native",
    ("attention", "triton"): "radixserve-attention-triton",
    ("attention", "mla_triton"): "radixserve-attention-mla_triton",
    ("model", "LlamaForCausalLM"): "radixserve-models-llama",
    ("model", "MistralForCausalLM"): "radixserve-models-llama",
    ("model", "Qwen2ForCausalLM"): "radixserve-models-llama",
    ("model", "Qwen3ForCausalLM"): "radixserve-models-llama",
    ("model", "transformers"): "radixserve-models-transformers",  # the fallback (model.impl)
    ("quantization", "gguf"): "radixserve-quant-gguf",
    ("quantization", "awq"): "radixserve-quant-awq",
    ("quantization", "gptq"): "radixserve-quant-gptq",
    ("quantization", "fp8"): "radixserve-quant-fp8",
    ("prefix_cache", "radix"): "radixserve-cache-radix",
    ("prefix_cache", "chunk"): "radixserve-cache-chunk",
    ("drafter", "ngram"): "radixserve-spec-ngram",
    ("drafter", "eagle"): "radixserve-spec-eagle",
    **{("policy", p): "radixserve-policies" for p in ("fcfs", "lpm", "dfs-weight", "lof", "priority", "random")},
}


def install_hint(kind: str, name: str) -> str | None:
    return _KNOWN.get((kind, name))
