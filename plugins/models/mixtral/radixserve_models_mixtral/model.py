"""Mixtral: a Mistral decoder whose MLP is a sparse mixture of SwiGLU experts (softmax router,
top-`num_experts_per_tok`, always renormalised).

Checkpoint names: the router is `block_sparse_moe.gate`, the experts `block_sparse_moe.experts.{e}.
w1/w3/w2` (gate/up/down); transformers 5 state dicts name the block `mlp` and stack the experts
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`): both load."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
from radixserve.interfaces.model import Model
from radixserve.interfaces.quantization import QuantMethod
from radixserve.layers.attention import RadixAttention
from radixserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from radixserve.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from radixserve.layers.moe import FusedMoE, RoutingConfig
from radixserve.layers.norm import RMSNorm
from radixserve.layers.rotary import get_rope
from radixserve.layers.weight_utils import load_into
from radixserve.state import ForwardBatch

_QKV = ((".q_proj.", "q"), (".k_proj.", "k"), (".v_proj.", "v"))
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class MixtralAttention(nn.Module):
    def __init__(self, config, layer_id: int, quant_method: QuantMethod | None) -> None:
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, quant_method=quant_method)
        self.q_size = self.qkv_proj.num_heads * self.head_dim
        self.kv_size = self.qkv_proj.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        quant_method=quant_method)
        self.rotary_emb = get_rope(config, self.head_dim)
        self.attn = RadixAttention(layer_id, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, self.head_dim,
                                   self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch))


class MixtralSparseMoeBlock(nn.Module):
    def __init__(self, config, quant_method: QuantMethod | None, prefix: str) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (only silu)")
        routing = RoutingConfig(top_k=config.num_experts_per_tok, scoring="softmax", renormalize=True)
        self.gate = ReplicatedLinear(config.hidden_size, config.num_local_experts)  # the router stays unquantized
        self.experts = FusedMoE(config.num_local_experts, config.hidden_size, config.intermediate_size, routing,
                                quant_method=quant_method, prefix=f"{prefix}.experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


class MixtralDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, quant_method: QuantMethod | None) -> None:
        super().__init__()
        self.self_attn = MixtralAttention(config, layer_id, quant_method)
        self.block_sparse_moe = MixtralSparseMoeBlock(config, quant_method, f"model.layers.{layer_id}.block_sparse_moe")
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
        return self.block_sparse_moe(h), residual


class MixtralModel(nn.Module):
    def __init__(self, config, quant_method: QuantMethod | None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MixtralDecoderLayer(config, i, quant_method) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, batch):
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer(positions, h, residual, batch)
        h, _ = self.norm(h, residual)
        return h


class MixtralForCausalLM(Model):
    def __init__(self, config, quant_method: QuantMethod | None = None, prefix: str = "") -> None:
        super().__init__(config, quant_method, prefix)
        self.config = config
        self.model = MixtralModel(config, quant_method)
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
            name = name.replace(".mlp.", ".block_sparse_moe.")  # transformers 5 names the block `mlp`
            expert = FusedMoE.map_checkpoint_name(name, gate="w1", up="w3", down="w2")
            if expert is not None:
                target, expert_id, shard_id = expert
                param = params.get(target)
                if param is None:
                    raise KeyError(f"checkpoint expert tensor {name!r} has no matching parameter in MixtralForCausalLM")
                param.weight_loader(param, tensor, shard_id, expert_id=expert_id)
                loaded.add(target)
                continue
            target, shard_id = name, None
            for hf_piece, sid in _QKV:
                if hf_piece in name:
                    target, shard_id = name.replace(hf_piece, ".qkv_proj."), sid
                    break
            param = params.get(target)
            if param is None:
                raise KeyError(f"checkpoint tensor {name!r} has no matching parameter in MixtralForCausalLM")
            load_into(param, tensor, shard_id)
            loaded.add(target)
        for module_name, module in self.named_modules():  # an expert missing from the checkpoint: unloaded
            if isinstance(module, FusedMoE):
                loaded.difference_update(f"{module_name}.{p}" for p in module.incomplete_params())
        return loaded
