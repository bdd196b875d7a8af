"""Pick and build the layers' QuantMethod for an HF checkpoint: `stack.quantization`, else the
checkpoint's `quantization_config.quant_method`, else "unquantized"; then check it can run here.
Also: a failure inside the method's hooks while the model is built, loaded or warmed up, said as
one line naming the component, the hook and the layer (`quant_hook_failure`)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixserve.plugins.registry import PluginCodeError, PluginError, PluginRefusal

if TYPE_CHECKING:
    import torch

    from radixserve.interfaces.quantization import QuantMethod
    from radixserve.plugins.registry import ComponentSpec, Registry
    from radixserve.plugins.stack import ResolvedStack


def checkpoint_quant_config(hf_config) -> dict[str, Any] | None:
    """The checkpoint's `quantization_config` as a plain dict (None when it declares none)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if isinstance(qc, dict):
        return dict(qc)
    return qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))


def quant_config_for(name: str, hf_config) -> dict[str, Any] | None:
    """What method `name`'s `from_config` gets: the checkpoint's quantization_config when it declares
    that method, else None (a stack-selected method on a checkpoint that declares none: online quantization)."""
    qc = checkpoint_quant_config(hf_config)
    return qc if qc is not None and qc.get("quant_method") == name else None


def quant_label(spec: ComponentSpec) -> str:
    """How errors name a registered method: "quantization method 'int8' (radixserve-quant-int8)"."""
    return f"quantization method {spec.name!r} ({spec.distribution})"


@dataclass(frozen=True)
class QuantChoice:
    """Which registered QuantMethod an HF checkpoint's layers use, and why."""

    spec: ComponentSpec
    source: str  # where the name came from, as errors say it: "stack.quantization", "the default", ...
    origin: str  # the same, as the start-up log's stack line says it: "stack", "checkpoint" or "default"
    checkpoint_config: dict[str, Any] | None  # what `from_config` gets (None: online quantization)

    @property
    def built_by(self) -> str:
        """The `from_config` call that builds the method, as error messages name it."""
        return ("from_config(None) (online quantization)" if self.checkpoint_config is None
                else "from_config(the checkpoint's quantization_config)")


def chosen_quant_method(registry: Registry, stack: ResolvedStack, hf_config) -> QuantChoice:
    """The registered method this HF checkpoint's layers use and where its name came from; PluginError saying
    where the name came from when no installed plugin provides it."""
    if stack.quantization is not None:
        spec, source, origin = stack.quantization, "stack.quantization", "stack"
    else:
        declared = (checkpoint_quant_config(hf_config) or {}).get("quant_method")
        if not declared:
            spec, source, origin = registry.get("quantization", "unquantized"), "the default", "default"
        else:
            source, origin = "the checkpoint's quantization_config.quant_method", "checkpoint"
            try:
                spec = registry.get("quantization", declared)
            except PluginError as e:
                raise PluginError(f"{source} (config.json) is {declared!r}: {e}") from None
    return QuantChoice(spec, source, origin, quant_config_for(spec.name, hf_config))


def build_quant_method(registry: Registry, choice: QuantChoice, device: torch.device,
                       dtype: torch.dtype) -> QuantMethod:
    """The QuantMethod instance `choice` names, on `device`; PluginError naming the method and what works when
    it does not support the device, is an abstract class, or refuses the config (PluginCodeError when its
    `from_config` / `check_device` raise anything but the ValueError they refuse with). Reads no weights:
    `radixserve config show` runs it too."""
    spec = choice.spec
    name = spec.name
    label = quant_label(spec)
    if not spec.supports_device(device.type):
        others = [s.name for s in registry.components("quantization") if s.supports_device(device.type)]
        raise PluginError(
            f"{label} does not support device {device.type!r}: it runs on "
            f"{', '.join(spec.devices)}" + (f"; installed methods for {device.type}: {', '.join(others)}" if others else "")
        )
    cls = registry.load("quantization", name)
    if inspect.isabstract(cls):  # said as the attention backends say it, not as instantiation's TypeError
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise PluginError(f"{label} cannot be used: {cls.__module__}.{cls.__qualname__} is abstract: it does not "
                          f"implement {missing} (required by QuantMethod)")
    step = "from_config"
    try:
        method = cls.from_config(choice.checkpoint_config)
        step = "check_device"
        method.check_device(device, dtype)
    except ValueError as e:
        raise PluginError(f"{label}: {e}") from None
    except Exception as e:  # the method's own bug: one line naming it, the traceback kept as the cause
        raise PluginCodeError(f"{label} failed in {step}: {type(e).__name__}: {e}") from e
    return method


