"""Random: a uniformly random admission order from a seeded generator (reproducible per seed and
call sequence). Useful as a baseline for the other policies in benchmarks."""

from __future__ import annotations

import random

from radixserve.interfaces import PrefixCache, SchedulePolicy
from radixserve.state import Req


class RandomPolicy(SchedulePolicy):
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._rng = random.Random(seed)

    def order(self, waiting: list[Req], cache: PrefixCache) -> list[Req]:
        out = list(waiting)
        self._rng.shuffle(out)
        return out
