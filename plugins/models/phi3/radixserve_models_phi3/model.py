"""Phi-3: a Llama-shaped decoder whose checkpoints hold fused `qkv_proj` and `gate_up_proj`
matrices (loaded straight into the fused layers), with LongRoPE when `rope_parameters` asks for it
and a sliding window on every layer when the config has one."""

from __future__ import annotations

import torch.nn as nn
from radixserve.interfaces.quantization import QuantMethod
from radixserve.layers.causal_lm import DecoderOnlyCausalLM
from radixserve.layers.decoder_blocks import DecoderAttention, PreNormDecoderLayer, SwiGLUMLP, check_silu, head_dim_of
from radixserve.layers.distributed import TPGroup
from radixserve.layers.norm import RMSNorm
from radixserve.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_of
from radixserve.layers.sliding_window import sliding_window_for_layer

from radixserve_models_phi3.rope import LongRoPE


def phi3_rope(config, head_dim: int) -> RotaryEmbedding:
    """The rotary embedding Phi-3's config asks for: LongRoPE ("longrope"; "su" in old configs) or
    anything `get_rope` supports."""
    params = rope_parameters_of(config)
    if params["rope_type"] not in ("longrope", "su"):
        return get_rope(config, head_dim)
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    original = params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings",
                                                                          None)
    if not original:
        raise ValueError("longrope rope_parameters need original_max_position_embeddings")
    return LongRoPE(head_dim, int(head_dim * partial), config.max_position_embeddings, params, original)


class Phi3ForCausalLM(DecoderOnlyCausalLM):
    stacked_params_mapping = ()  # the checkpoint's qkv_proj / gate_up_proj are fused already: their loaders split

    def build_layer(self, config, layer_id: int, quant_method: QuantMethod | None, tp: TPGroup) -> nn.Module:
        check_silu(config, "Phi-3")
        eps = config.rms_norm_eps
        attn = DecoderAttention(config, layer_id, quant_method, rotary_emb=phi3_rope(config, head_dim_of(config)),
                                sliding_window=sliding_window_for_layer(config, layer_id))
        return PreNormDecoderLayer(attn, SwiGLUMLP(config.hidden_size, config.intermediate_size, quant_method),
                                   RMSNorm(config.hidden_size, eps), RMSNorm(config.hidden_size, eps))
