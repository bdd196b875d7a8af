"""TransformersForCausalLM: any transformers AutoModelForCausalLM as a RadixServe `Model`.

The HF module tree is built as transformers defines it (`AutoModelForCausalLM.from_config`) with
`attn_implementation="radixserve"`, so its attention modules call RadixServe's attention backends
(see attention.py). A forward runs the HF base model on one flattened sequence: every request's
new tokens back to back, `position_ids` giving each token's position in its own request, the HF
cache off (`use_cache=False`): the KV pool is the only cache. The LM head (plus the logit
post-processing the config asks for) is `compute_logits`.

At construction a probing forward of two tokens finds the attention modules (in call order: their
layer ids), their shapes (the KV-cache shape the runner reads from `attention_dims`) and whether
`compute_logits` reproduces the model's own logits; anything the backends cannot run is an
`UnsupportedModelError` naming the feature, before any weight is read."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable

import torch
from radixserve.interfaces.model import Model
from radixserve.interfaces.quantization import QuantMethod
from radixserve.state import ForwardBatch

from radixserve_models_transformers import attention
from radixserve_models_transformers.attention import ForwardContext, Probing, UnsupportedModelError
from radixserve_models_transformers.fused import fuse_modules
from radixserve_models_transformers.weights import load_hf_weights

logger = logging.getLogger(__name__)


class TransformersForCausalLM(Model):
    """The transformers fallback (registered as model component "transformers").

    Restrictions: unquantized weights only; attention must go through transformers'
    attention interface with every layer of one shape (see docs/transformers-fallback.md)."""

    def __init__(self, config, quant_method: QuantMethod | None = None, prefix: str = "") -> None:
        if hasattr(config, "to_transformers"):  # a weight source's plain config (GGUF): the real one
            config = config.to_transformers()
        try:
            self._construct(config, quant_method, prefix)
        except UnsupportedModelError as e:  # say which model and which component refuses (models audit 30)
            arch = (getattr(config, "architectures", None) or [type(config).__name__])[0]
            raise UnsupportedModelError(f"{arch}: the transformers fallback (radixserve-models-transformers) cannot "
                                        f"run it: {e} (see the limits in docs/transformers-fallback.md)", e.feature) from None

    @classmethod
    def context_limit(cls, hf_config) -> tuple[int, str] | None:
        """Llama 4's chunked attention (`attention_chunk_size`): transformers builds it into masks the
        fallback does not read, so it is exact only while a context fits one chunk (models audit 32:
        a 114-token prompt past a 64-token chunk gave wrong tokens in silence)."""
        config = hf_config.to_transformers() if hasattr(hf_config, "to_transformers") else hf_config
        config = getattr(config, "get_text_config", lambda: config)()
        chunk = getattr(config, "attention_chunk_size", None)
        if isinstance(chunk, int) and chunk > 0:
            return chunk, ("the transformers fallback runs its chunked attention (attention_chunk_size) as full "
                           "causal attention, exact only within one chunk")
        return None

    def _construct(self, config, quant_method: QuantMethod | None, prefix: str) -> None:
        super().__init__(config, quant_method, prefix)
        _check_unquantized(config, quant_method)
        attention.register()
        self.config = config
        self.hf = _build(config)
        # known modules -> fused layers, each checked against the module it replaces (fused.py)
        fusion = fuse_modules(self.hf)
        self._shards = fusion.shards
        logger.info("transformers fallback %s: %s", type(self.hf).__name__, fusion.summary())
        self.ctx = ForwardContext()
        head = self.hf.get_output_embeddings()
        if head is None or not _base_candidates(self.hf):
            raise UnsupportedModelError(
                f"{type(self.hf).__name__} has no separate base model and LM head to run apart", "model-layout")
        # plain attributes, not submodules: the parameters stay named as in the HF model under `hf.`
        object.__setattr__(self, "_head", head)
        object.__setattr__(self, "_base", None)  # set by the probe
        self._position_offset = 0  # added to positions (set by the probe)
        self._head_via_hf = False  # True: compute_logits runs the HF model's own head path
        self._softcap = getattr(config, "final_logit_softcapping", None)
        self._logit_mul = _logit_multiplier(config)
        _route_positions(self.hf, self.ctx)
        self._dims = self._probe()

    # ---- the Model contract -----------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        self.ctx.batch = batch
        self.ctx.start_forward()
        try:
            if self._position_offset:
                positions = positions + self._position_offset
            self.ctx.positions = positions
            out = self._base(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0),
                             use_cache=False, return_dict=True)
        finally:
            self.ctx.batch = self.ctx.positions = None
        if getattr(self, "_aux_order", ()):
            self.aux_hidden_states = [self._aux_captured[i] for i in self._aux_order]
        return _last_hidden(out)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._head_via_hf:
            return self._logits_via_hf(hidden)
        logits = self._head(hidden).float()
        if self._logit_mul is not None:
            logits = logits * self._logit_mul
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    def _logits_via_hf(self, hidden: torch.Tensor) -> torch.Tensor:
        """The causal LM's own forward with its base model standing in for a module that returns
        `hidden`: exactly the model's head path (an LM head with its own transform, scalings)."""
        self._base_parent._modules[self._base_attr] = _HiddenStates(hidden.unsqueeze(0))
        try:
            ids = torch.zeros(1, hidden.shape[0], dtype=torch.long, device=hidden.device)
            out = self.hf(input_ids=ids, use_cache=False, return_dict=True)
        finally:
            self._base_parent._modules[self._base_attr] = self._base
        return out.logits[0].float()

    def attention_dims(self) -> tuple[int, int, int, int]:
        return self._dims

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = load_hf_weights(self.hf, _without_mtp_layers(weights, self.config), self._shards)
        # said here, by the checkpoint's names: the loader's own check would name them as this module's
        # attributes ("hf.model.layers...")
        missing = sorted(set(dict(self.hf.named_parameters())) - loaded)
        if missing:
            shown = ", ".join(missing[:10]) + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else "")
            raise ValueError(f"left {len(missing)} parameter(s) of {type(self.hf).__name__} unloaded: {shown}")
        return {f"hf.{name}" for name in loaded}

    # ---- hidden-state capture (drafters: EAGLE-3, DeepSeek MTP) ------------------------------
    supports_aux_hidden_states = True

    def set_aux_hidden_state_layers(self, layer_ids: tuple[int, ...]) -> None:
        """Forward hooks on the base model's decoder layers record their outputs (the residual
        stream after each layer); `()` removes them."""
        for h in getattr(self, "_aux_hooks", []):
            h.remove()
        self._aux_hooks, self._aux_order, self._aux_captured = [], tuple(layer_ids), {}
        self.aux_hidden_states = None
        if not layer_ids:
            return
        layers = _decoder_layers(self._base, int(self.config.num_hidden_layers))
        if layers is None:
            raise ValueError(f"{type(self.hf).__name__}: no list of {self.config.num_hidden_layers} decoder layers "
                             "to capture hidden states from")

        def record(_m, _a, out, i):
            self._aux_captured[i] = _last_hidden(out)[0]

        for i in set(layer_ids):
            self._aux_hooks.append(layers[i].register_forward_hook(lambda m, a, out, i=i: record(m, a, out, i)))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The base model's input embedding module (a model that scales embeddings inside its
        forward, as Gemma does, is not scaled here)."""
        return self.hf.get_input_embeddings()(input_ids)

    # ---- construction -----------------------------------------------------------------------
    @torch.no_grad()
    def _probe(self) -> tuple[int, int, int, int]:
        """Probing forwards through the whole HF model, attention recording instead of attending:
        bind the attention modules; check that a token's state depends only on the token and its
        position id (not on other tokens outside attention, nor on its index in the flattened
        sequence); find the position convention (RoBERTa-style models count from an offset); check
        compute_logits against the model's own logits."""
        self._device = next(self.hf.parameters()).device
        try:
            base = self._probe_run([1, 2], [0, 1])  # token 2 at position 1 in the first three runs
        except UnsupportedModelError as e:
            if e.feature != "probe-forward":
                raise
            base = self._probe_with_mask(e)
        other_first = self._probe_run([3, 2], [0, 1])
        alone = self._probe_run([2], [1])
        dims = attention.bind_layers(self.ctx, getattr(self.config, "sliding_window", None))
        _keep_dynamic_masks_dense(self.ctx, self.config)
        if self._device.type == "meta":
            return dims
        if not _same(base[1], other_first[1]):
            raise UnsupportedModelError(
                f"{type(self.hf).__name__} mixes tokens outside attention (recurrent, state-space or convolution "
                "layers keep sequence state the KV pool does not hold)", "sequence-state")
        if not _same(base[1], alone[1]):
            raise UnsupportedModelError(
                f"{type(self.hf).__name__} does not take its positions from position_ids (it counts them from "
                "the start of its input), so a flattened batch would give tokens the wrong positions",
                "ignores-position-ids")
        self._position_offset = self._find_position_offset()
        self._check_logits(base[0], base[2])
        return dims

    def _probe_with_mask(self, first: UnsupportedModelError):
        """The first probe failed: models whose own code reads the attention mask (DSA indexers,
        MPT) get none from the plain implementation; run again with transformers' causal mask
        built ("radixserve_masked"; it costs a [tokens, tokens] mask per forward). If that fails
        too, the first error stands."""
        self.ctx.calls, self.ctx.call_order, self.ctx.inconsistent = [], None, False
        object.__setattr__(self, "_base", None)
        _set_attn_implementation(self.hf, attention.MASKED_IMPLEMENTATION)
        try:
            return self._probe_run([1, 2], [0, 1])
        except UnsupportedModelError as e:
            if e.feature != "probe-forward":
                raise
            raise first from None

    def _probe_run(self, ids: list[int], pos: list[int] | None):
        """One probing forward: (the base model's hidden states, the last token's signature: its
        hidden state and every attention call's q, k, v, the logits)."""
        candidates = _base_candidates(self.hf)
        captured: list[tuple[int, torch.Tensor]] = []  # (candidate index, its output), in completion order
        hooks = [m.register_forward_hook(lambda _m, _a, out, i=i: captured.append((i, _last_hidden(out))))
                 for i, m in enumerate(candidates)]
        kwargs = {} if pos is None else {"position_ids": torch.tensor([pos], device=self._device)}
        self.ctx.positions = None if pos is None else kwargs["position_ids"][0]
        try:
            with Probing(self.ctx):
                out = self.hf(input_ids=torch.tensor([ids], device=self._device), use_cache=False, return_dict=True,
                              **kwargs)
        except UnsupportedModelError:
            raise
        except Exception as e:  # the model cannot run on a flattened batch with explicit positions
            raise UnsupportedModelError(
                f"{type(self.hf).__name__} failed on a probing forward (input_ids + position_ids, no cache): {e!r}",
                "probe-forward") from e
        finally:
            self.ctx.positions = None
            for h in hooks:
                h.remove()
        if not captured:
            raise UnsupportedModelError(f"{type(self.hf).__name__} did not run its base model", "model-layout")
        index, state = min(captured, key=lambda c: c[0])  # the outermost candidate that ran
        if self._base is None:
            object.__setattr__(self, "_base", candidates[index])
            self._base_parent, self._base_attr = _parent_of(self.hf, self._base)
        return state[0], [state[0, -1]] + self.ctx.last_token_qkv, out.logits[0]

    def _find_position_offset(self) -> int:
        """What the model adds to a sequence index to get its position id when it counts them
        itself (0 for most; RoBERTa-style embeddings start after the padding index). Token ids 5, 6
        are not padding in any vocabulary the probe meets."""
        own = self._probe_run([5, 6], None)[1]
        pad = getattr(self.config, "pad_token_id", None)
        for offset in dict.fromkeys([0, 1, 2] + ([pad + 1] if isinstance(pad, int) and 0 <= pad < 64 else [])):
            if _same(own, self._probe_run([5, 6], [offset, offset + 1])[1]):
                return offset
        raise UnsupportedModelError(
            f"{type(self.hf).__name__} numbers positions in a way the fallback cannot reproduce with position_ids",
            "position-convention")

    def _check_logits(self, hidden: torch.Tensor, expected: torch.Tensor) -> None:
        """Use the LM head directly when that gives the model's logits, else its own head path."""
        tol = 1e-4 if hidden.dtype == torch.float32 else 2e-2
        for via_hf in (False, True):
            self._head_via_hf = via_hf
            try:
                ours = self.compute_logits(hidden)
            except RuntimeError:  # e.g. a head whose input is a projection of the hidden state
                continue
            if ours.shape == expected.shape and torch.allclose(ours, expected.float(), rtol=tol, atol=tol):
                return
        raise UnsupportedModelError(
            f"{type(self.hf).__name__}'s logits cannot be computed from the base model's last hidden state",
            "logits-postprocess")


