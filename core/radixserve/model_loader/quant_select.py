"""Pick and build the layers' QuantMethod for an HF checkpoint: `stack.quantization`, else the
checkpoint's `quantization_config.quant_method`, else "unquantized"; then check it can run here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixserve.plugins.registry import PluginError

if TYPE_CHECKING:
    import torch

    from radixserve.interfaces.quantization import QuantMethod
    from radixserve.plugins.registry import Registry
    from radixserve.plugins.stack import ResolvedStack


def checkpoint_quant_config(hf_config) -> dict[str, Any] | None:
    """The checkpoint's `quantization_config` as a plain dict (None when it declares none)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if isinstance(qc, dict):
        return dict(qc)
    return qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))


def build_quant_method(registry: Registry, stack: ResolvedStack, hf_config, device: torch.device,
                       dtype: torch.dtype) -> QuantMethod:
    """The QuantMethod instance for this checkpoint on `device`; PluginError naming the method and
    what works when it is not installed, does not support the device, or refuses the config."""
    qc = checkpoint_quant_config(hf_config)
    name = stack.quantization.name if stack.quantization is not None else None
    if name is None:
        name = (qc or {}).get("quant_method") or "unquantized"
    spec = registry.get("quantization", name)  # names the package to install when it is missing
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
