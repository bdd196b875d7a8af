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
    "indices": "sparse attention over top-k keys chosen by an indexer (DeepSeek sparse attention)",
}
MASKED_IMPLEMENTATION = "radixserve_masked"  # the same function, with transformers' causal mask built


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
    key_bias: bool = False  # the model passes a per-key additive score bias as its attention mask
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
    key_bias: bool = False  # q gets a column of ones and k the bias / scaling (see `_attend`)
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

    The causal mask transformers builds (for models that read it themselves) is not needed (the
    backend applies causal masking per request) and is ignored; a per-key score bias the model
    passes as its mask (Doge's dynamic mask) is applied (found by the probe, see `_mask_kind`)."""
    probe_ctx = getattr(_probing, "ctx", None)
    if probe_ctx is not None:
        return _probe(probe_ctx, module, query, key, value, attention_mask, scaling, sliding_window, softcap, kwargs)
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
    return _attend(binding, layer, query, key, value, scaling, batch, attention_mask)


def _attend(binding: AttentionBinding, layer: RadixAttention, query, key, value, scaling, batch, mask=None):
    if scaling is not None and not isinstance(scaling, torch.Tensor):
        layer.scaling = float(scaling)  # a Python number: no sync
    n = query.shape[2]
    d = binding.head_dim
    if binding.key_bias:
        # scaling * (q . k + 1 * bias / scaling) = scaling * q . k + bias: the bias travels in the KV pool
        bias = _key_bias(mask, layer.num_kv_heads)  # [n, kv heads]
        q = _packed(query, n, binding.qk_dim, d, extra=1.0)
        k = _packed(key, n, binding.qk_dim, d, extra=bias / layer.scaling)
    else:
        q = _packed(query, n, binding.qk_dim, d)
        k = _packed(key, n, binding.qk_dim, d)
    v = _packed(value, n, binding.v_dim, d)
    out = layer(q, k, v, batch).view(n, layer.num_heads, d)
    if binding.v_dim != d:
        out = out[..., : binding.v_dim]
    return out.unsqueeze(0), None


def _packed(x: torch.Tensor, n: int, dim: int, pool_dim: int, extra=None) -> torch.Tensor:
    """`[1, heads, n, dim]` -> `[n, heads * pool_dim]`, zero-padding the head size to the pool's;
    `extra` (a number or `[n, heads]`), when given, fills column `dim`."""
    x = x[0].transpose(0, 1)
    if dim != pool_dim:  # zeros add nothing to q.k and come out as columns the caller drops
        x = torch.nn.functional.pad(x, (0, pool_dim - dim))
    if extra is not None:
        x[..., dim] = extra
    return x.reshape(n, -1)


def _key_bias(mask: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The per-key bias of a mask `[1, heads or 1, queries, keys]` whose rows are all equal and
    whose heads repeat per KV group (checked by the probe): `[keys, kv_heads]`."""
    last = mask[0, :, -1, :]  # [heads or 1, keys]
    if last.shape[0] != 1:
        last = last[:: last.shape[0] // kv_heads]
    return last.expand(kv_heads, -1).transpose(0, 1).float()


def _mask_kind(mask, heads: int, kv_heads: int) -> str | None:
    """What an attention mask the probe sees means: None (absent, or the causal mask transformers
    builds for a model that reads it: ignorable), "key_bias" (a finite bias per head and key, the
    same for every query: appliable), else the description of a mask the backends cannot apply."""
    if not isinstance(mask, torch.Tensor):
        return None
    if mask.ndim != 4 or mask.shape[0] != 1:
        return f"an attention mask of shape {tuple(mask.shape)} built by the model"
    q_len, k_len = mask.shape[-2:]
    causal = torch.ones(q_len, k_len, dtype=torch.bool, device=mask.device).tril(k_len - q_len)
    if mask.dtype == torch.bool:
        if bool((mask == causal).all()):
            return None
        return "a boolean attention mask built by the model that is not causal"
    low = torch.finfo(mask.dtype).min / 2
    if bool(torch.where(causal, mask == 0, mask <= low).all()):
        return None
    if bool((mask > low).all()) and bool(torch.isfinite(mask).all()) and mask.shape[1] in (1, heads):
        same_rows = torch.equal(mask, mask[:, :, -1:, :].expand_as(mask))
        grouped = mask.shape[1] == 1 or torch.equal(
            mask, mask[:, :: heads // kv_heads].repeat_interleave(heads // kv_heads, dim=1))
        if same_rows and grouped:
            return "key_bias"
    return "an attention mask or score bias built by the model that is not a per-key bias"


def _probe(ctx: ForwardContext, module, query, key, value, mask, scaling, sliding_window, softcap, kwargs):
    ctx.last_token_qkv += [t[0, :, -1].detach().clone() for t in (query, key, value)]
    ctx.current.append(id(module))
    if ctx.call_order is None:
        unsupported = [desc for name, desc in _UNSUPPORTED_KWARGS.items() if kwargs.get(name) is not None]
        mask_kind = _mask_kind(mask, int(query.shape[1]), int(key.shape[1]))
        if mask_kind not in (None, "key_bias"):
            unsupported.append(mask_kind)
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
            softcap=None if softcap is None else float(softcap), key_bias=mask_kind == "key_bias",
            unsupported=unsupported,
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
    key_bias = any(c.key_bias for c in calls)
    head_dim = max(qk_dim + key_bias, v_dim)  # one more q/k column carries a per-key bias
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
            binding = per_module[id(module)] = AttentionBinding(ctx, [], head_dim, qk_dim, v_dim, c.key_bias)
            module._radixserve = binding
            ctx.bindings.append(binding)
        binding.layers.append(layer)
    return len(calls), heads, kv_heads, head_dim


def register() -> None:
    """Make `attn_implementation="radixserve"` valid in transformers (idempotent). No mask function
    is registered for it on purpose: for an implementation without one, transformers builds no mask.
    `"radixserve_masked"` is the same attention with transformers' eager causal mask built, for the
    models whose own code reads the mask (the model switches to it when a probe needs it)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, radixserve_attention)
    # for models that read the mask outside attention (DSA indexers, MPT): transformers' float causal mask
    AttentionInterface.register(MASKED_IMPLEMENTATION, radixserve_attention)
    AttentionMaskInterface.register(MASKED_IMPLEMENTATION, eager_mask)