def _set_attn_implementation(hf: torch.nn.Module, name: str) -> None:
    """Point the model (and every sub-config its modules read at call time) at `name`."""
    hf.set_attn_implementation(name)
    for module in hf.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = name


def _keep_dynamic_masks_dense(ctx: ForwardContext, config) -> None:
    """Doge's dynamic mask keeps only the `keep_window_size` keys with the largest bias once a
    forward holds more keys than that. Within one request's context that never happens when the
    window covers `max_position_embeddings`; a flattened batch may hold more tokens than one
    request, so the window is widened for it. A smaller window is real sparsity: refused."""
    max_pos = getattr(config, "max_position_embeddings", None)
    for binding in ctx.bindings:
        if not binding.key_bias:
            continue
        for module, _ in ctx.calls:
            if getattr(module, "_radixserve", None) is not binding:
                continue
            window = getattr(module, "keep_window_size", None)
            if not isinstance(window, int):
                continue
            if not isinstance(max_pos, int) or window < max_pos:
                raise UnsupportedModelError(
                    f"the dynamic attention mask keeps only {window} keys (keep_window_size) of a context up to "
                    f"{max_pos} tokens: sparse attention the backends cannot run", "dynamic-mask-sparsity")
            module.keep_window_size = 1 << 62  # never top-k over a flattened batch


