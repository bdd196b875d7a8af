"""The Llama family: Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm).

Sliding windows come from the config per layer (`sliding_window_for_layer`): Mistral's on every
layer, Qwen2/3's on the layers its `layer_types` marks (only with `use_sliding_window`).

One implementation on the core's decoder shell and blocks; the architectures differ only in the
class-level flags below."""

from __future__ import annotations

import torch.nn as nn
from radixserve.interfaces.quantization import QuantMethod
from radixserve.layers.causal_lm import DecoderOnlyCausalLM
from radixserve.layers.decoder_blocks import DecoderAttention, PreNormDecoderLayer, SwiGLUMLP, check_silu
from radixserve.layers.distributed import TPGroup
from radixserve.layers.norm import RMSNorm
from radixserve.layers.sliding_window import sliding_window_for_layer


class LlamaForCausalLM(DecoderOnlyCausalLM):
    """Llama; subclasses below flip the flags for the other architectures."""

    qkv_bias_default = False  # used when the config has no `attention_bias`
    o_bias_follows_attention_bias = True
    qk_norm = False
    supports_tensor_parallel = True

    def build_layer(self, config, layer_id: int, quant_method: QuantMethod | None, tp: TPGroup) -> nn.Module:
        check_silu(config, type(self).__name__)
        eps = config.rms_norm_eps
        attention_bias = getattr(config, "attention_bias", None)
        attn = DecoderAttention(
            config, layer_id, quant_method, tp,
            qkv_bias=self.qkv_bias_default if attention_bias is None else bool(attention_bias),
            o_bias=bool(attention_bias) and self.o_bias_follows_attention_bias,
            qk_norm=(lambda dim: RMSNorm(dim, eps)) if self.qk_norm else None,  # Qwen3
            sliding_window=sliding_window_for_layer(config, layer_id),
        )
        mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, quant_method, tp,
                        bias=bool(getattr(config, "mlp_bias", False)))
        return PreNormDecoderLayer(attn, mlp, RMSNorm(config.hidden_size, eps), RMSNorm(config.hidden_size, eps))


class MistralForCausalLM(LlamaForCausalLM):
    pass  # same math; its sliding window (every layer) is set per layer from the config


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias_default = True  # Qwen2 always has q/k/v bias and never an o_proj bias
    o_bias_follows_attention_bias = False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
