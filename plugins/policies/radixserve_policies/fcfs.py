"""First come, first served: admission in arrival order."""

from __future__ import annotations

from radixserve.interfaces import PrefixCache, SchedulePolicy
from radixserve.state import Req

from radixserve_policies.matching import arrival_order


class FCFSPolicy(SchedulePolicy):
    def order(self, waiting: list[Req], cache: PrefixCache) -> list[Req]:
        return arrival_order(waiting)
