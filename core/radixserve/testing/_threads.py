"""The kits' tensors are tiny: with several CPU threads, OpenMP start-up and spinning cost far more
than the math (measured 13.8 s vs 0.38 s for the attention kit on a loaded 2-core machine), so
each kit runs single-threaded and restores the caller's setting afterwards."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def single_threaded(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(before)

    return wrapper  # type: ignore[return-value]
