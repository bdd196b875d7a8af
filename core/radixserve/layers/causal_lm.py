"""`DecoderOnlyCausalLM`: the shell every HF-style decoder-only model shares, so a model plugin
writes only its decoder layer.

The shell is the HF layout `model.embed_tokens` -> `model.layers[i]` -> `model.norm` ->
`lm_head` (tied to the embedding when the config says so), with the `Model` contract around it:
`forward`, `compute_logits`, `greedy_token_ids`, hidden-state capture for drafters
(`set_aux_hidden_state_layers`, `embed_input_ids`), the TP group threaded to every layer, and
`load_weights` through `radixserve.layers.weight_utils.load_stacked_weights`. The usual pieces of
a layer (`DecoderAttention`, `SwiGLUMLP`, `PreNormDecoderLayer`) are in
`radixserve.layers.decoder_blocks`.

Added in plugin API 1.4."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

from radixserve.interfaces.model import Model
from radixserve.interfaces.quantization import QuantMethod
from radixserve.layers.distributed import TPGroup
from radixserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from radixserve.layers.norm import RMSNorm
from radixserve.layers.weight_utils import RECOMPUTED_BUFFERS, STACKED_QKV_GATE_UP, load_stacked_weights
from radixserve.state import ForwardBatch


class DecoderStack(nn.Module):
    """The `model.` level: embedding, decoder layers, final norm, and the residual-stream capture.

    Each layer is called as `layer(positions, h, residual, batch) -> (h, residual)`: `h` is what the
    previous layer adds to the residual stream `residual` (None before the first layer, and for
    layers that keep the stream in `h` themselves, e.g. OLMo 2: they return `(h, None)`). The final
    norm is called as `norm(h, residual) -> (normed, stream)` when `residual` is set, else `norm(h)`.

    Added in plugin API 1.4.
    """

    def __init__(self, embed_tokens: nn.Module, layers: Iterable[nn.Module], norm: nn.Module,
                 embed_scale: float | None = None) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.embed_scale = embed_scale
        self.aux_layers: frozenset[int] = frozenset()  # layers whose output a drafter asked for
        self.aux_order: tuple[int, ...] = ()
        self.aux_hidden_states: list[torch.Tensor] | None = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """What the first layer reads: the embeddings, times `embed_scale` (rounded to their dtype
        first, as transformers does) when set."""
        h = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        return h

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h, residual = self.embed(input_ids), None
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            h, residual = layer(positions, h, residual, batch)
            if i in self.aux_layers:  # the residual stream after layer i (h + residual, unfused)
                captured[i] = h if residual is None else h + residual
        if self.aux_order:
            self.aux_hidden_states = [captured[i] for i in self.aux_order]
        if residual is None:
            return self.norm(h)
        h, _ = self.norm(h, residual)
        return h


class DecoderOnlyCausalLM(Model):
    """Base class of a decoder-only model plugin: subclass it, implement `build_layer`, register
    the subclass under its HF architecture name. Everything else has a default a subclass may
    override:

    - `build_layer(config, layer_id, quant_method, tp)` (required): one decoder layer following
      the `DecoderStack` calling convention; pass `quant_method` and `tp_group=tp` to its
      parallel linear layers.
    - `build_norm(config)`: the final norm (default `RMSNorm(hidden_size, rms_norm_eps)`).
    - `embed_scale(config)`: a factor on the input embeddings (default None; Gemma: sqrt(hidden)).
    - `stacked_params_mapping`, `expert_names`, `rename_checkpoint_name`: how `load_weights`
      maps checkpoint names (see `load_stacked_weights`).
    - `tie_word_embeddings_default`: used when the config has no `tie_word_embeddings`.
    - `supports_tensor_parallel`: False by default; set True once every layer `build_layer` makes
      shards over `tp` (the embedding and LM head here already do).

    Parameter names are HF's (`model.layers.0.self_attn.qkv_proj.weight`, `lm_head.weight`), so
    checkpoints load without renaming beyond the fused projections. Hidden-state capture for
    drafters (`supports_aux_hidden_states`) works for any layer following the convention.

    Restrictions: the constructor builds `config.num_hidden_layers` layers and reads
    `vocab_size`, `hidden_size` (and `rms_norm_eps` for the default norm) from `config`.

    Added in plugin API 1.4.
    """

    supports_aux_hidden_states = True
    tie_word_embeddings_default: bool = False
    stacked_params_mapping: tuple[tuple[str, str, object], ...] = STACKED_QKV_GATE_UP
    """(checkpoint piece, parameter piece, shard id), see `load_stacked_weights`; `()` when the
    checkpoint already holds the fused matrices."""
    expert_names: tuple[str, str, str] | None = None
    """Checkpoint names of an expert's (gate, up, down) projections when the model has `FusedMoE`
    layers, e.g. `("gate_proj", "up_proj", "down_proj")`; None: no routed experts."""
    skip_checkpoint_suffixes: tuple[str, ...] = RECOMPUTED_BUFFERS

    def __init__(self, config, quant_method: QuantMethod | None = None, prefix: str = "",
                 tp_group: TPGroup | None = None) -> None:
        super().__init__(config, quant_method, prefix)
        self.config = config
        tp = tp_group if tp_group is not None else TPGroup.single()
        self.model = DecoderStack(
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_group=tp),
            (self.build_layer(config, i, quant_method, tp) for i in range(config.num_hidden_layers)),
            self.build_norm(config),
            embed_scale=self.embed_scale(config),
        )
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", self.tie_word_embeddings_default))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_group=tp)
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    # ---- what a family provides --------------------------------------------------------------
    def build_layer(self, config, layer_id: int, quant_method: QuantMethod | None, tp: TPGroup) -> nn.Module:
        """Decoder layer `layer_id`, called as `layer(positions, h, residual, batch) -> (h, residual)`
        (see `DecoderStack`). Called from `__init__`, before `self.model` exists."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_layer")

    def build_norm(self, config) -> nn.Module:
        """The final norm; default `RMSNorm(config.hidden_size, config.rms_norm_eps)`."""
        return RMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed_scale(self, config) -> float | None:
        """A factor applied to the input embeddings, or None (the default)."""
        return None

    def rename_checkpoint_name(self, name: str) -> str:
        """Applied to each checkpoint name before the mapping; default: unchanged."""
        return name

    # ---- the Model contract ------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def greedy_token_ids(self, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        return self.lm_head.greedy_token_ids(hidden, vocab_size)

    def set_aux_hidden_state_layers(self, layer_ids: tuple[int, ...]) -> None:
        self.model.aux_order = tuple(layer_ids)
        self.model.aux_layers = frozenset(layer_ids)
        self.model.aux_hidden_states = None

    @property
    def aux_hidden_states(self) -> list[torch.Tensor] | None:
        return self.model.aux_hidden_states

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_stacked_weights(self, weights, self.stacked_params_mapping,
                                    skip_suffixes=self.skip_checkpoint_suffixes, rename=self.rename_checkpoint_name,
                                    expert_names=self.expert_names)
