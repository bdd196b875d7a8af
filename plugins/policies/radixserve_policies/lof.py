"""Longest output first: the largest max_new_tokens first (ties by arrival), so long generations
start early and short ones fill the gaps they leave."""

from __future__ import annotations

from radixserve.interfaces import PrefixCache, SchedulePolicy
from radixserve.state import Req

from radixserve_policies.matching import arrival_order


class LOFPolicy(SchedulePolicy):
    def order(self, waiting: list[Req], cache: PrefixCache) -> list[Req]:
        return sorted(arrival_order(waiting), key=lambda r: -r.sampling_params.max_new_tokens)
