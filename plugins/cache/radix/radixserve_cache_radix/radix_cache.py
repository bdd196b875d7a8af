"""RadixCache: a token-level radix tree over KV slots (page size 1), shared by all requests.

Every node's edge carries tokens and the KV slots holding them; a request's prefix is the path from
the root. Follows `radixserve.interfaces.PrefixCache` exactly (slot ownership, locking, LRU eviction).
Node handles stay valid across splits: a split inserts a new node *above* the split one, so a node
returned by `match_prefix` still ends exactly where that match ended.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from radixserve.interfaces import MatchResult, PrefixCache

from radixserve_cache_radix.tree import TreeNode, common_prefix_len

if TYPE_CHECKING:
    from radixserve.memory.allocator import TokenAllocator
    from radixserve.memory.req_to_token import ReqToTokenPool
    from radixserve.state import Req

_EMPTY = torch.empty(0, dtype=torch.int64)


class RadixCache(PrefixCache):
    supports_tensor_parallel = True  # lives on rank 0; rows written through ReqToTokenPool (replayed)
    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: TokenAllocator) -> None:
        super().__init__(req_to_token_pool, allocator)
        self._clock = 0  # logical time for LRU; a counter, so ties are impossible
        self._hit_tokens = 0
        self._queried_tokens = 0
        self._evicted_tokens = 0
        self._new_tree()

    def _new_tree(self) -> None:
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root holds no slots and is never evicted
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 0  # nodes other than the root
        # eviction candidates, kept as they change instead of scanned for at each evict (a full
        # server evicts every step): (last_access, id, node), pushed whenever a node is touched, is
        # unlocked or loses its last child; an entry counts only if it still describes an unlocked,
        # attached leaf with that last_access (`_evictable_entry`), so stale ones are skipped
        self._candidates: list[tuple[int, int, TreeNode]] = []

    # ---- lookup and insertion ---------------------------------------------------------------
    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached prefix of `key`. Splits a node when the match ends inside its edge
        (structure only: no slot changes hands, nothing is locked)."""
        values, node = self._match(key)
        matched = _cat(values)
        self._queried_tokens += len(key)
        self._hit_tokens += int(matched.numel())
        return MatchResult(kv_indices=matched, last_node=node)

    def insert(self, key: list[int], kv_indices: torch.Tensor) -> int:
        """Cache `key` -> `kv_indices`; returns how many leading tokens were already cached. The cache
        takes ownership of kv_indices[returned:] only."""
        if len(key) != int(kv_indices.numel()):
            raise ValueError(f"insert: {len(key)} tokens but {int(kv_indices.numel())} KV slots")
        value = kv_indices.detach().to("cpu", torch.int64).flatten()
        node, pos = self.root, 0
        self._touch(node)
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                leaf = TreeNode(node, tuple(key[pos:]), value[pos:].clone())
                node.children[key[pos]] = leaf
                self._num_nodes += 1
                self._touch(leaf)
                self._evictable += len(leaf)
                return pos
            n = common_prefix_len(child.key, key, pos)
            if n < len(child):
                child = self._split(child, n)
            self._touch(child)
            node, pos = child, pos + n
        return pos

    def _match(self, key: list[int]) -> tuple[list[torch.Tensor], TreeNode]:
        node, pos = self.root, 0
        values: list[torch.Tensor] = []
        self._touch(node)
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = common_prefix_len(child.key, key, pos)
            if n < len(child):
                child = self._split(child, n)
            self._touch(child)
            values.append(child.value)
            node, pos = child, pos + n
        return values, node

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child`'s edge after n tokens: a new node takes the first n and becomes child's parent.
        It inherits child's lock count (it lies on every locked path through child), so sizes hold."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child)
        upper = TreeNode(parent, child.key[:n], child.value[:n].clone())
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        child.key, child.value, child.parent = child.key[n:], child.value[n:].clone(), upper
        upper.children[child.key[0]] = child
        parent.children[upper.key[0]] = upper
        self._num_nodes += 1
        return upper

    def _touch(self, node: TreeNode) -> None:
        self._clock += 1
        node.last_access = self._clock
        if not node.is_root:
            self._push_candidate(node)

    def _push_candidate(self, node: TreeNode) -> None:
        heapq.heappush(self._candidates, (node.last_access, node.id, node))
        if len(self._candidates) > 4 * self._num_nodes + 256:  # mostly stale: keep only live candidates
            self._candidates = [(n.last_access, n.id, n) for n in self._nodes() if n.is_leaf and n.lock_ref == 0]
            heapq.heapify(self._candidates)

    @staticmethod
    def _evictable_entry(entry: tuple[int, int, TreeNode]) -> bool:
        last_access, _, node = entry
        return node.parent is not None and node.is_leaf and node.lock_ref == 0 and node.last_access == last_access

    # ---- locking ----------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode | None) -> None:
        while node is not None and not node.is_root:
            if node.lock_ref == 0:
                self._evictable -= len(node)
                self._protected += len(node)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode | None) -> None:
        while node is not None and not node.is_root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref on an unlocked node {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node)
                self._evictable += len(node)
                self._push_candidate(node)
            node = node.parent

    # ---- eviction and sizes -----------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves, least recently used first, until `num_tokens` slots are freed or
        nothing evictable is left. A parent left childless and unlocked becomes a candidate."""
        if num_tokens <= 0:
            return 0
        heap = self._candidates
        freed = 0
        while freed < num_tokens and heap:
            entry = heapq.heappop(heap)
            if not self._evictable_entry(entry):
                continue  # locked, grown a child, evicted, or touched since (a newer entry exists)
            leaf = entry[2]
            parent = leaf.parent
            assert parent is not None
            self.allocator.free(leaf.value)
            freed += len(leaf)
            self._evictable -= len(leaf)
            self._num_nodes -= 1
            del parent.children[leaf.key[0]]
            leaf.parent = None
            if not parent.is_root and parent.is_leaf and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        self._evicted_tokens += freed
        return freed

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        """Slots the cache owns (evictable + protected)."""
        return self._evictable + self._protected

    def reset(self) -> None:
        if self._protected:
            raise RuntimeError(f"RadixCache.reset with {self._protected} tokens still locked by running requests")
        for node in self._nodes():
            self.allocator.free(node.value)
        self._new_tree()

    def stats(self) -> dict[str, int]:
        return {
            "hit_tokens": self._hit_tokens,
            "queried_tokens": self._queried_tokens,
            "evicted_tokens": self._evicted_tokens,
            "cached_tokens": self.total_size(),
            "protected_tokens": self._protected,
        }

    def _nodes(self) -> Iterator[TreeNode]:
        """Every node except the root."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ---- request-level helpers ---------------------------------------------------------------
    def cache_unfinished_req(self, req: Req) -> None:
        row = req.req_pool_idx
        assert row is not None, "cache_unfinished_req needs a request holding a ReqToTokenPool row"
        ids = req.fill_ids
        old_len = _length(req.prefix_indices)
        kv = self.req_to_token_pool.read(row, len(ids))
        self._insert_and_free_duplicates(ids, kv, old_len)
        values, node = self._match(ids)
        new_indices = _cat(values)
        assert new_indices.numel() == len(ids), "just-inserted tokens must match in full"
        self.req_to_token_pool.write(row, old_len, new_indices[old_len:])
        self.inc_lock_ref(node)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices, req.last_node = new_indices, node

    def cache_finished_req(self, req: Req) -> None:
        """Also clears `req.last_node` (its lock is released), so a second call cannot double-unlock."""
        ids = req.kv_committed_ids()
        if req.req_pool_idx is not None and ids:
            kv = self.req_to_token_pool.read(req.req_pool_idx, len(ids))
            self._insert_and_free_duplicates(ids, kv, _length(req.prefix_indices))
        self.dec_lock_ref(req.last_node)
        req.last_node = None

    def _insert_and_free_duplicates(self, ids: list[int], kv: torch.Tensor, old_len: int) -> None:
        """kv[:old_len] are the cache's own slots (the locked prefix); kv[old_len:] the request's.
        Request slots whose tokens were already cached are duplicates: free them."""
        cached = self.insert(ids, kv)
        if cached < old_len:
            raise RuntimeError(f"locked prefix of {old_len} tokens not found in the cache (found {cached})")
        self.allocator.free(kv[old_len:cached])


def _cat(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(values) if values else _EMPTY.clone()


def _length(indices: torch.Tensor | None) -> int:
    return 0 if indices is None else int(indices.numel())
