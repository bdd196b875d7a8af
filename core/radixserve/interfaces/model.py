"""Model: one model family's module structure and weight-name mapping."""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch.nn as nn

if TYPE_CHECKING:
    import torch

    from radixserve.interfaces.latent_attention import LatentAttentionDims
    from radixserve.interfaces.quantization import QuantMethod
    from radixserve.state import ForwardBatch



def head_dim_of(config) -> int:
    """The attention head size of an HF config: `head_dim`, or `hidden_size // num_attention_heads`
    where the config has none. Added in plugin API 1.4 (`radixserve.layers.decoder_blocks.head_dim_of`)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def attention_dims_of(config) -> tuple[int, int, int, int]:
    """`(num_layers, num_heads, num_kv_heads, head_dim)` of an HF config, as the runner sizes the KV pool
    when `Model.attention_dims()` is None: `num_key_value_heads` or, where the config has none (a
    multi-head model such as GPT-NeoX), `num_attention_heads`; `head_dim_of` for the head size."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return config.num_hidden_layers, heads, kv_heads, head_dim_of(config)

class Model(nn.Module, abc.ABC):
    """A causal LM, registered under its HF `architectures` name (e.g. "LlamaForCausalLM").

    Contract:
    - `__init__(self, config, quant_method=None, prefix="", tp_group=None)`: the loader calls
      `ModelCls(config, quant_method)`, adding the keyword `tp_group=` only for a model with
      `supports_tensor_parallel = True` running with `runtime.tp_size > 1` (see below); the core
      never passes `prefix`. `config` is the HF `PretrainedConfig`; `quant_method` is a
      QuantMethod (None: unquantized) that every linear layer passes to `radixserve.layers.linear`.
      Call `super().__init__(config, quant_method, prefix)`. Parameters are created on the
      current default device and dtype (the loader sets both); no weights are read here.
    - `forward(input_ids, positions, batch)` returns the final hidden states [num_tokens, hidden]
      (after the final norm). Attention goes through `radixserve.layers.attention.RadixAttention`,
      which calls `batch.attn_backend`. The runner applies `compute_logits` to the rows it needs.
    - `compute_logits(hidden)` returns fp32 logits [rows, vocab] (the LM head, tied or not).
    - `load_weights(weights)` consumes (HF name, tensor) pairs, maps names to its parameters and
      calls each parameter's `weight_loader(param, tensor, shard_id)` (see
      `radixserve.layers.weight_utils`); it returns the set of parameter names it loaded so the
      loader can report parameters left uninitialised (a fused parameter only once every shard
      arrived).

    The layers a model may reuse (`radixserve.layers`: linear, embedding, norm, rotary,
    activation, attention, logits) and the weight-loading rules are in docs/contracts.md.
    Check a model with `radixserve.testing.check_model_parity(MyModel, checkpoint_dir)`.

    Tensor parallelism (plugin API 1.3): a model with `supports_tensor_parallel = True` also
    takes `tp_group` (a `radixserve.layers.distributed.TPGroup`) as a keyword argument when
    `runtime.tp_size > 1`, and passes it to every parallel layer it builds (`tp_group=`), so each
    rank holds its shard and the layers run their collectives over it. `forward` returns the full
    hidden state on every rank; `compute_logits` the full vocabulary on every rank.

    Added in plugin API 1.0.
    """

    supports_tensor_parallel: bool = False
    """Class flag: the constructor takes `tp_group` and the model shards itself over it (see above).
    A tp_size > 1 config serving a model that leaves it False is refused, naming the
    architecture. Added in plugin API 1.3."""

    @abc.abstractmethod
    def __init__(self, config, quant_method: QuantMethod | None = None, prefix: str = "", tp_group=None) -> None:
        super().__init__()

    @abc.abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states after the final norm, one row per input token.

        :param input_ids: int64 `[num_tokens]`, the new tokens of every request, packed.
        :param positions: int64 `[num_tokens]`, each token's position in its sequence (a request
            with a cached prefix of p tokens starts at p).
        :param batch: pass it to every `RadixAttention` call; do not read the KV pool directly.
        :return: `[num_tokens, hidden_size]` in the model's dtype.

        Added in plugin API 1.0.
        """

    @abc.abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[rows, vocab]` for the given hidden rows (the runner passes the last
        token's row of each request; columns past the tokenizer's vocabulary are cut by it).

        Added in plugin API 1.0.
        """

    def greedy_token_ids(self, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Optional fast path for greedy sampling: int64 [rows], for each hidden row the argmax of
        `compute_logits(hidden)[:, :vocab_size]` (first index on ties, as torch.argmax), computed
        without materialising the logits; or None to let the runner compute the logits (the
        default). The runner only asks when nothing else reads the logits (every row greedy, no
        logprobs, penalties, logit bias or banned tokens).

        Added in plugin API 1.1.
        """
        return None

    @classmethod
    def context_limit(cls, hf_config: Any) -> tuple[int, str] | None:
        """The longest context (tokens) this model class computes exactly for `hf_config`, and why,
        when that is less than its positions cover; None (the default): no such limit. The runner
        then serves at most that many tokens: a `model.context_length` above it is a start-up error
        quoting the reason, and with none given the context is capped at it (logged as a WARNING).

        Called once, before the weights are loaded (no instance yet). Added in plugin API 1.16.
        """
        return None

    def attention_dims(self) -> tuple[int, int, int, int] | None:
        """The KV-cache shape this model's attention layers use, when the HF config cannot be read
        for it: `(num_layers, num_heads, num_kv_heads, head_dim)`; the runner then sizes the KV
        pool and the attention backend from it (one buffer pair per layer id `0..num_layers-1`).
        Default None: taken from the config (`num_hidden_layers`, `num_attention_heads`,
        `num_key_value_heads`, `head_dim` or `hidden_size // num_attention_heads`).

        Called once, after the weights are loaded. Added in plugin API 1.3.
        """
        return None

    attention_type: str = "standard"
    """Class attribute: which KV memory the model's attention layers use. "standard": per-head K and
    V (`KVPool`, `RadixAttention`). "latent": multi-head latent attention (MLA) with one compressed
    row per token (`LatentKVPool`, `radixserve.layers.latent_attention.RadixLatentAttention`); the
    model then implements `latent_attention_dims`, and only a backend with
    `supports_latent_attention` may serve it. The runner picks the pool from this declaration, never
    from the architecture name. Added in plugin API 1.4."""

    def latent_attention_dims(self) -> LatentAttentionDims:
        """The latent-attention shape on this rank (`radixserve.interfaces.LatentAttentionDims`).
        Only called when `attention_type == "latent"`, once, after the weights are loaded.

        Added in plugin API 1.4.
        """
        raise NotImplementedError(f"{type(self).__name__} declares no latent attention")

    # ---- hidden-state capture (for drafters such as EAGLE) ------------------------------------
    supports_aux_hidden_states: bool = False
    """Class flag: the model implements `set_aux_hidden_state_layers` and `embed_input_ids`.
    Added in plugin API 1.1."""

    aux_hidden_states: list[torch.Tensor] | None = None
    """After a `forward` with capture on: one `[num_tokens, hidden]` tensor per requested layer, in
    the requested order (the residual stream after that decoder layer, before the next layer's
    input norm). None when capture is off. The runner reads it right after `forward`.
    Added in plugin API 1.1."""

    def set_aux_hidden_state_layers(self, layer_ids: tuple[int, ...]) -> None:
        """Capture, on every later `forward`, the residual stream after each decoder layer in
        `layer_ids` (0-based) into `aux_hidden_states`; `()` turns capture off (then `forward`
        must cost nothing extra). Only called when `supports_aux_hidden_states` is True.

        Added in plugin API 1.1.
        """
        raise NotImplementedError(f"{type(self).__name__} does not capture intermediate hidden states")

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings `[n, hidden]` the model's first layer reads for `input_ids` (a
        draft model that shares the target's embedding uses it). Only called when
        `supports_aux_hidden_states` is True.

        Added in plugin API 1.1.
        """
        raise NotImplementedError(f"{type(self).__name__} does not expose its input embedding")

    @abc.abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named weights; return the names of parameters that received data.

        :param weights: (HF checkpoint name, full unsharded tensor) pairs, any order, each once.
        :return: names (as in `named_parameters()`) of the parameters loaded; the loader raises
            ValueError naming any parameter missing from it. Leave out a fused parameter (q/k/v,
            gate/up, stacked experts) some of whose shards never arrived, or raise naming them.

        Restrictions: load through each parameter's `weight_loader(param, tensor[, shard_id])`
        (`radixserve.layers.weight_utils.load_into` does it): it knows the TP shard and the fused
        layout. Raise ValueError (or KeyError) naming a checkpoint tensor that maps to no parameter
        or whose shape does not fit (`weight_utils.load_stacked_weights` raises
        `CheckpointTensorError`, a ValueError, for both); the loader reports either as one
        ValueError that adds the checkpoint path and file.

        Added in plugin API 1.0.
        """
