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
