"""OLMo 2: a Llama-shaped decoder with the norms moved.

- no input norm: attention and MLP read the residual stream itself, and their outputs are normed
  (`post_attention_layernorm`, `post_feedforward_layernorm`) before the residual add;
- q and k are RMS-normed over the whole projection (all heads together, one weight of
  num_heads * head_dim), before rotary.

RMSNorm here multiplies the weight in fp32 before the cast, as transformers' OLMo 2 does (the core
RMSNorm casts first, like Llama); fp32 activations take the core's fused kernels (same arithmetic).
Tensor parallelism would need the q/k norm statistics over all ranks: not supported.
"""

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
from radixserve.layers.rotary import get_rope
from radixserve.layers.sliding_window import sliding_window_for_layer
from radixserve.layers.weight_utils import load_into
from radixserve.state import ForwardBatch

_STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class Olmo2RMSNorm(RMSNorm):
    """RMSNorm with the weight applied in fp32, then one cast to x's dtype."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.dtype == torch.float32:
            return super().forward(x, residual)
        if residual is not None:
            x = x + residual
        x32 = x.float()
        out = (self.weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)
        return out if residual is None else (out, x)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Olmo2Attention(nn.Module):
    def __init__(self, config, layer_id: int, quant_method: QuantMethod | None) -> None:
        super().__init__()
        self.head_dim = _head_dim(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=bias, quant_method=quant_method)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias,
                                        quant_method=quant_method)
        self.q_norm = Olmo2RMSNorm(self.q_size, config.rms_norm_eps)  # over every head at once
        self.k_norm = Olmo2RMSNorm(self.kv_size, config.rms_norm_eps)
        self.rotary_emb = get_rope(config, self.head_dim)
        self.attn = RadixAttention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
                                   sliding_window=sliding_window_for_layer(config, layer_id))

    def forward(self, positions: torch.Tensor, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, self.q_norm(q.contiguous()), self.k_norm(k.contiguous()))
        return self.o_proj(self.attn(q, k, v, batch))


class Olmo2MLP(nn.Module):
    def __init__(self, config, quant_method: QuantMethod | None) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} for OLMo 2 (only silu)")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2,
                                                       quant_method=quant_method, fuse_silu_and_mul=True)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, quant_method=quant_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_silu_and_mul(x))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, quant_method: QuantMethod | None) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, layer_id, quant_method)
        self.mlp = Olmo2MLP(config, quant_method)
        self.post_attention_layernorm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, batch):
        x = x + self.post_attention_layernorm(self.self_attn(positions, x, batch))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2Model(nn.Module):
    def __init__(self, config, quant_method: QuantMethod | None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Olmo2DecoderLayer(config, i, quant_method) for i in range(config.num_hidden_layers))
        self.norm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, batch):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x, batch)
        return self.norm(x)


class Olmo2ForCausalLM(Model):
    def __init__(self, config, quant_method: QuantMethod | None = None, prefix: str = "") -> None:
        super().__init__(config, quant_method, prefix)
        self.config = config
        self.model = Olmo2Model(config, quant_method)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def greedy_token_ids(self, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        return self.lm_head.greedy_token_ids(hidden, vocab_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
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
