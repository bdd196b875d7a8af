"""The Llama family: Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm).

Sliding windows come from the config per layer (`sliding_window_for_layer`): Mistral's on every
layer, Qwen2/3's on the layers its `layer_types` marks (only with `use_sliding_window`).

One implementation; the architectures differ only in the class-level flags below."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
from radixserve.interfaces.model import Model
from radixserve.interfaces.quantization import QuantMethod
from radixserve.layers.attention import RadixAttention
from radixserve.layers.distributed import TPGroup
from radixserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from radixserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from radixserve.layers.norm import RMSNorm
from radixserve.layers.rotary import get_rope
from radixserve.layers.sliding_window import sliding_window_for_layer
from radixserve.layers.weight_utils import load_into
from radixserve.state import ForwardBatch

# HF checkpoint name piece -> (our fused parameter piece, shard id)
_STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)
# buffers some checkpoints carry that we recompute
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_id: int, quant_method: QuantMethod | None, flags: dict[str, bool],
                 tp: TPGroup) -> None:
        super().__init__()
        self.head_dim = _head_dim(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads,
            bias=flags["qkv_bias"], quant_method=quant_method, tp_group=tp,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=flags["o_bias"],
            quant_method=quant_method, tp_group=tp,
        )
        self.qk_norm = flags["qk_norm"]
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = get_rope(config, self.head_dim)
        self.attn = RadixAttention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
                                   sliding_window=sliding_window_for_layer(config, layer_id))

    def forward(self, positions: torch.Tensor, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:  # Qwen3: RMSNorm over each head before rotary
            n = q.shape[0]
            q = self.q_norm(q.reshape(n, -1, self.head_dim)).reshape(n, -1)
            k = self.k_norm(k.reshape(n, -1, self.head_dim)).reshape(n, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch))


class LlamaMLP(nn.Module):
    def __init__(self, config, quant_method: QuantMethod | None, tp: TPGroup) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (only silu)")
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=bias, quant_method=quant_method,
            fuse_silu_and_mul=True, tp_group=tp,
        )
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias,
                                           quant_method=quant_method, tp_group=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_silu_and_mul(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, quant_method: QuantMethod | None, flags: dict[str, bool],
                 tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, quant_method, flags, tp)
        self.mlp = LlamaMLP(config, quant_method, tp)
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


class LlamaModel(nn.Module):
    def __init__(self, config, quant_method: QuantMethod | None, flags: dict[str, bool], tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_group=tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, quant_method, flags, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.aux_layers: frozenset[int] = frozenset()  # layers whose output a drafter asked for
        self.aux_order: tuple[int, ...] = ()
        self.aux_hidden_states: list[torch.Tensor] | None = None

    def forward(self, input_ids, positions, batch):
        h, residual = self.embed_tokens(input_ids), None
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            h, residual = layer(positions, h, residual, batch)
            if i in self.aux_layers:  # the residual stream after layer i (h + residual, unfused)
                captured[i] = h + residual
        if self.aux_order:
            self.aux_hidden_states = [captured[i] for i in self.aux_order]
        h, _ = self.norm(h, residual)
        return h


class LlamaForCausalLM(Model):
    """Llama; subclasses below flip the flags for the other architectures."""

    qkv_bias_default = False  # used when the config has no `attention_bias`
    o_bias_follows_attention_bias = True
    qk_norm = False
    supports_tensor_parallel = True

    def __init__(self, config, quant_method: QuantMethod | None = None, prefix: str = "",
                 tp_group: TPGroup | None = None) -> None:
        super().__init__(config, quant_method, prefix)
        self.config = config
        tp = tp_group if tp_group is not None else TPGroup.single()
        attention_bias = getattr(config, "attention_bias", None)
        qkv_bias = self.qkv_bias_default if attention_bias is None else bool(attention_bias)
        flags = {
            "qkv_bias": qkv_bias,
            "o_bias": bool(attention_bias) and self.o_bias_follows_attention_bias,
            "qk_norm": self.qk_norm,
        }
        self.model = LlamaModel(config, quant_method, flags, tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_group=tp)
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    supports_aux_hidden_states = True

    def set_aux_hidden_state_layers(self, layer_ids: tuple[int, ...]) -> None:
        self.model.aux_order = tuple(layer_ids)
        self.model.aux_layers = frozenset(layer_ids)
        self.model.aux_hidden_states = None

    @property
    def aux_hidden_states(self) -> list[torch.Tensor] | None:
        return self.model.aux_hidden_states

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def greedy_token_ids(self, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        return self.lm_head.greedy_token_ids(hidden, vocab_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # the head shares the embedding's parameter
            target, shard_id = name, None
            for hf_piece, our_piece, sid in _STACKED:
                if hf_piece in name:
                    target, shard_id = name.replace(hf_piece, our_piece), sid
                    break
            param = params.get(target)
            if param is None:
                raise KeyError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            load_into(param, tensor, shard_id)
            loaded.add(target)
        return loaded


class MistralForCausalLM(LlamaForCausalLM):
    pass  # same math; its sliding window (every layer) is set per layer from the config


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias_default = True  # Qwen2 always has q/k/v bias and never an o_proj bias
    o_bias_follows_attention_bias = False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