# the QuantMethod hooks the core calls while it builds, loads and runs the model's layers
_QUANT_HOOKS = frozenset({"create_weights", "create_moe_weights", "process_weights_after_loading",
                          "process_moe_weights_after_loading", "enable_lowbit_gemv", "apply", "apply_moe"})


def quant_hook_failure(e: BaseException, method: Any, label: str | None = None, model: Any = None,
                       when: str = "") -> PluginError | None:
    """`e` (raised while the model was built, loaded or run) as one line naming the component, when
    it came out of one of `method`'s hooks: "quantization method 'int8' (pkg) failed in create_weights
    for layer ...: RuntimeError: ..." (a PluginCodeError, `e` to be chained as its cause); a ValueError
    (the method refusing a value) as a PluginRefusal, "... refused layer ... in create_weights: ...";
    the base class's MoE refusal as a PluginError naming the component; None when no hook of `method`
    raised it.

    Found from the traceback (no per-call cost in the forward): the outermost frame running a hook
    with `method` as `self`. The layer is its first argument, named by `model`'s module names when
    given, else by its `prefix` (FusedMoE), else by its class and sizes (a layer still being built).
    The core's own methods (`radixserve.*`, e.g. UnquantizedMethod itself) are not plugins: None."""
    if method is None or type(method).__module__.partition(".")[0] == "radixserve":
        return None  # the core's own method (unquantized): a core bug keeps its plain traceback
    from radixserve.interfaces.quantization import QuantMethod

    label = label or f"quantization method {type(method).__name__}"
    hook_frame, layer_id, innermost = None, None, None
    tb = e.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if hook_frame is None:
            lid = frame.f_locals.get("layer_id")  # DecoderOnlyCausalLM.build_layer's argument
            if isinstance(lid, int) and layer_id is None:
                layer_id = lid
            if frame.f_code.co_name in _QUANT_HOOKS and frame.f_locals.get("self") is method:
                hook_frame = frame
        innermost = frame
        tb = tb.tb_next
    if hook_frame is None:
        return None
    hook = hook_frame.f_code.co_name
    code = hook_frame.f_code
    layer = hook_frame.f_locals.get(code.co_varnames[1]) if code.co_argcount > 1 else None
    where, named = _layer_description(layer, model, layer_id)
    if not named and not when:  # still being built: no name yet
        when = " while the model was built"
    if innermost is not None and innermost.f_code is QuantMethod.create_moe_weights.__code__:
        # the base class's refusal (the method has no MoE support): a limit, not a bug
        experts = innermost.f_locals.get("num_experts")
        prefix = getattr(layer, "prefix", "") or type(layer).__name__
        return PluginError(f"{label} does not support MoE expert weights (layer {prefix!r}, {experts} experts); "
                           "serve this model unquantized or with a method that supports MoE")
    if isinstance(e, ValueError):  # the method refusing a value (the interfaces' convention), not its bug
        return PluginRefusal(f"{label} refused {where} in {hook}{when}: {e}")
    return PluginCodeError(f"{label} failed in {hook} for {where}{when}: {type(e).__name__}: {e}")


@contextmanager
def quant_hooks_named(method: Any, label: str | None = None, model: Any = None, when: str = "") -> Iterator[None]:
    """Run the block; an exception out of one of `method`'s hooks leaves it as `quant_hook_failure`'s one
    line (chained from the original), any other exception unchanged. Where the core builds, loads, warms up
    or runs the model's layers."""
    try:
        yield
    except Exception as e:
        failure = quant_hook_failure(e, method, label, model, when)
        if failure is None:
            raise
        raise failure from e


def _layer_description(layer: Any, model: Any, layer_id: int | None) -> tuple[str, bool]:
    """(how a message names `layer`, whether that is its module name)."""
    if layer is None:
        return "a layer", False
    kind = type(layer).__name__
    if model is not None:
        for name, module in model.named_modules():
            if module is layer:
                return f"layer {name} ({kind})", True
    prefix = getattr(layer, "prefix", None)
    if isinstance(prefix, str) and prefix:
        return f"layer {prefix} ({kind})", True
    # built, not yet attached to its parent: no name yet, so its sizes and decoder layer tell which
    sizes = []
    for attr in ("input_size", "output_sizes"):
        value = getattr(layer, attr, None)
        if value is not None:
            sizes.append(f"{attr} {value}")
    text = f"a {kind}" + (f" ({', '.join(sizes)})" if sizes else "")
    return text + (f" of decoder layer {layer_id}" if layer_id is not None else ""), False
