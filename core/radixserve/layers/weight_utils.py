"""Per-parameter weight loaders (nano-vllm style): each parameter carries `weight_loader`, so one
generic loop can load any model: `param.weight_loader(param, tensor[, shard_id])`."""

from __future__ import annotations

from typing import Any

import torch


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any]) -> None:
    for key, value in attrs.items():
        if hasattr(param, key):
            raise AttributeError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Copy a whole tensor into `param`; shapes must match exactly (no silent broadcasting)."""
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} is not fused; got shard_id={shard_id!r}")
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded.to(param.dtype))


def load_into(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Call the parameter's own loader (or the default one)."""
    loader = getattr(param, "weight_loader", default_weight_loader)
    if shard_id is None:
        loader(param, loaded)
    else:
        loader(param, loaded, shard_id)
