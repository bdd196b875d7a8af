"""Priority: higher `Req.priority` first; equal priorities by arrival."""

from __future__ import annotations

from radixserve.interfaces import PrefixCache, SchedulePolicy
from radixserve.state import Req

from radixserve_policies.matching import arrival_order


class PriorityPolicy(SchedulePolicy):
    def order(self, waiting: list[Req], cache: PrefixCache) -> list[Req]:
        return sorted(arrival_order(waiting), key=lambda r: -r.priority)
