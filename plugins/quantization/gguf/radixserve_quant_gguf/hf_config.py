"""Build the HF config of a GGUF checkpoint from its metadata (llama, qwen2, qwen3 architectures).

Equivalent to `AutoConfig.from_pretrained(dir, gguf_file=...)` for these architectures, but it reuses
the already-parsed reader instead of parsing the file a second time, and it is a plain object
(`GGUFModelConfig`), not a transformers config: importing transformers' config machinery costs the
serving process ~157 MB of resident memory and about a second of start-up, for a few dozen
numbers. `GGUFModelConfig.to_transformers()` gives the transformers config where one is needed."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from radixserve_quant_gguf.reader import field

# GGUF general.architecture -> HF model_type
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


class UnsupportedGGUF(ValueError):
    """A GGUF file this reader cannot serve (its architecture, a tensor type, a rope variant): a
    ValueError, so that start-up reports it as one line naming the file (exit 2), not a traceback."""


def gguf_architecture(reader) -> str:
    arch = field(reader, "general.architecture")
    if arch not in _MODEL_TYPES:
        raise UnsupportedGGUF(f"{reader.path}: GGUF architecture {arch!r} is not supported (the GGUF reader serves "
                              f"{', '.join(sorted(_MODEL_TYPES))}; for another architecture use its Hugging Face "
                              "directory)")
    return arch


def _rope_parameters(reader, arch: str, theta: float, head_dim: int) -> dict[str, Any]:
    kind = field(reader, f"{arch}.rope.scaling.type")
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if kind in (None, "none"):
        freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
        if freqs is not None:  # every Llama 3.1-3.3 conversion: llama3 rope as one factor per frequency
            params.update(_llama3_parameters(reader, freqs, theta, head_dim))
        return params
    if kind not in ("linear", "yarn"):
        raise UnsupportedGGUF(f"{reader.path}: GGUF rope scaling type {kind!r} is not supported (linear, yarn, and "
                              "Llama 3's rope_freqs)")
    params["rope_type"] = kind
    params["factor"] = float(field(reader, f"{arch}.rope.scaling.factor"))
    orig = field(reader, f"{arch}.rope.scaling.original_context_length")
    if orig is not None:
        params["original_max_position_embeddings"] = int(orig)
    return params


# The values Llama 3.x and its fine-tunes use (3.1/3.3: factor 8, 3.2: 32; low 1, high 4, 8192 tokens),
# widened so that other contexts and smoothing bands are found too.
_LLAMA3_CONTEXTS = tuple(2**k for k in range(4, 21))
_LLAMA3_LOW = (1.0, 0.5, 2.0, 4.0)
_LLAMA3_HIGH = (4.0, 1.0, 2.0, 8.0, 16.0, 32.0)


def llama3_rope_factors(inv_freq: np.ndarray, factor: float, low: float, high: float, context: int) -> np.ndarray:
    """Each frequency's divisor under Llama 3's rope scaling (what llama.cpp's converter writes as
    rope_freqs.weight): 1 for wavelengths under context / high, `factor` over context / low, and
    the smoothed blend between."""
    wavelen = 2 * math.pi / inv_freq
    smooth = np.clip((context / wavelen - low) / (high - low), 0.0, 1.0)
    scaled = (1 - smooth) / factor + smooth
    return np.where(wavelen < context / high, 1.0, np.where(wavelen > context / low, factor, 1.0 / scaled))


def _llama3_parameters(reader, tensor, theta: float, head_dim: int) -> dict[str, Any]:
    """The `rope_type: llama3` parameters whose factors equal the file's rope_freqs.weight (llama.cpp
    stores the factors, not the parameters that made them); refused when none among the usual values do."""
    factors = np.asarray(tensor.data, dtype=np.float64).reshape(-1)
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if factors.shape != inv_freq.shape or not np.all(np.isfinite(factors)) or factors.min() <= 0:
        raise UnsupportedGGUF(f"{reader.path}: rope_freqs.weight holds {factors.size} values, not one positive factor "
                              f"for each of the {inv_freq.size} rope frequencies")
    factor = float(factors.max())
    if np.allclose(factors, 1.0):
        return {}  # no scaling
    # (context, low, high) and (k context, k low, k high) give the same factors: the usual low / high come first
    for low, high, context in itertools.product(_LLAMA3_LOW, _LLAMA3_HIGH, _LLAMA3_CONTEXTS):
        if high > low and np.allclose(llama3_rope_factors(inv_freq, factor, low, high, context), factors,
                                      rtol=1e-4, atol=1e-6):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": context}
    raise UnsupportedGGUF(f"{reader.path}: rope_freqs.weight (per-frequency rope factors, largest {factor:g}) matches "
                          "no Llama 3 rope scaling (factor, low/high frequency factors, original context), so the "
                          "positions cannot be encoded as the model was trained; not supported")


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
    """The config of the GGUF's model (attributes as transformers' config has them). Refuses a file
    holding a tensor of a type the reader cannot read, before any weight is loaded."""
    from radixserve_quant_gguf.tensors import SUPPORTED_TYPES, hf_name

    arch = gguf_architecture(reader)
    for t in reader.tensors:
        if hf_name(t.name) is not None and t.tensor_type.name not in SUPPORTED_TYPES:
            raise UnsupportedGGUF(f"{reader.path}: tensor {t.name!r} has type {t.tensor_type.name}, which the GGUF "
                                  f"reader cannot read (it reads {', '.join(SUPPORTED_TYPES)})")
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
        "rope_parameters": _rope_parameters(reader, arch, float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
                                            int(field(reader, f"{arch}.rope.dimension_count") or head_dim or hidden // heads)),
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": field(reader, "tokenizer.ggml.padding_token_id"),
    }
    return GGUFModelConfig(_MODEL_TYPES[arch], kwargs)
