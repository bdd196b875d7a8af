"""Longest prefix match: requests with the most cached prompt tokens first (ties by arrival).

Matching costs O(queue length x prompt length) per step, so above `fcfs_threshold` waiting requests
the policy falls back to FCFS and matches nothing (the scheduler then matches what it admits)."""

from __future__ import annotations

from radixserve.interfaces import PrefixCache, SchedulePolicy
from radixserve.state import Req

from radixserve_policies.matching import arrival_order, fcfs_threshold_option, match_waiting, prefix_len


class LPMPolicy(SchedulePolicy):
    def __init__(self, fcfs_threshold: int = 128) -> None:
        self.fcfs_threshold = fcfs_threshold_option(fcfs_threshold)

    def order(self, waiting: list[Req], cache: PrefixCache) -> list[Req]:
        if len(waiting) > self.fcfs_threshold:
            return arrival_order(waiting)
        match_waiting(waiting, cache)
        return sorted(arrival_order(waiting), key=lambda r: -prefix_len(r))
