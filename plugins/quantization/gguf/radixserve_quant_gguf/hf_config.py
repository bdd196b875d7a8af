"""Build the HF config of a GGUF checkpoint from its metadata (llama, qwen2, qwen3 architectures).

Equivalent to `AutoConfig.from_pretrained(dir, gguf_file=...)` for these architectures, but it reuses
the already-parsed reader instead of parsing the file a second time, and it is a plain object
(`GGUFModelConfig`), not a transformers config: importing transformers' config machinery costs the
serving process ~157 MB of resident memory and about a second of start-up, for a few dozen
numbers. `GGUFModelConfig.to_transformers()` gives the transformers config where one is needed."""

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


# Attributes the runtime reads that transformers' config class for the architecture sets by
# default (the GGUF metadata does not carry them): the same values, so that no read falls back to
# building the transformers config. tests/test_gguf_kept_quantized.py compares them.
def _architecture_defaults(model_type: str, num_layers: int) -> dict[str, Any]:
    extra: dict[str, Any] = {"hidden_act": "silu"}
    if model_type in ("llama", "qwen3"):
        extra["attention_bias"] = False
    if model_type == "llama":
        extra["mlp_bias"] = False
    if model_type in ("qwen2", "qwen3"):
        extra.update(sliding_window=None, use_sliding_window=False, layer_types=["full_attention"] * num_layers)
    return extra


# Attributes the runtime probes with getattr(config, name, default) that transformers' config class
# for the architecture does not have (unless _architecture_defaults sets them): absent here too,
# without building the transformers config to find that out.
ABSENT = frozenset({"sliding_window", "layer_types", "use_sliding_window", "quantization_config",
                    "partial_rotary_factor", "final_logit_softcapping", "text_config", "num_experts",
                    "kv_lora_rank", "num_nextn_predict_layers", "logits_scaling"})


class GGUFModelConfig:
    """The model config of a GGUF file as plain attributes (`model_type`, `architectures`, the
    sizes, `rope_parameters`, token ids, ...), equal to those of transformers' config for the same
    file. Reading an attribute it does not hold builds the transformers config once (importing
    transformers) and reads it there, so any other attribute still has transformers' value."""

    def __init__(self, model_type: str, kwargs: dict[str, Any]) -> None:
        self.__dict__["_kwargs"] = dict(kwargs)
        self.__dict__["_transformers"] = None
        self.model_type = model_type
        self.__dict__.update(kwargs)
        self.__dict__.update(_architecture_defaults(model_type, int(kwargs["num_hidden_layers"])))
        self.rope_scaling = self.rope_parameters  # transformers 5 aliases the two

    def to_transformers(self):
        """The transformers `PretrainedConfig` of the same file (imports transformers)."""
        if self.__dict__["_transformers"] is None:
            from transformers import AutoConfig

            self.__dict__["_transformers"] = AutoConfig.for_model(self.model_type, **self._kwargs)
        return self.__dict__["_transformers"]

    def to_dict(self) -> dict[str, Any]:
        return self.to_transformers().to_dict()

    def __getattr__(self, name: str) -> Any:  # only for attributes not set above
        if name.startswith("_") or name in ABSENT:
            raise AttributeError(name)
        return getattr(self.to_transformers(), name)

    def __repr__(self) -> str:
        return f"GGUFModelConfig({self.model_type}, {self._kwargs})"


def build_hf_config(reader) -> GGUFModelConfig:
    """The config of the GGUF's model (attributes as transformers' config has them)."""
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
    return GGUFModelConfig(_MODEL_TYPES[arch], kwargs)
