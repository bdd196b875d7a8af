"""Shared by the cache-aware policies: match each waiting request once and store the result."""

from __future__ import annotations

from typing import Any

from radixserve.interfaces import PrefixCache
from radixserve.state import Req


def match_waiting(waiting: list[Req], cache: PrefixCache) -> None:
    """Store `cache.match_prefix(req.fill_ids)` on every request (SchedulePolicy contract: no locks)."""
    for req in waiting:
        m = cache.match_prefix(req.fill_ids)
        req.prefix_indices, req.last_node = m.kv_indices, m.last_node


def prefix_len(req: Req) -> int:
    return 0 if req.prefix_indices is None else int(req.prefix_indices.numel())


def arrival_order(waiting: list[Req]) -> list[Req]:
    """FCFS: by arrival time; the sort is stable, so equal times keep queue order."""
    return sorted(waiting, key=lambda r: r.arrival_time)


def fcfs_threshold_option(value: Any) -> int:
    """`stack.policy_options.fcfs_threshold`, checked: a value from YAML may be any type, and a
    string would otherwise fail only in the first comparison, with Python's own words."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"stack.policy_options.fcfs_threshold must be an integer, got {value!r} ({type(value).__name__})")
    if value < 0:
        raise ValueError(f"stack.policy_options.fcfs_threshold must be >= 0, got {value}")
    return value
