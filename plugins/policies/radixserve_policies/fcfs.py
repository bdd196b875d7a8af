"""First come, first served: admission in arrival order."""

from __future__ import annotations

from radixserve.interfaces import PrefixCache, SchedulePolicy
from radixserve.state import Req


class FCFSPolicy(SchedulePolicy):
    def order(self, waiting: list[Req], cache: PrefixCache) -> list[Req]:
        # stable sort: requests that arrived at the same time keep queue order
        return sorted(waiting, key=lambda r: r.arrival_time)