def _route_positions(hf: torch.nn.Module, ctx: ForwardContext) -> None:
    """Decoders of the Bart family count positions from the start of their input and hand them to
    their position-embedding module (`embed_positions(..., position_ids=...)`); inside a RadixServe
    forward that module gets the flattened batch's positions instead (outside one, e.g. when the
    model runs on its own, it is untouched)."""
    import inspect

    for name, module in hf.named_modules():
        if not name.endswith("embed_positions") or "position_ids" not in inspect.signature(module.forward).parameters:
            continue
        original = module.forward

        def forward(*args, _original=original, _sig=inspect.signature(original), **kwargs):
            if ctx.positions is None:
                return _original(*args, **kwargs)
            bound = _sig.bind_partial(*args, **kwargs)  # position_ids may come positionally
            given = bound.arguments.get("position_ids")
            shape = given.shape if isinstance(given, torch.Tensor) else ctx.positions.shape
            bound.arguments["position_ids"] = ctx.positions.reshape(shape)
            return _original(*bound.args, **bound.kwargs)

        module.forward = forward


def _base_candidates(hf) -> list[torch.nn.Module]:
    """Modules that may be what the causal LM runs before its head: the base model under
    `base_model_prefix` and the decoder inside it (BartForCausalLM calls `model.decoder` directly).
    The probe keeps the outermost one that actually ran."""
    out = []
    named = (getattr(hf, hf.base_model_prefix, None), getattr(hf, "model", None), getattr(hf, "transformer", None))
    for m in (*named, hf.get_decoder() if hasattr(hf, "get_decoder") else None):
        if isinstance(m, torch.nn.Module) and m is not hf and all(m is not o for o in out):
            out.append(m)
    return out


