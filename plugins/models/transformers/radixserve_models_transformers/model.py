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
from radixserve.plugins.model_select import FALLBACK_DISTRIBUTION
from radixserve.state import ForwardBatch

from radixserve_models_transformers import attention
from radixserve_models_transformers.attention import ForwardContext, Probing, UnsupportedModelError
from radixserve_models_transformers.weights import load_hf_weights

logger = logging.getLogger(__name__)


class TransformersForCausalLM(Model):
    """The transformers fallback (registered as model component "transformers").

    Restrictions: unquantized weights only; attention must go through transformers'
    attention interface with every layer of one shape (see docs/transformers-fallback.md)."""

    def __init__(self, config, quant_method: QuantMethod | None = None, prefix: str = "") -> None:
        super().__init__(config, quant_method, prefix)
        _check_unquantized(config, quant_method)
        attention.register()
        self.config = config
        self.hf = _build(config)
        self.ctx = ForwardContext()
        base = getattr(self.hf, self.hf.base_model_prefix, None)
        head = self.hf.get_output_embeddings()
        if base is None or head is None or base is self.hf:
            raise UnsupportedModelError(
                f"{type(self.hf).__name__} has no separate base model and LM head to run apart", "model-layout")
        # plain attributes, not submodules: the parameters stay named as in the HF model under `hf.`
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_head", head)
        self._softcap = getattr(config, "final_logit_softcapping", None)
        self._logit_mul = _logit_multiplier(config)
        self._dims = self._probe()

    # ---- the Model contract -----------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        self.ctx.batch = batch
        try:
            out = self._base(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0),
                             use_cache=False, return_dict=True)
        finally:
            self.ctx.batch = None
        return _last_hidden(out)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._head(hidden).float()
        if self._logit_mul is not None:
            logits = logits * self._logit_mul
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    def attention_dims(self) -> tuple[int, int, int, int]:
        return self._dims

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return {f"hf.{name}" for name in load_hf_weights(self.hf, weights)}

    # ---- construction -----------------------------------------------------------------------
    @torch.no_grad()
    def _probe(self) -> tuple[int, int, int, int]:
        """Run two tokens through the whole HF model with attention recording instead of attending;
        bind the attention modules; check compute_logits against the model's own logits."""
        device = next(self.hf.parameters()).device
        ids = torch.tensor([[1, 2]], device=device)
        pos = torch.tensor([[0, 1]], device=device)
        captured: list[torch.Tensor] = []
        hook = self._base.register_forward_hook(lambda _m, _a, out: captured.append(_last_hidden(out)))
        try:
            with Probing(self.ctx):
                out = self.hf(input_ids=ids, position_ids=pos, use_cache=False, return_dict=True)
        except UnsupportedModelError:
            raise
        except Exception as e:  # the model cannot run on a flattened batch with explicit positions
            raise UnsupportedModelError(
                f"{type(self.hf).__name__} failed on a probing forward (input_ids + position_ids, no cache): {e!r}",
                "probe-forward") from e
        finally:
            hook.remove()
        dims = attention.bind_layers(self.ctx, getattr(self.config, "sliding_window", None))
        if device.type != "meta" and captured:
            self._check_logits(captured[-1][0], out.logits[0])
        return dims

    def _check_logits(self, hidden: torch.Tensor, expected: torch.Tensor) -> None:
        ours = self.compute_logits(hidden)
        tol = 1e-4 if hidden.dtype == torch.float32 else 2e-2
        if ours.shape != expected.shape or not torch.allclose(ours, expected.float(), rtol=tol, atol=tol):
            raise UnsupportedModelError(
                f"{type(self.hf).__name__} post-processes its logits in a way the fallback does not reproduce "
                "(LM head, final_logit_softcapping, logit_scale and logits_scaling are known)", "logits-postprocess")


def _check_unquantized(config, quant_method: QuantMethod | None) -> None:
    from radixserve.layers.quant_unquantized import UnquantizedMethod

    if quant_method is not None and not isinstance(quant_method, UnquantizedMethod):
        raise UnsupportedModelError(
            f"the transformers fallback ({FALLBACK_DISTRIBUTION}) runs unquantized weights only, not "
            f"{type(quant_method).__name__}", "quantized")


def _build(config) -> torch.nn.Module:
    """The HF causal LM for `config`, on the current default device and dtype."""
    from transformers import AutoModelForCausalLM

    arch = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    config = copy.deepcopy(config)  # from_config writes dtype and the attention implementation into it
    try:
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=attention.ATTN_IMPLEMENTATION, dtype=torch.get_default_dtype()
        )
    except ValueError as e:
        if "Unrecognized configuration class" in str(e):
            raise UnsupportedModelError(
                f"{arch} ({config.model_type}) is not a decoder transformers can build with AutoModelForCausalLM, "
                f"so the transformers fallback (model.impl: transformers) cannot run it", "not-causal-lm") from None
        raise
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{arch} is an encoder-decoder model; the fallback runs decoder-only models",
                                    "encoder-decoder")
    logger.debug("built %s with attn_implementation=%s", type(model).__name__, attention.ATTN_IMPLEMENTATION)
    return model.eval()


def _logit_multiplier(config) -> float | None:
    """Scalar factors some families apply to the LM head's output (Cohere, Granite)."""
    factor = 1.0
    if getattr(config, "logit_scale", None) is not None:
        factor *= float(config.logit_scale)
    if getattr(config, "logits_scaling", None):
        factor /= float(config.logits_scaling)
    return None if factor == 1.0 else factor


def _last_hidden(out) -> torch.Tensor:
    if isinstance(out, tuple):
        return out[0]
    return out.last_hidden_state
