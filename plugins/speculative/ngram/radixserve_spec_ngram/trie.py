"""A bounded token trie of n-grams, shared by every request, with CLOCK (approximate LRU) eviction.

Every path from the root spells an n-gram of at most `max_depth` tokens seen in some request's
tokens; a node counts how often its n-gram was seen and remembers when last. A request feeds its
tokens one at a time through a *cursor*: the nodes of its current suffixes (lengths 1 ..
max_depth - 1), so adding a token costs O(max_depth) dictionary steps, however long the history.

Layout: nodes are integer ids into preallocated flat lists (count, last, token, parent, first
child, siblings) and one dict maps (parent, token) to the child. No Python object per node: a
serving process has a large heap, and millions of small tracked objects would make the garbage
collector's full passes slow (measured: a 1,500-token prompt fed 5x slower with one object per
node once torch was imported).

Memory is bounded by `capacity` nodes. When a token needs room, a CLOCK hand sweeps the ids:
a node touched since the hand last passed gets a second chance, another is evicted with its
whole subtree (its n-gram's extensions). Ids are reused, so cursors carry each node's
generation and an entry whose node was evicted simply reads as unknown.
"""

from __future__ import annotations

import heapq

_SPAN = 1 << 32  # edge key = parent * _SPAN + token (token ids are below 2**32)
_NONE = -1


