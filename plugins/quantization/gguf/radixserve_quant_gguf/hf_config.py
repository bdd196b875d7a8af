"""Build the HF config of a GGUF checkpoint from its metadata (llama, qwen2, qwen3 architectures).

Equivalent to `AutoConfig.from_pretrained(dir, gguf_file=...)` for these architectures, but it reuses
the already-parsed reader instead of parsing the file a second time."""

from __future__ import annotations

from typing import Any

from radixserve_quant_gguf.reader import field

# GGUF general.architecture -> HF model_type
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def gguf_architecture(reader) -> str:
    arch = field(reader, "general.architecture")
    if arch not in _MODEL_TYPES:
        raise NotImplementedError(f"GGUF architecture {arch!r} is not supported (supported: {sorted(_MODEL_TYPES)})")
    return arch


def _rope_parameters(reader, arch: str, theta: float) -> dict[str, Any]:
    kind = field(reader, f"{arch}.rope.scaling.type")
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if kind in (None, "none"):
        if any(t.name == "rope_freqs.weight" for t in reader.tensors):
            raise NotImplementedError("GGUF rope_freqs (llama3-style per-frequency rope factors) is not supported yet")
        return params
    if kind not in ("linear", "yarn"):
        raise NotImplementedError(f"GGUF rope scaling type {kind!r} is not supported (linear, yarn)")
    params["rope_type"] = kind
    params["factor"] = float(field(reader, f"{arch}.rope.scaling.factor"))
    orig = field(reader, f"{arch}.rope.scaling.original_context_length")
    if orig is not None:
        params["original_max_position_embeddings"] = int(orig)
    return params


def build_hf_config(reader):
    """A transformers PretrainedConfig for the GGUF's model."""
    from transformers import AutoConfig

    arch = gguf_architecture(reader)
    heads = int(field(reader, f"{arch}.attention.head_count"))
    hidden = int(field(reader, f"{arch}.embedding_length"))
    vocab = field(reader, f"{arch}.vocab_size") or len(field(reader, "tokenizer.ggml.tokens"))
    head_dim = field(reader, f"{arch}.attention.key_length") or field(reader, f"{arch}.rope.dimension_count")
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    kwargs: dict[str, Any] = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]],
        "num_hidden_layers": int(field(reader, f"{arch}.block_count")),
        "max_position_embeddings": int(field(reader, f"{arch}.context_length")),
        "hidden_size": hidden,
        "intermediate_size": int(field(reader, f"{arch}.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(head_dim or hidden // heads),
        "rms_norm_eps": float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "vocab_size": int(vocab),
        "tie_word_embeddings": not has_output,
        "rope_parameters": _rope_parameters(reader, arch, float(field(reader, f"{arch}.rope.freq_base", 10000.0))),
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": field(reader, "tokenizer.ggml.padding_token_id"),
    }
    return AutoConfig.for_model(_MODEL_TYPES[arch], **kwargs)
