"""Causal attention of fresh prompts (no cached prefix) through PyTorch's own kernels.

A fresh prompt's keys are exactly its new tokens, so no pool read is needed. Two ways, picked per
batch by the backend:
- `varlen_attention`: one flash call for the whole batch (`torch.nn.attention.varlen.varlen_attn`,
  torch 2.10+, CUDA, fp16 / bf16), the tokens packed as they come, delimited by cumulative lengths:
  one launch a layer instead of one SDPA launch and one output copy per request.
- `per_request_sdpa`: `scaled_dot_product_attention` once per request (every device and dtype; the
  CPU interpreter's path and the fallback where varlen is missing).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# The per-request SDPA may use every backend but cuDNN's: torch builds one cuDNN plan per new
# (shape, stride) key, ~40 ms each on the H200 (benchmarks/h200/draft_sdpa_shapes.py, session 11: a
# prompt of a length not seen before took 40.1 ms median in cuDNN, 0.098 ms in the flash kernel), and
# served prompts have new lengths all the time: that plan build was the online TTFT tail.
FRESH_PROMPT_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

VARLEN_DTYPES = (torch.float16, torch.bfloat16)  # what the flash varlen kernel takes


@functools.lru_cache(maxsize=64)  # asked once per layer per batch: the answer depends on the layer's shape only
def causal_keywords(signature: inspect.Signature, gqa: bool, scale: float, head_dim: int) -> dict[str, Any] | None:
    """The keywords that make `varlen_attn` causal, grouped-query and scaled by `scale` for the
    installed torch, or None when this signature cannot express the call.

    torch 2.10 takes `is_causal=True`; later releases express causality as `window_size=(-1, 0)` and
    grouped-query attention as `enable_gqa=True`. Without an `enable_gqa` parameter the flash kernel
    takes fewer K/V heads than query heads as they are (FlashAttention-2's own grouped-query layout).
    Without a `scale` parameter only the default 1/sqrt(head_dim) can be expressed.
    """
    params = signature.parameters
    if "window_size" in params:
        kwargs: dict[str, Any] = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        kwargs = {"is_causal": True}
    else:
        return None
    if gqa and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    if "scale" in params:
        kwargs["scale"] = scale
    elif abs(scale * head_dim**0.5 - 1.0) > 1e-6:
        return None
    return kwargs


@functools.cache
def _varlen_function() -> tuple[Callable[..., torch.Tensor], inspect.Signature] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch before 2.10
        return None
    return varlen_attn, inspect.signature(varlen_attn)


def varlen_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `varlen_attention` can run batches of this device, dtype and head size."""
    return (device.type == "cuda" and dtype in VARLEN_DTYPES and head_dim % 8 == 0 and head_dim <= 256
            and _varlen_function() is not None)


def cumulative_lengths(lens: Sequence[int], device: torch.device) -> torch.Tensor:
    """int32 [len(lens) + 1]: where each request's tokens start in the packed batch, then the total."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32).to(device, non_blocking=True)


def varlen_attention(
    q3: torch.Tensor, k3: torch.Tensor, v3: torch.Tensor, scale: float, cu_seqlens: torch.Tensor, max_len: int,
    *, varlen: tuple[Callable[..., torch.Tensor], inspect.Signature] | None = None,
) -> torch.Tensor | None:
    """Causal attention of the packed fresh prompts q3 [T, H, D], k3 / v3 [T, KVH, D] in one call, or
    None when the installed torch cannot express it (the caller then runs `per_request_sdpa`).
    `varlen` (the function and its signature) defaults to torch's; tests pass a stand-in."""
    found = varlen or _varlen_function()
    if found is None:
        return None
    function, signature = found
    kwargs = causal_keywords(signature, q3.shape[1] != k3.shape[1], scale, q3.shape[2])
    if kwargs is None:
        return None
    return function(q3, k3, v3, cu_seqlens, cu_seqlens, max_len, max_len, **kwargs)


def per_request_sdpa(
    q3: torch.Tensor, k3: torch.Tensor, v3: torch.Tensor, scale: float, lens: Sequence[int]
) -> torch.Tensor:
    """Causal attention of each fresh prompt by its own SDPA call (cuDNN excluded, see above)."""
    out = torch.empty_like(q3)
    gqa = q3.shape[1] != k3.shape[1]
    start = 0
    with sdpa_kernel(FRESH_PROMPT_SDPA_BACKENDS):
        for n in lens:
            rows = slice(start, start + n)
            # [1, heads, n, head_dim] views: the head dim stays contiguous, as the flash kernel needs
            o = F.scaled_dot_product_attention(
                q3[rows].transpose(0, 1)[None], k3[rows].transpose(0, 1)[None], v3[rows].transpose(0, 1)[None],
                is_causal=True, scale=scale, enable_gqa=gqa,
            )
            out[rows] = o[0].transpose(0, 1)
            start += n
    return out
