"""Continuous-batching scheduler: `Scheduler` (in-process loop body) and its ZMQ process wrapper."""

from radixserve.scheduler.scheduler import Scheduler

__all__ = ["Scheduler"]