class NgramTrie:
    """Shared n-gram statistics.

    :param max_depth: longest n-gram stored: a suffix of up to max_depth - 1 tokens can be matched
        and its next token looked up; longer drafts re-match on their own latest tokens.
    :param capacity: most nodes kept (the root excluded).
    """

    def __init__(self, max_depth: int, capacity: int) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        if capacity < 2 * max_depth:
            raise ValueError(f"capacity must be >= 2 * max_depth ({2 * max_depth}), got {capacity}")
        self.max_depth = max_depth
        self.capacity = capacity
        n = 1  # id 0 is the root; the tables grow (doubling) up to capacity + 1 entries
        self.count = [0] * n  # times the n-gram was fed
        self.last = [0] * n  # clock of its latest feed (recency; breaks count ties)
        self.token = [_NONE] * n
        self.parent = [_NONE] * n
        self.first_child = [_NONE] * n
        self.next_sibling = [_NONE] * n
        self.prev_sibling = [_NONE] * n
        self.gen = [0] * n  # bumped when the id is freed: stale cursor entries no longer match
        self.referenced = [False] * n  # CLOCK bit: touched since the hand last passed
        self.edges: dict[int, int] = {}
        self._free: list[int] = []
        self._next_id = 1  # ids >= this were never used
        self._hand = 1
        self._clock = 0
        self.evicted = 0  # nodes evicted so far (statistics)

    def __len__(self) -> int:
        return self._next_id - 1 - len(self._free)

    # ---- feeding -----------------------------------------------------------------------------
    def feed(self, cursor: list[tuple[int, int]], tokens: list[int]) -> list[tuple[int, int]]:
        """Count every n-gram ending at one of `tokens`, given the request's `cursor` (its suffix
        nodes as (id, generation) pairs, shortest first; [] for a new request); return the cursor
        after the last token."""
        keep = self.max_depth - 1  # cursor entries: a depth-max_depth node is never extended
        edges, count, last, gen, ref = self.edges, self.count, self.last, self.gen, self.referenced
        token_of, parent_of, first, next_sib, prev_sib = (self.token, self.parent, self.first_child,
                                                          self.next_sibling, self.prev_sibling)
        get, free = edges.get, self._free
        clock = self._clock
        root = (0, 0)  # the root: id 0, never evicted
        for token in tokens:
            if self.capacity - (self._next_id - 1 - len(free)) < keep + 1:
                self._evict(keep + 1)  # may free nodes of `cursor`: their generation changes
            clock += 1
            nxt: list[tuple[int, int]] = []
            for parent, parent_gen in [root, *cursor[:keep]]:
                if parent == _NONE or gen[parent] != parent_gen:
                    nxt.append((_NONE, 0))  # evicted: this suffix is unknown from now on
                    continue
                key = parent * _SPAN + token
                node = get(key)
                if node is None:  # a new n-gram (inlined: this is the hot path of a novel text)
                    if free:
                        node = free.pop()
                    else:
                        node = self._next_id
                        self._next_id = node + 1
                        if node == len(count):
                            self._grow()
                    edges[key] = node
                    token_of[node] = token
                    parent_of[node] = parent
                    count[node] = 1
                    first[node] = _NONE
                    head = first[parent]
                    next_sib[node] = head
                    prev_sib[node] = _NONE
                    if head != _NONE:
                        prev_sib[head] = node
                    first[parent] = node
                else:
                    count[node] += 1
                last[node] = clock
                ref[node] = True
                nxt.append((node, gen[node]))
            cursor = nxt[:keep]
        self._clock = clock
        return cursor

    def _grow(self) -> None:
        size = len(self.count)
        extra = min(self.capacity + 1 - size, max(size, 4096))
        for table, fill in ((self.count, 0), (self.last, 0), (self.token, _NONE), (self.parent, _NONE),
                            (self.first_child, _NONE), (self.next_sibling, _NONE), (self.prev_sibling, _NONE),
                            (self.gen, 0), (self.referenced, False)):
            table.extend([fill] * extra)

    def _evict(self, room: int) -> None:
        """Free nodes until `room` ids are available (CLOCK: second chance for touched nodes)."""
        ref, parent = self.referenced, self.parent
        while self.capacity - len(self) < room:
            hand = self._hand
            self._hand = hand + 1 if hand < self._next_id - 1 else 1  # ids in use are below _next_id
            if parent[hand] == _NONE:
                continue  # free id
            if ref[hand]:
                ref[hand] = False
                continue
            self._remove_subtree(hand)

    def _remove_subtree(self, top: int) -> None:
        prev, nxt, par = self.prev_sibling[top], self.next_sibling[top], self.parent[top]
        if prev != _NONE:
            self.next_sibling[prev] = nxt
        else:
            self.first_child[par] = nxt
        if nxt != _NONE:
            self.prev_sibling[nxt] = prev
        stack = [top]
        while stack:
            node = stack.pop()
            child = self.first_child[node]
            while child != _NONE:
                stack.append(child)
                child = self.next_sibling[child]
            del self.edges[self.parent[node] * _SPAN + self.token[node]]
            self.parent[node] = _NONE
            self.first_child[node] = _NONE
            self.referenced[node] = False
            self.gen[node] += 1
            self._free.append(node)
            self.evicted += 1

    # ---- lookup ------------------------------------------------------------------------------
    def children(self, node: int) -> list[int]:
        out = []
        child = self.first_child[node]
        while child != _NONE:
            out.append(child)
            child = self.next_sibling[child]
        return out

    def has_children(self, node: int) -> bool:
        return self.first_child[node] != _NONE

    def match(self, cursor: list[tuple[int, int]], min_window: int, max_window: int) -> int | None:
        """The node of the longest suffix of w tokens (min_window <= w <= max_window) that has
        been seen followed by something, read off a feeding cursor; None when there is none."""
        gen, first = self.gen, self.first_child
        for w in range(min(max_window, len(cursor)), min_window - 1, -1):
            node, node_gen = cursor[w - 1]
            if node != _NONE and gen[node] == node_gen and first[node] != _NONE:
                return node
        return None

    def match_tokens(self, tail: list[int], min_window: int, max_window: int) -> int | None:
        """Like `match`, for the suffixes of `tail` (walked from the root: O(max_window^2) at worst)."""
        get = self.edges.get
        for w in range(min(max_window, len(tail), self.max_depth - 1), min_window - 1, -1):
            node: int | None = 0
            for token in tail[len(tail) - w :]:
                node = get(node * _SPAN + token)
                if node is None:
                    break
            if node is not None and self.first_child[node] != _NONE:
                return node
        return None

    def _ranked(self, node: int, rank: str) -> list[int]:
        count, last = self.count, self.last
        if rank == "recency":
            return sorted(self.children(node), key=last.__getitem__, reverse=True)
        # most frequent first, the most recent among equals (a copy continues its latest source);
        # siblings never share a clock tick, so the order is total
        return sorted(self.children(node), key=lambda c: (count[c], last[c]), reverse=True)

    def _next(self, child: int, tail: list[int], min_window: int, max_window: int) -> int | None:
        """Where to look for what follows `child` (the n-gram just drafted, `tail` its context):
        `child` itself while it has continuations, else the longest shorter suffix that has some
        (the trie is only max_depth deep, so long drafts keep re-anchoring on the latest tokens)."""
        if self.first_child[child] != _NONE:
            return child
        return self.match_tokens(tail, min_window, max_window)

    def chain(self, node: int, history_tail: list[int], k: int, min_window: int, max_window: int,
              rank: str = "frequency") -> list[int]:
        """Up to k tokens following `node` (the match of `history_tail`'s suffix), taking the
        best-ranked continuation at every step."""
        tail = list(history_tail)
        out: list[int] = []
        while len(out) < k and node is not None:
            child = self._ranked(node, rank)[0]
            token = self.token[child]
            out.append(token)
            tail.append(token)
            node = self._next(child, tail, min_window, max_window)
        return out

    def tree(self, node: int, history_tail: list[int], k: int, topk: int, min_window: int, max_window: int,
             rank: str = "frequency") -> tuple[list[int], list[int]]:
        """Up to k tokens as a tree below `node`: best-first by estimated path probability (the
        product of count shares along the path), each node offering its `topk` best-ranked children.

        :return: (tokens, parents) with parents[j] < j the index of token j's parent, -1 for a
            child of `node` itself."""
        count = self.count
        tokens: list[int] = []
        parents: list[int] = []
        heap: list[tuple[float, int, int, int]] = []
        seq = 0

        def offer(parent_node: int, parent_index: int, prob: float) -> None:
            nonlocal seq
            ranked = self._ranked(parent_node, rank)
            total = sum(count[c] for c in ranked)
            for child in ranked[:topk]:
                # seq: equal probabilities pop in offer order (best-ranked first), deterministically
                heapq.heappush(heap, (-prob * count[child] / total, seq, parent_index, child))
                seq += 1

        offer(node, -1, 1.0)
        while heap and len(tokens) < k:
            neg_prob, _, parent_index, child = heapq.heappop(heap)
            tokens.append(self.token[child])
            parents.append(parent_index)
            if len(tokens) == k:
                break
            if self.first_child[child] != _NONE:
                nxt: int | None = child
            else:
                nxt = self.match_tokens(self._path(history_tail, tokens, parents), min_window, max_window)
            if nxt is not None:
                offer(nxt, len(tokens) - 1, -neg_prob)
        return tokens, parents

    @staticmethod
    def _path(history_tail: list[int], tokens: list[int], parents: list[int]) -> list[int]:
        """The context of the newest tree token: the history, then the tree path down to it."""
        path = []
        j = len(tokens) - 1
        while j != _NONE:
            path.append(tokens[j])
            j = parents[j]
        return list(history_tail) + path[::-1]
