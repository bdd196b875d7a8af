"""DFS-weight (SGLang's idea): admit requests depth-first over the prefix tree, heaviest subtree first.

Each tree node is weighted by the number of waiting requests whose matched prefix ends in its
subtree. The order visits a node's children by decreasing weight (ties: the subtree's earliest
arrival) and, after its children (deeper, longer matches), the requests ending at the node itself.
Requests sharing a prefix are thus admitted together, so the shared KV is computed once and reused
while hot. Needs tree nodes with a `parent` attribute (the radix cache's); with any other cache, or
above `fcfs_threshold` waiting requests, it orders like FCFS.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from radixserve.interfaces import PrefixCache, SchedulePolicy
from radixserve.state import Req

from radixserve_policies.matching import arrival_order, fcfs_threshold_option, match_waiting

_ROOT = object()  # stands for "no node": requests whose match yielded no tree handle


class DFSWeightPolicy(SchedulePolicy):
    def __init__(self, fcfs_threshold: int = 128) -> None:
        self.fcfs_threshold = fcfs_threshold_option(fcfs_threshold)

    def order(self, waiting: list[Req], cache: PrefixCache) -> list[Req]:
        queue = arrival_order(waiting)
        if len(queue) > self.fcfs_threshold:
            return queue
        match_waiting(queue, cache)

        at_node: dict[Any, list[Req]] = defaultdict(list)  # requests whose match ends at the node
        weight: dict[Any, int] = defaultdict(int)
        first: dict[Any, int] = {}  # earliest queue position in the subtree
        children: dict[Any, dict[int, Any]] = defaultdict(dict)  # insertion-ordered sets, keyed by id
        roots: dict[int, Any] = {}
        for pos, req in enumerate(queue):
            node = req.last_node if req.last_node is not None else _ROOT
            at_node[node].append(req)
            while True:
                weight[node] += 1
                first.setdefault(node, pos)
                parent = getattr(node, "parent", None)
                if parent is None:
                    roots[id(node)] = node
                    break
                children[parent][id(node)] = node
                node = parent

        def rank(n: Any) -> tuple[int, int]:
            return (-weight[n], first[n])

        out: list[Req] = []
        # iterative post-order: (node, expanded?) -- a node's requests come after its subtree's
        stack: list[tuple[Any, bool]] = [(n, False) for n in sorted(roots.values(), key=rank, reverse=True)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                out.extend(at_node.get(node, ()))
                continue
            stack.append((node, True))
            stack.extend((c, False) for c in sorted(children[node].values(), key=rank, reverse=True))
        return out
