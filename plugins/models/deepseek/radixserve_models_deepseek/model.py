"""DeepSeek-V2 (and V2-Lite) and DeepSeek-V3: multi-head latent attention (see attention.py) and
mixture-of-experts feed-forward blocks (see moe.py) in a pre-norm decoder.

The model declares `attention_type = "latent"`: the runner gives it a LatentKVPool (one
`kv_lora_rank + qk_rope_head_dim` row per token and layer) and a backend that supports latent
attention. `DeepseekDecoderLayer` is importable and constructible on its own (the MTP drafter of
DeepSeek-V3 reuses it for its extra layer)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.nn as nn
from radixserve.interfaces.latent_attention import LatentAttentionDims
from radixserve.interfaces.model import Model
from radixserve.interfaces.quantization import QuantMethod
from radixserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from radixserve.layers.moe import FusedMoE
from radixserve.layers.norm import RMSNorm
from radixserve.layers.weight_utils import load_into
from radixserve.state import ForwardBatch

from radixserve_models_deepseek.attention import DeepseekAttention, latent_dims
from radixserve_models_deepseek.moe import DeepseekMLP, DeepseekMoE, check_activation, is_moe_layer
from radixserve_models_deepseek.weights import (
    IGNORED_SUFFIXES,
    FP8ToFloatLoader,
    checkpoint_layer,
    map_dense_name,
)

logger = logging.getLogger(__name__)


def uses_v3_routing(config) -> bool:
    """V3's sigmoid / correction-bias router, unless the config is a DeepSeek-V2 one."""
    return getattr(config, "model_type", "") != "deepseek_v2"


def _kv_a_needs_float(config, quant_method: QuantMethod | None) -> bool:
    """True when a block-quantized method could not hold kv_a_proj_with_mqa (its kv_lora_rank +
    rope rows, 576 in V3, are no whole number of blocks): it is then kept in float and its FP8
    checkpoint weight dequantized at load."""
    block = getattr(quant_method, "block_size", None)
    return bool(block) and (config.kv_lora_rank + config.qk_rope_head_dim) % int(block[0]) != 0


class DeepseekDecoderLayer(nn.Module):
    """One DeepSeek decoder layer: `input_layernorm -> self_attn (MLA) -> post_attention_layernorm ->
    mlp` (a DeepseekMoE on sparse layers, see `is_moe_layer`, else a dense SwiGLU MLP).

    :param config: the HF DeepSeek config.
    :param layer_id: the layer's index in the checkpoint (decides dense vs MoE).
    :param quant_method: passed to every linear and the routed experts (kv_b_proj stays float).
    :param prefix: the layer's parameter-name prefix (`model.layers.{layer_id}`), for messages.
    :param v3: V3 routing (sigmoid, correction bias); default: from `config.model_type`.
    :param attn_layer_id: index into the LatentKVPool (default `layer_id`; a drafter with its own
        pool passes its own).

    `forward(positions, hidden, residual, batch) -> (hidden, residual)` with the residual add
    fused into the norms (residual None on the first layer)."""

    def __init__(self, config, layer_id: int, quant_method: QuantMethod | None = None, prefix: str = "", *,
                 v3: bool | None = None, attn_layer_id: int | None = None) -> None:
        super().__init__()
        check_activation(config)
        v3 = uses_v3_routing(config) if v3 is None else v3
        prefix = prefix or f"model.layers.{layer_id}"
        self.self_attn = DeepseekAttention(config, layer_id if attn_layer_id is None else attn_layer_id,
                                           quant_method, keep_kv_a_unquantized=_kv_a_needs_float(config, quant_method),
                                           rope_interleave=True if not v3 else None)
        if is_moe_layer(config, layer_id):
            self.mlp = DeepseekMoE(config, quant_method, sigmoid_noaux=v3, prefix=f"{prefix}.mlp")
        else:
            self.mlp = DeepseekMLP(config.hidden_size, config.intermediate_size, quant_method,
                                   bias=bool(getattr(config, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = h
            h = self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(positions, h, batch)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DeepseekModel(nn.Module):
    def __init__(self, config, quant_method: QuantMethod | None, v3: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(config, i, quant_method, f"model.layers.{i}", v3=v3)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.aux_layers: frozenset[int] = frozenset()  # layers whose output a drafter asked for (MTP, EAGLE-3)
        self.aux_order: tuple[int, ...] = ()
        self.aux_hidden_states: list[torch.Tensor] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
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


class DeepseekV2ForCausalLM(Model):
    """DeepSeek-V2 / V2-Lite (softmax routing); DeepseekV3ForCausalLM flips `v3_routing`."""

    attention_type = "latent"
    supports_tensor_parallel = False  # MLA heads and experts are not sharded yet: tp_size > 1 is refused
    v3_routing = False

    def __init__(self, config, quant_method: QuantMethod | None = None, prefix: str = "") -> None:
        super().__init__(config, quant_method, prefix)
        self.config = config
        self.model = DeepseekModel(config, quant_method, self.v3_routing)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        block = getattr(quant_method, "block_size", None) or (128, 128)
        self._fp8_block = (int(block[0]), int(block[1]))

    def latent_attention_dims(self) -> LatentAttentionDims:
        return latent_dims(self.config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def greedy_token_ids(self, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        return self.lm_head.greedy_token_ids(hidden, vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    # the MTP drafter reads the last layer's output (before the final norm) through this capability
    supports_aux_hidden_states = True

    def set_aux_hidden_state_layers(self, layer_ids: tuple[int, ...]) -> None:
        self.model.aux_order = tuple(layer_ids)
        self.model.aux_layers = frozenset(layer_ids)
        self.model.aux_hidden_states = None

    @property
    def aux_hidden_states(self) -> list[torch.Tensor] | None:
        return self.model.aux_hidden_states

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        fp8_to_float = FP8ToFloatLoader(params, self._fp8_block)
        loaded: set[str] = set()
        skipped_extra_layers = 0
        num_layers = self.config.num_hidden_layers
        for name, tensor in weights:
            if name.endswith(IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            layer = checkpoint_layer(name)
            if layer is not None and layer >= num_layers:
                # DeepSeek-V3's multi-token-prediction layer(s) `model.layers.{num_hidden_layers}.*`:
                # the MTP drafter (plugins/speculative/mtp) loads them, the target model does not
                skipped_extra_layers += 1
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
            taken, done = fp8_to_float.offer(name, tensor)
            if taken:
                if done is not None:
                    loaded.add(done)
                continue
            target, shard_id = map_dense_name(name)
            param = params.get(target)
            if param is None:
                raise KeyError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            load_into(param, tensor, shard_id)
            loaded.add(target)
        fp8_to_float.check_complete()
        if skipped_extra_layers:
            logger.info("skipped %d tensors of layers >= num_hidden_layers=%d (multi-token prediction; the MTP "
                        "drafter loads them)", skipped_extra_layers, num_layers)
        for module_name, module in self.named_modules():  # an expert missing from the checkpoint: unloaded
            if isinstance(module, FusedMoE):
                loaded.difference_update(f"{module_name}.{p}" for p in module.incomplete_params())
        return loaded


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 (sigmoid routing with `e_score_correction_bias`, grouped top-k)."""

    v3_routing = True
