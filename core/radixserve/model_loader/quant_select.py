"""Pick and build the layers' QuantMethod for an HF checkpoint: `stack.quantization`, else the
checkpoint's `quantization_config.quant_method`, else "unquantized"; then check it can run here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixserve.plugins.registry import PluginError

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


def chosen_quant_method(registry: Registry, stack: ResolvedStack, hf_config) -> tuple[ComponentSpec, str]:
    """(the registered method this HF checkpoint's layers use, where its name came from: "stack.quantization",
    "the checkpoint's quantization_config.quant_method" or "the default"); PluginError saying where the name
    came from when no installed plugin provides it."""
    if stack.quantization is not None:
        return stack.quantization, "stack.quantization"
    declared = (checkpoint_quant_config(hf_config) or {}).get("quant_method")
    if not declared:
        return registry.get("quantization", "unquantized"), "the default"
    source = "the checkpoint's quantization_config.quant_method"
    try:
        return registry.get("quantization", declared), source
    except PluginError as e:
        raise PluginError(f"{source} (config.json) is {declared!r}: {e}") from None


def build_quant_method(registry: Registry, stack: ResolvedStack, hf_config, device: torch.device,
                       dtype: torch.dtype) -> QuantMethod:
    """The QuantMethod instance for this checkpoint on `device`; PluginError naming the method and
    what works when it is not installed, does not support the device, or refuses the config."""
    qc = checkpoint_quant_config(hf_config)
    spec, _ = chosen_quant_method(registry, stack, hf_config)  # names the package to install when it is missing
    name = spec.name
    if not spec.supports_device(device.type):
        others = [s.name for s in registry.components("quantization") if s.supports_device(device.type)]
        raise PluginError(
            f"quantization method {name!r} ({spec.distribution}) does not support device {device.type!r}: it runs on "
            f"{', '.join(spec.devices)}" + (f"; installed methods for {device.type}: {', '.join(others)}" if others else "")
        )
    cls = registry.load("quantization", name)
    # a stack-selected method on a checkpoint that declares none (online quantization) gets None
    declared = qc if qc is not None and qc.get("quant_method") == name else None
    try:
        method = cls.from_config(declared)
        method.check_device(device, dtype)
    except ValueError as e:
        raise PluginError(f"quantization method {name!r} ({spec.distribution}): {e}") from None
    return method
