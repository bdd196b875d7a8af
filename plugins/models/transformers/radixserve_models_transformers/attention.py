"""The attention function RadixServe registers with transformers' `AttentionInterface`.

A transformers model built with `attn_implementation="radixserve"` calls `radixserve_attention`
from every attention module instead of sdpa/eager. The model is run on one flattened sequence (a
batch of size 1 holding every request's new tokens back to back, with explicit positions), so
query/key/value arrive as `[1, heads, num_tokens, head_dim]`. The function reshapes them to the
packed layout RadixServe's backends take and calls `batch.attn_backend` through the module's
`RadixAttention` layer, the same path a native model takes: the backend stores K/V in the KV pool
and attends over each request's cached prefix.

Two modes:
- probing (once, at construction, inside `Probing(ctx)`): record each module's shapes and arguments
  in call order (that order gives the layer ids) and return zeros; nothing touches a KV pool;
- serving: each module carries an `AttentionBinding` (its `RadixAttention` and the model's
  `ForwardContext`, which holds the `ForwardBatch` of the forward in flight).

Graph safety: everything below branches only on Python values fixed at construction (shapes,
flags), never on tensor contents, and does no host/device synchronisation, so a decode forward can
be captured in a CUDA graph."""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from radixserve.layers.attention import RadixAttention

if TYPE_CHECKING:
    from radixserve.state import ForwardBatch

ATTN_IMPLEMENTATION = "radixserve"
_probing = threading.local()  # .ctx: the ForwardContext of a probe running on this thread

# keyword arguments models pass that do not change the math of causal attention at inference
_HARMLESS_KWARGS = frozenset({
    "dropout", "scaling", "position_ids", "cache_position", "use_cache", "output_attentions", "layer_idx",
    "past_key_values", "past_key_value", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
    "position_embeddings", "sliding_window", "softcap", "is_causal", "return_dict", "output_hidden_states",
})
# arguments that change the scores in a way the backends cannot express
_UNSUPPORTED_KWARGS = {
    "s_aux": "attention sinks (s_aux)",
    "sinks": "attention sinks",
    "position_bias": "an additive position bias (position_bias)",
    "alibi": "ALiBi position biases",
    "head_mask": "a head mask",
}


class UnsupportedModelError(ValueError):
    """The architecture uses a feature the fallback cannot run on RadixServe's attention backends;
    the message names the feature. `feature` is a short tag the parity sweep uses to classify."""

    def __init__(self, message: str, feature: str) -> None:
        super().__init__(message)
        self.feature = feature


@dataclass
class LayerCall:
    """What one attention module passed on its (first) probing call."""

    num_heads: int
    num_kv_heads: int
    qk_dim: int
    v_dim: int
    scaling: float | None
    sliding_window: int | None
    softcap: float | None
    unsupported: list[str] = field(default_factory=list)


@dataclass
class AttentionBinding:
    """Attached to an HF attention module (`module._radixserve`): its context and one layer per
    call it makes in a forward (a module that attends twice, like DiffLlama's, gets two layer ids)."""

    ctx: ForwardContext
    layers: list[RadixAttention]
    head_dim: int  # the pool's head size (q/k/v narrower than it are zero-padded)
    qk_dim: int
    v_dim: int
    next: int = 0  # calls made in the current forward (reset by the model at each forward)


class ForwardContext:
    """Shared by one model's attention modules: the forward in flight, and the probe's records."""

    def __init__(self) -> None:
        self.batch: ForwardBatch | None = None
        self.positions: torch.Tensor | None = None  # [num_tokens] of the forward in flight (probe included)
        self.bindings: list[AttentionBinding] = []
        self.calls: list[tuple[torch.nn.Module, LayerCall]] = []  # the first probing forward, in call order
        self.call_order: list[int] | None = None  # id(module) per call of the first probing forward
        self.current: list[int] = []  # id(module) per call of the probing forward in progress
        self.inconsistent = False  # a later probing forward called the modules in another order
        self.last_token_qkv: list[torch.Tensor] = []  # current probing forward: the last token's q, k, v per call

    def start_forward(self) -> None:
        for b in self.bindings:
            b.next = 0


