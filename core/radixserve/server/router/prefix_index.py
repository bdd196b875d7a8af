"""The router's approximate view of one replica's prefix cache: which request texts it was sent.

A prefix tree over text, stored flat: the text is cut into blocks of `block_chars` characters and
node k of a text's path is identified by a hash chained over blocks 0..k (a node's id encodes its
whole path, so equal ids mean equal prefixes up to hash collisions). A dict from node id to
nothing, in least-recently-used order, holds the tree; it is bounded by `max_chars` (blocks times
`block_chars`) and evicts least recently used nodes first. A match touches its path from the leaf
up to the root, so a parent is always at least as recent as its children: eviction removes leaves
before the prefixes they hang from, and a kept node's whole path is kept.

Why text and not token ids: the router has no tokenizer (it would be a model-sized load in the
router for an approximation), and a shared text prefix tokenizes to a shared token prefix except
at the last block. SGLang's cache-aware router makes the same choice."""

from __future__ import annotations

from collections import OrderedDict

_ROOT = 0


class PrefixIndex:
    """Approximate prefix tree of the texts sent to one replica, bounded in size (LRU)."""

    def __init__(self, max_chars: int, block_chars: int = 16) -> None:
        if max_chars <= 0 or block_chars <= 0:
            raise ValueError(f"max_chars and block_chars must be positive (got {max_chars}, {block_chars})")
        self.block_chars = block_chars
        self.max_blocks = max(1, max_chars // block_chars)
        self._nodes: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        """Blocks held."""
        return len(self._nodes)

    @property
    def size_chars(self) -> int:
        return len(self._nodes) * self.block_chars

    def _path(self, text: str) -> list[int]:
        b = self.block_chars
        ids, h = [], _ROOT
        for start in range(0, len(text) - b + 1, b):  # whole blocks only
            h = hash((h, text[start : start + b]))
            ids.append(h)
        return ids

    def match(self, text: str) -> int:
        """Characters of `text`'s longest prefix held (a multiple of block_chars); touches that path."""
        path = self._path(text)
        n = 0
        while n < len(path) and path[n] in self._nodes:
            n += 1
        self._touch(path[:n])
        return n * self.block_chars

    def insert(self, text: str) -> None:
        """Hold every whole block of `text`'s prefix (most recently used), evicting LRU leaves."""
        path = self._path(text)
        for node in path:
            self._nodes[node] = None
        self._touch(path)
        while len(self._nodes) > self.max_blocks:
            self._nodes.popitem(last=False)

    def _touch(self, path: list[int]) -> None:
        for node in reversed(path):  # leaf first: the root ends up most recent
            self._nodes.move_to_end(node)

    def clear(self) -> None:
        self._nodes.clear()
