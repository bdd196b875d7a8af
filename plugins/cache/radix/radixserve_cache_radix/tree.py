"""TreeNode: one edge-labelled node of the token radix tree (page size 1: one KV slot per token)."""

from __future__ import annotations

import itertools

import torch

_ids = itertools.count()


class TreeNode:
    """`key` holds the tokens on the edge from `parent` to this node and `value` their KV slots
    (int64 CPU tensor, same length). `lock_ref` counts the requests using the path root..this node.
    Identity (not content) equality, so nodes can key dicts and sets."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "id")

    def __init__(self, parent: TreeNode | None = None, key: tuple[int, ...] = (), value: torch.Tensor | None = None):
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value if value is not None else torch.empty(0, dtype=torch.int64)
        self.lock_ref = 0
        self.last_access = 0
        self.id = next(_ids)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref}, children={len(self.children)})"


def common_prefix_len(a: tuple[int, ...], b: list[int] | tuple[int, ...], start: int) -> int:
    """Length of the common prefix of `a` and `b[start:]`. Compares slices (C speed) and halves
    the range that holds the first difference: edges run to thousands of tokens, and a full match,
    the usual case, costs one comparison."""
    n = min(len(a), len(b) - start)
    if a[:n] == tuple(b[start : start + n]):
        return n
    lo, hi = 0, n  # a[:lo] matches; the first difference lies in [lo, hi)
    while hi - lo > 16:
        mid = (lo + hi) // 2
        if a[lo:mid] == tuple(b[start + lo : start + mid]):
            lo = mid
        else:
            hi = mid
    while lo < hi and a[lo] == b[start + lo]:
        lo += 1
    return lo
