"""Phi-3: a Llama-shaped decoder whose checkpoints hold fused `qkv_proj` and `gate_up_proj`
matrices (loaded straight into the fused layers), with LongRoPE when `rope_parameters` asks for it
and a sliding window on every layer when the config has one."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
from radixserve.interfaces.model import Model
from radixserve.interfaces.quantization import QuantMethod
from radixserve.layers.attention import RadixAttention
from radixserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from radixserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from radixserve.layers.norm import RMSNorm
from radixserve.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_of
from radixserve.layers.sliding_window import sliding_window_for_layer
from radixserve.layers.weight_utils import load_into
from radixserve.state import ForwardBatch

from radixserve_models_phi3.rope import LongRoPE

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


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


class Phi3Attention(nn.Module):
    def __init__(self, config, layer_id: int, quant_method: QuantMethod | None) -> None:
        super().__init__()
        self.head_dim = _head_dim(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, quant_method=quant_method)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        quant_method=quant_method)
        self.rotary_emb = phi3_rope(config, self.head_dim)
        self.attn = RadixAttention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
                                   sliding_window=sliding_window_for_layer(config, layer_id))

    def forward(self, positions: torch.Tensor, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch))


class Phi3MLP(nn.Module):
    def __init__(self, config, quant_method: QuantMethod | None) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} for Phi-3 (only silu)")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2,
                                                       quant_method=quant_method, fuse_silu_and_mul=True)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, quant_method=quant_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_silu_and_mul(x))


class Phi3DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, quant_method: QuantMethod | None) -> None:
        super().__init__()
        self.self_attn = Phi3Attention(config, layer_id, quant_method)
        self.mlp = Phi3MLP(config, quant_method)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, h, residual, batch):
        if residual is None:
            residual = h
            h = self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(positions, h, batch)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Phi3ForCausalLM(Model):
    def __init__(self, config, quant_method: QuantMethod | None = None, prefix: str = "") -> None:
        super().__init__(config, quant_method, prefix)
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Phi3DecoderLayer(config, i, quant_method) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer(positions, h, residual, batch)
        h, _ = self.norm(h, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def greedy_token_ids(self, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        return self.lm_head.greedy_token_ids(hidden, vocab_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # checkpoint names are model.<...> and lm_head.weight; ours drop the "model." level
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            target = name.removeprefix("model.")
            param = params.get(target)
            if param is None:
                raise KeyError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            load_into(param, tensor)  # fused qkv_proj / gate_up_proj: their loaders split the matrix
            loaded.add(target)
        return loaded
