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
from radixserve.interfaces.quantization import QuantMethod
from radixserve.layers.causal_lm import DecoderOnlyCausalLM
from radixserve.layers.decoder_blocks import PreNormDecoderLayer
from radixserve.layers.distributed import TPGroup
from radixserve.layers.norm import RMSNorm

from radixserve_models_deepseek.attention import DeepseekAttention, latent_dims
from radixserve_models_deepseek.moe import DeepseekMLP, DeepseekMoE, check_activation, is_moe_layer
from radixserve_models_deepseek.weights import RENAMED, STACKED, FP8ToFloatLoader, checkpoint_layer

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


class DeepseekDecoderLayer(PreNormDecoderLayer):
    """One DeepSeek decoder layer: `input_layernorm -> self_attn (MLA) -> post_attention_layernorm ->
    mlp` (a DeepseekMoE on sparse layers, see `is_moe_layer`, else a dense SwiGLU MLP).

    :param config: the HF DeepSeek config.
    :param layer_id: the layer's index in the checkpoint (decides dense vs MoE).
    :param quant_method: passed to every linear and the routed experts (kv_b_proj stays float).
    :param prefix: the layer's parameter-name prefix (`model.layers.{layer_id}`), for messages.
    :param v3: V3 routing (sigmoid, correction bias); default: from `config.model_type`.
    :param attn_layer_id: index into the LatentKVPool (default `layer_id`; a drafter with its own
        pool passes its own).

    `forward(positions, hidden, residual, batch) -> (hidden, residual)` is `PreNormDecoderLayer`'s,
    with the residual add fused into the norms (residual None on the first layer)."""

    def __init__(self, config, layer_id: int, quant_method: QuantMethod | None = None, prefix: str = "", *,
                 v3: bool | None = None, attn_layer_id: int | None = None) -> None:
        check_activation(config)
        v3 = uses_v3_routing(config) if v3 is None else v3
        prefix = prefix or f"model.layers.{layer_id}"
        self_attn = DeepseekAttention(config, layer_id if attn_layer_id is None else attn_layer_id,
                                      quant_method, keep_kv_a_unquantized=_kv_a_needs_float(config, quant_method),
                                      rope_interleave=True if not v3 else None)
        if is_moe_layer(config, layer_id):
            mlp = DeepseekMoE(config, quant_method, sigmoid_noaux=v3, prefix=f"{prefix}.mlp")
        else:
            mlp = DeepseekMLP(config.hidden_size, config.intermediate_size, quant_method,
                              bias=bool(getattr(config, "mlp_bias", False)))
        super().__init__(self_attn, mlp, RMSNorm(config.hidden_size, config.rms_norm_eps),
                         RMSNorm(config.hidden_size, config.rms_norm_eps))


class DeepseekV2ForCausalLM(DecoderOnlyCausalLM):
    """DeepSeek-V2 / V2-Lite (softmax routing); DeepseekV3ForCausalLM flips `v3_routing`.

    The shell (embedding, layers, norm, head, hidden-state capture the MTP drafter reads) is
    `DecoderOnlyCausalLM`'s; this class adds the latent-attention declaration and, at load, the
    skipping of MTP layers and the dequantization of FP8 weights of float modules (kv_b_proj)."""

    attention_type = "latent"
    supports_tensor_parallel = False  # MLA heads and experts are not sharded yet: tp_size > 1 is refused
    v3_routing = False
    stacked_params_mapping = STACKED  # q_proj is MLA's own (no fused qkv): only gate/up are stacked
    expert_names = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, config, quant_method: QuantMethod | None = None, prefix: str = "",
                 tp_group: TPGroup | None = None) -> None:
        super().__init__(config, quant_method, prefix, tp_group)
        block = getattr(quant_method, "block_size", None) or (128, 128)
        self._fp8_block = (int(block[0]), int(block[1]))

    def build_layer(self, config, layer_id: int, quant_method: QuantMethod | None, tp: TPGroup) -> nn.Module:
        return DeepseekDecoderLayer(config, layer_id, quant_method, f"model.layers.{layer_id}", v3=self.v3_routing)

    def rename_checkpoint_name(self, name: str) -> str:
        for hf, ours in RENAMED:
            if name.endswith(hf):
                return name[: -len(hf)] + ours
        return name

    def latent_attention_dims(self) -> LatentAttentionDims:
        return latent_dims(self.config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        fp8_to_float = FP8ToFloatLoader(dict(self.named_parameters()), self._fp8_block)
        dequantized: set[str] = set()
        skipped_extra_layers = 0
        num_layers = self.config.num_hidden_layers

        def target_tensors() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal skipped_extra_layers
            for name, tensor in weights:
                if name.endswith(self.skip_checkpoint_suffixes):
                    continue
                layer = checkpoint_layer(name)
                if layer is not None and layer >= num_layers:
                    # DeepSeek-V3's multi-token-prediction layer(s) `model.layers.{num_hidden_layers}.*`:
                    # the MTP drafter (plugins/speculative/mtp) loads them, the target model does not
                    skipped_extra_layers += 1
                    continue
                taken, done = fp8_to_float.offer(name, tensor)
                if done is not None:
                    dequantized.add(done)
                if not taken:
                    yield name, tensor

        loaded = super().load_weights(target_tensors()) | dequantized
        fp8_to_float.check_complete()
        if skipped_extra_layers:
            logger.info("skipped %d tensors of layers >= num_hidden_layers=%d (multi-token prediction; the MTP "
                        "drafter loads them)", skipped_extra_layers, num_layers)
        return loaded


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 (sigmoid routing with `e_score_correction_bias`, grouped top-k)."""

    v3_routing = True
