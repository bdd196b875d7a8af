"""Zero-filled CPU buffers whose pages become resident only when written."""

from __future__ import annotations

import math
import mmap

import torch


def zeros_on_demand(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor of `shape` / `dtype` on `device`.

    On the CPU the storage is a fresh anonymous memory mapping: it reads as zeros everywhere
    (exactly as `torch.zeros`), but the kernel backs a page with memory only when it is first
    written, so a KV pool sized for the worst case costs resident memory in proportion to the slots
    actually used. `torch.zeros` would write, hence map, every page at start-up. Other devices get
    `torch.zeros` (GPU memory is reserved up front either way)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < mmap.PAGESIZE:  # nothing to save; mmap refuses length 0
        return torch.zeros(shape, dtype=dtype)
    # the tensor keeps the mapping alive (frombuffer holds a reference); it is unmapped with it
    raw = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
    return raw.view(dtype).view(shape)
