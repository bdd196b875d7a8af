"""Routing policies of the data-parallel router: which replica gets a request.

Pure objects (no processes, no I/O): the router asks `choose(text, loads)` with the request's
routing text and the requests in flight per replica, among the replicas in rotation, and tells the
policy when a replica leaves rotation (`forget`) or the caches are flushed (`reset`).

- round_robin: in turn, skipping replicas out of rotation.
- least_load: the fewest requests in flight (lowest index on ties).
- cache_aware (SGLang's cache-aware routing idea): when the load is uneven (the most and least
  loaded differ by more than `balance_abs_threshold` requests AND the most loaded carries more
  than `balance_rel_threshold` times the least), the least-loaded replica; otherwise the replica
  whose prefix tree holds the longest prefix of the text if it covers at least `cache_threshold`
  of it, else the replica with the smallest tree (the most cache room; fewest in flight on ties).
  The chosen replica's tree then holds the text."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from radixserve.server.router.prefix_index import PrefixIndex

POLICIES = ("cache_aware", "round_robin", "least_load")


@dataclass(frozen=True)
class Decision:
    replica: int
    reason: str  # "cache_hit", "balance", "cache_room", "round_robin", "least_load"
    matched_chars: int = 0


class RoutingPolicy:
    name = ""

    def choose(self, text: str, loads: Mapping[int, int]) -> Decision:
        """`loads`: requests in flight per replica in rotation (not empty)."""
        raise NotImplementedError

    def forget(self, replica: int) -> None:
        """`replica` left rotation (it died): drop what is known of it."""

    def reset(self) -> None:
        """Every replica's cache was flushed."""


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, text: str, loads: Mapping[int, int]) -> Decision:
        ids = sorted(loads)
        pick = next((i for i in ids if i >= self._next), ids[0])
        self._next = pick + 1
        return Decision(pick, "round_robin")


def _least_loaded(loads: Mapping[int, int]) -> int:
    return min(sorted(loads), key=lambda i: loads[i])


class LeastLoad(RoutingPolicy):
    name = "least_load"

    def choose(self, text: str, loads: Mapping[int, int]) -> Decision:
        return Decision(_least_loaded(loads), "least_load")


class CacheAware(RoutingPolicy):
    name = "cache_aware"

    def __init__(
        self,
        num_replicas: int,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.5,
        max_tree_chars: int = 8_000_000,
        tree_block_chars: int = 16,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._make_tree = lambda: PrefixIndex(max_tree_chars, tree_block_chars)
        self.trees = {i: self._make_tree() for i in range(num_replicas)}

    def is_imbalanced(self, loads: Mapping[int, int]) -> bool:
        high, low = max(loads.values()), min(loads.values())
        return high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold

    def choose(self, text: str, loads: Mapping[int, int]) -> Decision:
        if self.is_imbalanced(loads):
            decision = Decision(_least_loaded(loads), "balance")
        else:
            matched = {i: self.trees[i].match(text) for i in sorted(loads)}
            best = max(matched, key=lambda i: (matched[i], -loads[i]))
            if text and matched[best] > 0 and matched[best] >= self.cache_threshold * len(text):
                decision = Decision(best, "cache_hit", matched[best])
            else:
                room = min(sorted(loads), key=lambda i: (self.trees[i].size_chars, loads[i]))
                decision = Decision(room, "cache_room", matched[room])
        if text:
            self.trees[decision.replica].insert(text)
        return decision

    def forget(self, replica: int) -> None:
        self.trees[replica] = self._make_tree()

    def reset(self) -> None:
        for tree in self.trees.values():
            tree.clear()


def make_policy(router: Any, num_replicas: int) -> RoutingPolicy:
    """The policy named by `router.policy` (a `RouterSection`), built from its options."""
    if router.policy == "round_robin":
        return RoundRobin()
    if router.policy == "least_load":
        return LeastLoad()
    if router.policy == "cache_aware":
        return CacheAware(
            num_replicas,
            cache_threshold=router.cache_threshold,
            balance_abs_threshold=router.balance_abs_threshold,
            balance_rel_threshold=router.balance_rel_threshold,
            max_tree_chars=router.max_tree_chars,
            tree_block_chars=router.tree_block_chars,
        )
    raise ValueError(f"unknown router policy {router.policy!r}; valid: {', '.join(POLICIES)}")