def radixserve_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention-function signature: returns (`[1, num_tokens, heads, v_dim]`, None).

    The attention mask transformers would build is not needed (the backend applies causal masking
    per request) and is ignored."""
    probe_ctx = getattr(_probing, "ctx", None)
    if probe_ctx is not None:
        return _probe(probe_ctx, module, query, key, value, scaling, sliding_window, softcap, kwargs)
    binding: AttentionBinding | None = getattr(module, "_radixserve", None)
    if binding is None:
        raise RuntimeError(
            f"{type(module).__name__} called the RadixServe attention function but belongs to no RadixServe "
            "model (build it with radixserve_models_transformers.model.TransformersForCausalLM)"
        )
    batch = binding.ctx.batch
    if batch is None:
        raise RuntimeError("the RadixServe attention function ran outside a RadixServe forward")
    layer = binding.layers[binding.next]
    binding.next += 1
    return _attend(binding, layer, query, key, value, scaling, batch)


def _attend(binding: AttentionBinding, layer: RadixAttention, query, key, value, scaling, batch):
    if scaling is not None and not isinstance(scaling, torch.Tensor):
        layer.scaling = float(scaling)  # a Python number: no sync
    n = query.shape[2]
    d = binding.head_dim
    q = _packed(query, n, binding.qk_dim, d)
    k = _packed(key, n, binding.qk_dim, d)
    v = _packed(value, n, binding.v_dim, d)
    out = layer(q, k, v, batch).view(n, layer.num_heads, d)
    if binding.v_dim != d:
        out = out[..., : binding.v_dim]
    return out.unsqueeze(0), None


def _packed(x: torch.Tensor, n: int, dim: int, pool_dim: int) -> torch.Tensor:
    """`[1, heads, n, dim]` -> `[n, heads * pool_dim]`, zero-padding the head size to the pool's."""
    x = x[0].transpose(0, 1)
    if dim != pool_dim:  # zeros add nothing to q.k and come out as columns the caller drops
        x = torch.nn.functional.pad(x, (0, pool_dim - dim))
    return x.reshape(n, -1)


def _probe(ctx: ForwardContext, module, query, key, value, scaling, sliding_window, softcap, kwargs):
    ctx.last_token_qkv += [t[0, :, -1].detach().clone() for t in (query, key, value)]
    ctx.current.append(id(module))
    if ctx.call_order is None:
        unsupported = [desc for name, desc in _UNSUPPORTED_KWARGS.items() if kwargs.get(name) is not None]
        if kwargs.get("is_causal") is False or (kwargs.get("is_causal") is None and not getattr(module, "is_causal", True)):
            unsupported.append("bidirectional (non-causal) attention")
        unsupported += [f"attention argument {name!r}" for name, v in kwargs.items()
                        if name not in _HARMLESS_KWARGS and name not in _UNSUPPORTED_KWARGS
                        and isinstance(v, torch.Tensor)]
        if query.shape[0] != 1 or key.shape[2] != query.shape[2]:
            unsupported.append("attention whose keys are not the layer's own new tokens (cross or cached attention "
                               f"inside the model: query {tuple(query.shape)}, key {tuple(key.shape)})")
        ctx.calls.append((module, LayerCall(
            num_heads=int(query.shape[1]), num_kv_heads=int(key.shape[1]), qk_dim=int(query.shape[-1]),
            v_dim=int(value.shape[-1]), scaling=None if scaling is None else float(scaling),
            sliding_window=None if sliding_window is None else int(sliding_window),
            softcap=None if softcap is None else float(softcap), unsupported=unsupported,
        )))
    out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])
    return out, None


