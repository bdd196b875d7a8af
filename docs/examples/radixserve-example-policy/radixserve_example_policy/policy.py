"""Shortest prompt first: favours short requests, lowering mean time-to-first-token under load."""

from radixserve.interfaces import PrefixCache, SchedulePolicy
from radixserve.state import Req


class ShortestPromptFirst(SchedulePolicy):
    def order(self, waiting: list[Req], cache: PrefixCache) -> list[Req]:
        # ties keep arrival order (sorted is stable)
        return sorted(waiting, key=lambda r: (len(r.origin_input_ids), r.arrival_time))
