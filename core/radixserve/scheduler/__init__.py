"""Continuous-batching scheduler: `Scheduler` (the in-process loop body).

`Scheduler` is imported lazily: the detokenizer process imports `scheduler.stop_strings` and must
not pay for torch (the scheduler module imports it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.scheduler.scheduler import Scheduler

__all__ = ["Scheduler"]


def __getattr__(name: str) -> Any:
    if name == "Scheduler":
        from radixserve.scheduler.scheduler import Scheduler

        return Scheduler
    raise AttributeError(f"module 'radixserve.scheduler' has no attribute {name!r}")
