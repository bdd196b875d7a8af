"""Drafts as the scheduler keeps them, checked against the Drafter contract, and their acceptance.

A draft of n tokens becomes a verify sequence of n + 1 nodes: node 0 is the request's last
verified token (the root), node j >= 1 is draft token j - 1. `parents[j]` is node j's parent node
(-1 for the root), so a chain has parents [-1, 0, 1, ..., n - 1]."""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from radixserve.interfaces.drafter import DraftProposal
from radixserve.tree_decode_rows import node_depths

logger = logging.getLogger(__name__)


@dataclass
class Draft:
    """One request's draft for a verify step, already checked."""

    tokens: list[int]  # draft tokens (nodes 1..n)
    parents: list[int]  # per node, root included: parent node index, -1 for the root
    # draft tokens the drafter proposed against the contract and the core dropped (checked_draft): outside
    # the vocabulary, or a tree node whose parent is not an earlier draft; `invalid_why` names the first
    invalid: int = 0
    invalid_why: str = ""

    @property
    def is_chain(self) -> bool:
        return all(p == j - 1 for j, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        return node_depths(self.parents)


def chain_parents(n: int) -> list[int]:
    return list(range(-1, n))


def check_proposal(proposal: Any, n: int) -> None:
    """Raise, in the conformance kit's words (radixserve.testing.check_drafter), where `propose`'s return value
    for `n` requests is not a DraftProposal with one entry per request (its drafts are checked by checked_draft)."""
    if not isinstance(proposal, DraftProposal):
        raise TypeError(f"propose returned {type(proposal).__name__}, not DraftProposal")
    tokens, parents = proposal.tokens, proposal.parents
    if not isinstance(tokens, list | tuple) or len(tokens) != n:
        got = len(tokens) if isinstance(tokens, list | tuple) else f"{type(tokens).__name__} {tokens!r}, not"
        raise ValueError(f"propose returned {got} token lists for {n} requests (one entry per request, in order)")
    if parents is not None and (not isinstance(parents, list | tuple) or len(parents) != n):
        raise ValueError(f"propose returned parents {type(parents).__name__} "
                         f"{len(parents) if isinstance(parents, list | tuple) else repr(parents)} for {n} requests: "
                         "parents must be None or one list per request")


def draft_token_list(draft: Any, what: str = "draft", item: str = "draft token") -> list[int]:
    """One request's draft tokens as ints, refused in the conformance kit's words where the drafter broke the
    contract's types (a list of ints): `draft is NoneType, not a list`, `draft token 'a' is str, not int`.
    Integers of other types (numpy's, a torch integer scalar) are taken as int() took them."""
    if type(draft) is list and all(type(t) is int for t in draft):  # the contract's own types: nothing to convert
        return draft
    if type(draft) is not list and (isinstance(draft, str | bytes | dict) or not isinstance(draft, Iterable)):
        raise TypeError(f"{what} is {type(draft).__name__}, not a list")
    out = []
    for t in draft:
        if type(t) is not int:
            try:
                t = operator.index(t)
            except TypeError:
                raise TypeError(f"{item} {t!r} is {type(t).__name__}, not int") from None
        out.append(t)
    return out


def checked_draft(tokens: list[int], parents: list[int] | None, limit: int, vocab_size: int, trees_ok: bool) -> Draft:
    """A drafter's entry cut to the rules: at most `limit` tokens, tokens in the vocabulary (a bad
    one ends a chain / drops its subtree), parents before children, and a tree reduced to the chain
    along first children when trees are not verifiable. The tokens a drafter got wrong (out of the
    vocabulary, a parent that is not an earlier node) are counted in `Draft.invalid`; wrong types raise
    TypeError (`draft_token_list`)."""
    tokens = draft_token_list(tokens)
    if parents is None:
        keep = []
        for t in tokens[:limit]:
            if not 0 <= t < vocab_size:
                return Draft(keep, chain_parents(len(keep)), 1,
                             f"draft token {t} outside the vocabulary [0, {vocab_size})")
            keep.append(t)
        return Draft(keep, chain_parents(len(keep)))
    # tree: node index = draft index + 1; drop invalid nodes and their descendants
    parents = draft_token_list(parents, "parents", "parent")
    node_of: dict[int, int] = {-1: 0}
    keep_tokens: list[int] = []
    keep_parents: list[int] = [-1]
    invalid, why = 0, ""
    for j, (t, p) in enumerate(zip(tokens, parents, strict=False)):
        if len(keep_tokens) >= limit:
            break
        if p >= j or p < -1 or not 0 <= t < vocab_size:  # the drafter's mistake (a dropped parent's child is not)
            invalid += 1
            why = why or (f"draft token {t} outside the vocabulary [0, {vocab_size})" if not 0 <= t < vocab_size
                          else f"parents[{j}] = {p}; a parent is -1 (the last verified token) or an earlier index")
            continue
        if p not in node_of:
            continue
        node_of[j] = len(keep_parents)
        keep_tokens.append(t)
        keep_parents.append(node_of[p])
    draft = Draft(keep_tokens, keep_parents, invalid, why)
    if not trees_ok and not draft.is_chain:
        draft = first_child_chain(draft)
        draft.invalid, draft.invalid_why = invalid, why
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
