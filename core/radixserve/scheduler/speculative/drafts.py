"""Drafts as the scheduler keeps them, checked against the Drafter contract, and their acceptance.

A draft of n tokens becomes a verify sequence of n + 1 nodes: node 0 is the request's last
verified token (the root), node j >= 1 is draft token j - 1. `parents[j]` is node j's parent node
(-1 for the root), so a chain has parents [-1, 0, 1, ..., n - 1]."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from radixserve.tree_decode_rows import node_depths

logger = logging.getLogger(__name__)


@dataclass
class Draft:
    """One request's draft for a verify step, already checked."""

    tokens: list[int]  # draft tokens (nodes 1..n)
    parents: list[int]  # per node, root included: parent node index, -1 for the root

    @property
    def is_chain(self) -> bool:
        return all(p == j - 1 for j, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        return node_depths(self.parents)


def chain_parents(n: int) -> list[int]:
    return list(range(-1, n))


def checked_draft(tokens: list[int], parents: list[int] | None, limit: int, vocab_size: int, trees_ok: bool) -> Draft:
    """A drafter's entry cut to the rules: at most `limit` tokens, tokens in the vocabulary (a bad
    one ends a chain / drops its subtree), parents before children, and a tree reduced to the chain
    along first children when trees are not verifiable."""
    tokens = [int(t) for t in tokens]
    if parents is None:
        keep = []
        for t in tokens[:limit]:
            if not 0 <= t < vocab_size:
                break
            keep.append(t)
        return Draft(keep, chain_parents(len(keep)))
    # tree: node index = draft index + 1; drop invalid nodes and their descendants
    node_of: dict[int, int] = {-1: 0}
    keep_tokens: list[int] = []
    keep_parents: list[int] = [-1]
    for j, (t, p) in enumerate(zip(tokens, parents, strict=False)):
        if len(keep_tokens) >= limit:
            break
        p = int(p)
        if p >= j or p not in node_of or not 0 <= t < vocab_size:
            continue
        node_of[j] = len(keep_parents)
        keep_tokens.append(t)
        keep_parents.append(node_of[p])
    draft = Draft(keep_tokens, keep_parents)
    if not trees_ok and not draft.is_chain:
        draft = first_child_chain(draft)
    return draft


def first_child_chain(draft: Draft) -> Draft:
    """The chain from the root that follows the first (lowest-index) child at every level."""
    tokens: list[int] = []
    node = 0
    while True:
        child = next((c for c in range(node + 1, len(draft.parents)) if draft.parents[c] == node), None)
        if child is None:
            return Draft(tokens, chain_parents(len(tokens)))
        tokens.append(draft.tokens[child - 1])
        node = child


def accepted_path(draft: Draft, target: list[int]) -> list[int]:
    """The verified nodes, root first: from each node, the child whose token equals the target's
    own token at that node (`target[node]`, its argmax or its sample), while one exists. The
    tokens produced are `target[n]` for every n on the path (the last is the target's bonus token)."""
    path = [0]
    node = 0
    n = len(draft.parents)
    while True:
        want = target[node]
        child = next((c for c in range(node + 1, n) if draft.parents[c] == node and draft.tokens[c - 1] == want), None)
        if child is None:
            return path
        path.append(child)
        node = child
