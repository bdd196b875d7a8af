"""The Qwen mixture-of-experts family: Qwen2-MoE (q/k/v bias, a shared expert behind a sigmoid
gate) and Qwen3-MoE (per-head q/k RMSNorm, no shared expert).

Which layers are sparse follows the config: layer i uses the MoE block unless it is listed in
`mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step`; the others use a dense
SwiGLU MLP of `intermediate_size`. Routing: softmax top-`num_experts_per_tok`, renormalised when
`norm_topk_prob`."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
from radixserve.interfaces.model import Model
from radixserve.interfaces.quantization import QuantMethod
from radixserve.layers.attention import RadixAttention
from radixserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from radixserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from radixserve.layers.moe import FusedMoE, RoutingConfig
from radixserve.layers.norm import RMSNorm
from radixserve.layers.rotary import get_rope
from radixserve.layers.weight_utils import load_into
from radixserve.state import ForwardBatch

# HF checkpoint name piece -> (our fused parameter piece, shard id); expert tensors are mapped first
_STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _check_silu(config) -> None:
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (only silu)")


class QwenMoeAttention(nn.Module):
    def __init__(self, config, layer_id: int, quant_method: QuantMethod | None, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        o_bias = qk_norm and qkv_bias  # Qwen3-MoE: `attention_bias` covers o_proj too; Qwen2-MoE: never
        self.head_dim = _head_dim(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=qkv_bias, quant_method=quant_method)
        self.q_size = self.qkv_proj.num_heads * self.head_dim
        self.kv_size = self.qkv_proj.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=o_bias,
                                        quant_method=quant_method)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = get_rope(config, self.head_dim)
        self.attn = RadixAttention(layer_id, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, self.head_dim,
                                   self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:  # Qwen3: RMSNorm over each head before rotary
            n = q.shape[0]
            q = self.q_norm(q.reshape(n, -1, self.head_dim)).reshape(n, -1)
            k = self.k_norm(k.reshape(n, -1, self.head_dim)).reshape(n, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch))


class QwenMLP(nn.Module):
    """SwiGLU MLP: the dense layers' MLP and Qwen2-MoE's shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, quant_method: QuantMethod | None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, quant_method=quant_method,
                                                       fuse_silu_and_mul=True)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, quant_method=quant_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_silu_and_mul(x))


class QwenSparseMoeBlock(nn.Module):
    """Router `gate`, routed `experts`, and (Qwen2-MoE) `shared_expert` scaled by sigmoid(`shared_expert_gate`)."""

    def __init__(self, config, quant_method: QuantMethod | None, prefix: str) -> None:
        super().__init__()
        routing = RoutingConfig(top_k=config.num_experts_per_tok, scoring="softmax",
                                renormalize=bool(getattr(config, "norm_topk_prob", False)))
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts)  # the router stays unquantized
        self.experts = FusedMoE(config.num_experts, config.hidden_size, config.moe_intermediate_size, routing,
                                quant_method=quant_method, prefix=f"{prefix}.experts")
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        if shared:
            self.shared_expert = QwenMLP(config.hidden_size, shared, quant_method)
            self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1)
        else:
            self.shared_expert = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def is_sparse_layer(config, layer_id: int) -> bool:
    """HF's rule: MoE unless listed in `mlp_only_layers` or off the `decoder_sparse_step` stride."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    only_dense = set(getattr(config, "mlp_only_layers", None) or ())
    return config.num_experts > 0 and layer_id not in only_dense and (layer_id + 1) % step == 0


class QwenMoeDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, quant_method: QuantMethod | None, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = QwenMoeAttention(config, layer_id, quant_method, qkv_bias, qk_norm)
        if is_sparse_layer(config, layer_id):
            self.mlp = QwenSparseMoeBlock(config, quant_method, f"model.layers.{layer_id}.mlp")
        else:
            self.mlp = QwenMLP(config.hidden_size, config.intermediate_size, quant_method)
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


class QwenMoeModel(nn.Module):
    def __init__(self, config, quant_method: QuantMethod | None, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(QwenMoeDecoderLayer(config, i, quant_method, qkv_bias, qk_norm)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, batch):
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer(positions, h, residual, batch)
        h, _ = self.norm(h, residual)
        return h


class Qwen2MoeForCausalLM(Model):
    """Qwen2-MoE; Qwen3MoeForCausalLM below flips the attention flags."""

    qk_norm = False

    def qkv_bias(self, config) -> bool:
        return bool(getattr(config, "qkv_bias", True))

    def __init__(self, config, quant_method: QuantMethod | None = None, prefix: str = "") -> None:
        super().__init__(config, quant_method, prefix)
        _check_silu(config)
        self.config = config
        self.model = QwenMoeModel(config, quant_method, self.qkv_bias(config), self.qk_norm)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

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
                continue
            expert = FusedMoE.map_checkpoint_name(name)
            if expert is not None:
                target, expert_id, shard_id = expert
                param = params.get(target)
                if param is None:
                    raise KeyError(f"checkpoint expert tensor {name!r} has no matching parameter in "
                                   f"{type(self).__name__} (is that layer dense here?)")
                param.weight_loader(param, tensor, shard_id, expert_id=expert_id)
                loaded.add(target)
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
        for module_name, module in self.named_modules():  # an expert missing from the checkpoint: unloaded
            if isinstance(module, FusedMoE):
                loaded.difference_update(f"{module_name}.{p}" for p in module.incomplete_params())
        return loaded


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    qk_norm = True

    def qkv_bias(self, config) -> bool:
        return bool(getattr(config, "attention_bias", False))