class Probing:
    """Context manager: attention calls on this thread record into `ctx` (see `_probe`) instead of
    attending; the modules need no binding yet (the probe is how they are found)."""

    def __init__(self, ctx: ForwardContext) -> None:
        self.ctx = ctx

    def __enter__(self) -> ForwardContext:
        self.ctx.current = []
        self.ctx.last_token_qkv = []
        _probing.ctx = self.ctx
        return self.ctx

    def __exit__(self, *exc) -> None:
        _probing.ctx = None
        if self.ctx.call_order is None:
            self.ctx.call_order = self.ctx.current
        elif self.ctx.current != self.ctx.call_order:
            self.ctx.inconsistent = True


def _layer_accepts(name: str) -> bool:
    return name in inspect.signature(RadixAttention.__init__).parameters


def bind_layers(ctx: ForwardContext, max_context: int | None) -> tuple[int, int, int, int]:
    """After the probing forwards: give every attention call its RadixAttention (layer ids in call
    order; a module called twice per forward gets two) and return the KV-cache shape `(num_layers, num_heads, num_kv_heads, head_dim)`.

    :param max_context: the longest context the runner may serve without window support (the
        config's `sliding_window`, which the runner caps the context to), or None.
    Raises UnsupportedModelError naming what the backends cannot run."""
    if not ctx.calls:
        raise UnsupportedModelError(
            "the model never called transformers' attention interface (it has no attention layers, or hand-written "
            "attention that does not go through ALL_ATTENTION_FUNCTIONS)",
            "no-attention-interface",
        )
    if ctx.inconsistent:
        raise UnsupportedModelError("the model calls its attention modules in an order that depends on the input",
                                    "data-dependent-layers")
    calls = [c for _, c in ctx.calls]
    for c in calls:
        if c.unsupported:
            raise UnsupportedModelError(f"the model's attention uses {c.unsupported[0]}", "attention-feature")
    shapes = {(c.num_heads, c.num_kv_heads, c.qk_dim, c.v_dim) for c in calls}
    if len(shapes) != 1:
        raise UnsupportedModelError(
            f"attention layers differ in shape (heads, kv heads, qk dim, v dim): {sorted(shapes)}; the KV pool "
            "holds one shape for every layer", "per-layer-attention-shapes")
    heads, kv_heads, qk_dim, v_dim = shapes.pop()
    if heads % kv_heads:
        raise UnsupportedModelError(f"{heads} query heads are not a multiple of {kv_heads} KV heads", "gqa-shape")
    head_dim = max(qk_dim, v_dim)
    window_ok, softcap_ok = _layer_accepts("sliding_window"), _layer_accepts("logit_cap")
    per_module: dict[int, AttentionBinding] = {}
    for layer_id, (module, c) in enumerate(ctx.calls):
        extra: dict[str, Any] = {}
        if c.softcap is not None:
            if not softcap_ok:
                raise UnsupportedModelError(
                    f"attention logit soft-capping (softcap={c.softcap}) is not supported by RadixServe's attention "
                    "layer yet", "attention-softcap")
            extra["logit_cap"] = c.softcap
        if c.sliding_window is not None:
            if window_ok:
                extra["sliding_window"] = c.sliding_window
            elif max_context is None or max_context > c.sliding_window:
                raise UnsupportedModelError(
                    f"layer {layer_id} attends over a sliding window of {c.sliding_window} tokens; RadixServe's "
                    "attention layer has no window support yet and the config gives no `sliding_window` to cap "
                    "the context to", "sliding-window")
        scaling = c.scaling if c.scaling is not None else qk_dim**-0.5
        layer = RadixAttention(layer_id, heads, kv_heads, head_dim, scaling, **extra)
        binding = per_module.get(id(module))
        if binding is None:
            binding = per_module[id(module)] = AttentionBinding(ctx, [], head_dim, qk_dim, v_dim)
            module._radixserve = binding
            ctx.bindings.append(binding)
        binding.layers.append(layer)
    return len(calls), heads, kv_heads, head_dim


def register() -> None:
    """Make `attn_implementation="radixserve"` valid in transformers (idempotent). No mask function
    is registered on purpose: for an implementation without one, transformers builds no mask."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, radixserve_attention)
