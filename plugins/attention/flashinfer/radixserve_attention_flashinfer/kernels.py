"""The three FlashInfer wrapper classes this plugin drives, imported lazily with a clear error.

Only `flashinfer.decode` and `flashinfer.prefill` are imported (not the whole package's kernel
zoo). A missing or broken FlashInfer, or a device that is not CUDA, raises `FlashInferUnavailable`
naming the attention backends that would work instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class FlashInferUnavailable(RuntimeError):
    """FlashInfer cannot run here (not installed, fails to import, or the device is not CUDA)."""


@dataclass(frozen=True)
class FlashInferKernels:
    """The wrapper classes, each constructed as `Wrapper(float_workspace_buffer, "NHD", **options)`
    and used as FlashInfer documents (`plan(...)` once per forward, then `run(...)` per layer)."""

    decode: Any  # BatchDecodeWithPagedKVCacheWrapper
    paged_prefill: Any  # BatchPrefillWithPagedKVCacheWrapper
    ragged_prefill: Any  # BatchPrefillWithRaggedKVCacheWrapper


def other_backends(device: str) -> list[str]:
    """Installed attention backends other than flashinfer that run on `device` (best effort)."""
    try:
        from radixserve.plugins.registry import Registry

        registry = Registry.discover()
        return [s.name for s in registry.components("attention") if s.name != "flashinfer" and s.supports_device(device)]
    except Exception:  # only used to word an error message
        return []


def _hint(device: str) -> str:
    names = other_backends(device)
    return (f"; attention backends installed for {device}: {', '.join(names)} (stack.attention=...)" if names
            else "; choose another attention backend (stack.attention=triton on CUDA, torch_native anywhere)")


def load_kernels(device: str = "cuda") -> FlashInferKernels:
    """Import FlashInfer's wrappers for `device` (a torch device type or string such as "cuda:0").

    :raises FlashInferUnavailable: the device is not CUDA, or flashinfer-python is missing or fails
        to import; the message names the backends that would work instead.
    """
    device_type = str(device).split(":")[0]
    if device_type != "cuda":
        raise FlashInferUnavailable(
            f"the flashinfer attention backend runs on CUDA GPUs only, not on device {device_type!r}{_hint(device_type)}"
        )
    try:
        from flashinfer.decode import BatchDecodeWithPagedKVCacheWrapper
        from flashinfer.prefill import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper
    except (ImportError, OSError) as e:  # OSError: a shared library of a dependency is missing
        raise FlashInferUnavailable(
            f"the flashinfer attention backend needs the flashinfer-python package ({e}); install it with "
            f"`pip install radixserve-attention-flashinfer` (which depends on it){_hint(device_type)}"
        ) from None
    return FlashInferKernels(BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper,
                             BatchPrefillWithRaggedKVCacheWrapper)
