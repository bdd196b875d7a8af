"""Whether the Triton kernels of `radixserve.layers` can run, without importing Triton at module
import time (`radixserve.layers` must import on machines without it)."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_importable() -> bool:
    """True when `triton` and `triton.language` import (tried once per process)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install that fails while importing
        return False
    return True


def available(t: torch.Tensor) -> bool:
    """True when `t` lives on a CUDA device and Triton imports."""
    return t.is_cuda and triton_importable()


def interpreting() -> bool:
    """True when TRITON_INTERPRET asks for Triton's CPU interpreter (the CPU tests run the kernels
    in it); `@triton.jit` reads it when it decorates, so kernel caches key on it."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_has_pdl() -> bool:
    """Whether the installed Triton launches kernels with programmatic dependent launch: the
    griddepcontrol intrinsics (`triton.language.extra.cuda.gdc_wait` / `gdc_launch_dependents`,
    Triton >= 3.4) and the `launch_pdl` launch option of the NVIDIA backend."""
    try:
        import triton.language.extra.cuda as tl_cuda
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception:  # no Triton, or one without the NVIDIA backend
        return False
    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    return hasattr(tl_cuda, "gdc_wait") and hasattr(tl_cuda, "gdc_launch_dependents") and "launch_pdl" in fields


@functools.cache
def _device_has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0) and triton_has_pdl()


def pdl_launch(pdl: bool) -> dict:
    """The launch keywords of a kernel with a `GDC` constexpr (its `griddepcontrol.wait` inside) when it runs
    with programmatic dependent launch: `GDC` and Triton's `launch_pdl` launch attribute, both only with `pdl`
    (which the caller has already checked for the device and the interpreter)."""
    return {"GDC": pdl, **({"launch_pdl": True} if pdl else {})}


def trigger_dependents(t: torch.Tensor) -> bool:
    """Whether a kernel writing `t` should execute `griddepcontrol.launch_dependents` (Triton's
    `tl.extra.cuda.gdc_launch_dependents`) at its start: on sm90+ GPUs with a Triton that has PDL,
    not in the interpreter. It lets a kernel launched after it with programmatic dependent launch
    (the batch-1 GEMVs, `runtime.batch1_gemv_pdl`) start its weight loads early; that kernel still
    waits for this one's completion before reading its output. Without such a launch it does
    nothing."""
    return t.is_cuda and not interpreting() and _device_has_pdl(t.device.index if t.device.index is not None
                                                                  else torch.cuda.current_device())
