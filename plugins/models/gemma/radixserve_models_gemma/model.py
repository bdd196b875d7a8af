"""Gemma 2 and Gemma 3 (text): a Llama-like decoder with Gemma's own pieces.

- embeddings scaled by sqrt(hidden_size) (rounded to the model dtype, as transformers does);
- RMSNorm scaling by (1 + w) (`GemmaRMSNorm`), and four norms per layer: input, post-attention,
  pre-feedforward and post-feedforward (the attention and MLP outputs are normed before the residual add);
- GeGLU MLP: gelu_pytorch_tanh(gate) * up;
- attention scaled by query_pre_attn_scalar ** -0.5, sliding-window layers by `layer_types`
  (Gemma 2 alternates, Gemma 3 has five local layers per global one);
- Gemma 2: attention logits soft-capped (`attn_logit_softcapping`) and final logits soft-capped
  (`final_logit_softcapping`);
- Gemma 3: per-head q/k norms and a separate rotary base for the local (sliding) layers
  (`rope_parameters[layer_type]`); no attention soft-capping (transformers applies none either).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F
from radixserve.interfaces.quantization import QuantMethod
from radixserve.layers.causal_lm import DecoderOnlyCausalLM
from radixserve.layers.decoder_blocks import DecoderAttention, head_dim_of
from radixserve.layers.distributed import TPGroup
from radixserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from radixserve.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_of
from radixserve.layers.sliding_window import SLIDING, sliding_window_for_layer

from radixserve_models_gemma.norm import GemmaRMSNorm

_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}  # hidden_activation -> F.gelu(approximate=)


def gemma_attention(config, layer_id: int, quant_method: QuantMethod | None, version: int) -> DecoderAttention:
    head_dim, eps = head_dim_of(config), config.rms_norm_eps
    if version >= 3:  # the rotary base follows the layer type, even where no window is configured
        local = (getattr(config, "layer_types", None) or ["full_attention"] * (layer_id + 1))[layer_id] == SLIDING
        rotary_emb = _rope(config, head_dim, local)
    else:
        rotary_emb = get_rope(config, head_dim)
    bias = bool(getattr(config, "attention_bias", False))
    return DecoderAttention(
        config, layer_id, quant_method, qkv_bias=bias, o_bias=bias,
        qk_norm=(lambda dim: GemmaRMSNorm(dim, eps)) if version >= 3 else None,  # Gemma 3
        rotary_emb=rotary_emb, scaling=float(config.query_pre_attn_scalar) ** -0.5,
        sliding_window=sliding_window_for_layer(config, layer_id),
        logit_cap=getattr(config, "attn_logit_softcapping", None) if version == 2 else None,
    )


def _rope(config, head_dim: int, local: bool) -> RotaryEmbedding:
    """Gemma 3's rotary embedding of a local (sliding) or global layer: `rope_parameters` holds one
    entry per layer type (the local one with its own, smaller base)."""
    params = getattr(config, "rope_parameters", None) or {}
    layer_type = "sliding_attention" if local else "full_attention"
    if layer_type in params:
        params = rope_parameters_of(SimpleNamespace(rope_parameters=params[layer_type]))
    else:  # an older flat config: rope_local_base_freq for the local layers
        params = rope_parameters_of(config)
        if local:
            params = {"rope_type": "default", "rope_theta": getattr(config, "rope_local_base_freq", 10000.0)}
    return RotaryEmbedding(head_dim, head_dim, getattr(config, "max_position_embeddings", 4096), params)


class GemmaMLP(nn.Module):
    def __init__(self, config, quant_method: QuantMethod | None) -> None:
        super().__init__()
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
        if act not in _ACTIVATIONS:
            raise ValueError(f"unsupported hidden_activation {act!r} for Gemma (supported: {sorted(_ACTIVATIONS)})")
        self.approximate = _ACTIVATIONS[act]
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2,
                                                       quant_method=quant_method)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, quant_method=quant_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate=self.approximate) * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, quant_method: QuantMethod | None, version: int) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = gemma_attention(config, layer_id, quant_method, version)
        self.mlp = GemmaMLP(config, quant_method)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, positions, h, residual, batch):
        """`h` is what the previous layer added to the residual stream `residual` (None: h is the stream)."""
        if residual is None:
            residual = h
            h = self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, h, batch))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma2ForCausalLM(DecoderOnlyCausalLM):
    """Gemma 2; `Gemma3ForCausalLM` below is the text-only Gemma 3."""

    version = 2
    tie_word_embeddings_default = True

    def __init__(self, config, quant_method: QuantMethod | None = None, prefix: str = "",
                 tp_group: TPGroup | None = None) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(f"{type(self).__name__}: use_bidirectional_attention=True (an embedding model) is not "
                             "supported; only causal Gemma decoders are")
        super().__init__(config, quant_method, prefix, tp_group)
        self.final_logit_cap = getattr(config, "final_logit_softcapping", None) or None

    def build_layer(self, config, layer_id: int, quant_method: QuantMethod | None, tp: TPGroup) -> nn.Module:
        return GemmaDecoderLayer(config, layer_id, quant_method, self.version)

    def build_norm(self, config) -> nn.Module:
        return GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed_scale(self, config) -> float:
        return float(config.hidden_size) ** 0.5

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        if self.final_logit_cap:
            logits = self.final_logit_cap * torch.tanh(logits / self.final_logit_cap)
        return logits

    def greedy_token_ids(self, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        if self.final_logit_cap:
            return None  # tanh can round near-equal large logits to a tie the screen would not see
        return self.lm_head.greedy_token_ids(hidden, vocab_size)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    version = 3