def _parent_of(root: torch.nn.Module, module: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    for name, m in root.named_modules():
        if m is module:
            parent, _, attr = name.rpartition(".")
            return root.get_submodule(parent) if parent else root, attr
    raise UnsupportedModelError("the base model is not a submodule of the causal LM", "model-layout")


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    if len(a) != len(b):
        return False
    tol = 1e-5 if a[0].dtype == torch.float32 else 1e-2
    return all(x.shape == y.shape and torch.allclose(x, y, rtol=tol, atol=tol) for x, y in zip(a, b, strict=True))


class _HiddenStates(torch.nn.Module):
    """Stands in for a base model: returns the given hidden states, whatever it is called with."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs):
        from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=self.hidden)


def _check_unquantized(config, quant_method: QuantMethod | None) -> None:
    from radixserve.layers.quant_unquantized import UnquantizedMethod

    if quant_method is not None and not isinstance(quant_method, UnquantizedMethod):
        raise UnsupportedModelError(
            f"it runs unquantized weights only, not {type(quant_method).__name__}", "quantized")


def _build(config) -> torch.nn.Module:
    """The HF causal LM for `config`, on the current default device and dtype."""
    from transformers import AutoModelForCausalLM

    arch = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    config = copy.deepcopy(config)  # from_config writes dtype and the attention implementation into it
    try:
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=attention.ATTN_IMPLEMENTATION, dtype=torch.get_default_dtype()
        )
    except KeyError as e:
        if e.args and e.args[0] == attention.ATTN_IMPLEMENTATION:  # a {implementation: attention class} table
            raise UnsupportedModelError(
                f"{arch} picks its attention class from a fixed table of implementations instead of "
                "transformers' attention interface", "no-attention-interface") from None
        raise
    except ValueError as e:
        if "Unrecognized configuration class" in str(e):
            raise UnsupportedModelError(
                f"{arch} ({config.model_type}) is not a decoder transformers can build with AutoModelForCausalLM, "
                f"so the transformers fallback (model.impl: transformers) cannot run it", "not-causal-lm") from None
        raise
    logger.debug("built %s with attn_implementation=%s", type(model).__name__, attention.ATTN_IMPLEMENTATION)
    named = (getattr(config, "architectures", None) or [None])[0]
    if named is not None:
        _note_built_class(named, type(model).__name__, config.model_type)
    return model.eval()


def _note_built_class(arch: str, built: str, model_type: str) -> None:
    """AutoModelForCausalLM picks the class from `model_type`, not from `architectures`: say so
    when the checkpoint names another class (a WARNING when transformers has no class of that
    name: a plugin's own architecture, whose plugin is gone, runs as transformers' class)."""
    if arch == built:
        return
    import transformers

    unknown = not hasattr(transformers, arch)
    logger.log(logging.WARNING if unknown else logging.INFO,
               "transformers fallback: the checkpoint's architecture %s%s; running %s, the class transformers maps "
               "its model_type %r to", arch, " is not a transformers class" if unknown else "", built, model_type)


def _logit_multiplier(config) -> float | None:
    """Scalar factors some families apply to the LM head's output (Cohere, Granite)."""
    factor = 1.0
    if getattr(config, "logit_scale", None) is not None:
        factor *= float(config.logit_scale)
    if getattr(config, "logits_scaling", None):
        factor /= float(config.logits_scaling)
    return None if factor == 1.0 else factor


def _decoder_layers(base: torch.nn.Module, num_layers: int) -> torch.nn.ModuleList | None:
    """The base model's decoder layers: its `layers`, else its first ModuleList of `num_layers`."""
    layers = getattr(base, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers) == num_layers:
        return layers
    return next((m for m in base.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers), None)


def _without_mtp_layers(weights: Iterable[tuple[str, torch.Tensor]], config) -> Iterable[tuple[str, torch.Tensor]]:
    """Drop the multi-token-prediction layers a DeepSeek-V3-style checkpoint stores after the decoder
    (`model.layers.{num_hidden_layers + i}.*`, `num_nextn_predict_layers` of them): transformers
    builds no module for them; an MTP drafter reads them itself."""
    if not getattr(config, "num_nextn_predict_layers", 0):
        yield from weights
        return
    first = int(config.num_hidden_layers)
    for name, tensor in weights:
        parts = name.split(".")
        if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit() \
                and int(parts[2]) >= first:
            continue
        yield name, tensor


def _last_hidden(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple):
        return out[0]
    return out.last_hidden_state
