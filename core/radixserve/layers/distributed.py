"""Tensor-parallel communication. Stub: TP > 1 is not wired yet, so collectives raise."""

from __future__ import annotations

import torch


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    if tp_size == 1:
        return x
    raise NotImplementedError("tensor parallel all-reduce is not implemented yet (tp_size > 1)")


def all_gather_last_dim(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    if tp_size == 1:
        return x
    raise NotImplementedError("tensor parallel all-gather is not implemented yet (tp_size > 1)")


def divide(n: int, d: int) -> int:
    if n % d:
        raise ValueError(f"{n} is not divisible by tp_size {d}")
    return n // d
