"""PrefixCache: reuse of KV slots across requests that share a token prefix."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from radixserve.memory.allocator import TokenAllocator
    from radixserve.memory.req_to_token import ReqToTokenPool
    from radixserve.state import Req


@dataclass
class MatchResult:
    """The cached prefix of a key. `kv_indices` are KV slots owned by the cache (int64, CPU);
    `last_node` is an opaque handle to lock while the prefix is in use."""

    kv_indices: torch.Tensor
    last_node: Any

    @property
    def length(self) -> int:
        return int(self.kv_indices.numel())


def match_result_problem(m: Any, key_len: int) -> str | None:
    """What is wrong with `m` as `match_prefix`'s answer for a key of `key_len` tokens (None: nothing).
    The words the conformance kit and the scheduler both use (docs/contracts.md section 2)."""
    import torch

    if not isinstance(m, MatchResult):
        return f"match_prefix returned {type(m).__name__}, expected MatchResult (contract section 2)"
    kv = m.kv_indices
    if not isinstance(kv, torch.Tensor):
        return (f"match_prefix returned a MatchResult whose kv_indices is {type(kv).__name__}, expected an int64 "
                "CPU tensor (contract section 2)")
    if kv.dtype != torch.int64 or kv.device.type != "cpu" or kv.dim() != 1:
        return (f"match_prefix: kv_indices must be a 1-D int64 CPU tensor, got {kv.dtype} of shape "
                f"{tuple(kv.shape)} on {kv.device} (contract section 2)")
    if kv.numel() > key_len:
        return (f"match_prefix returned {kv.numel()} slots for a key of {key_len} tokens: at most one slot per "
                "key token (contract section 2)")
    return None


class PrefixCache(abc.ABC):
    """Maps token prefixes to the KV slots that hold their keys and values.

    Rules every implementation keeps:
    - Slot ownership: a KV slot is owned by exactly one of {the allocator's free list, a running
      request, the cache}. The cache frees slots only through `allocator.free` and only slots it owns.
    - `match_prefix(key)` never changes ownership and never locks; callers lock the returned node
      with `inc_lock_ref` before relying on the slots and release with `dec_lock_ref`.
    - Locked nodes (lock count > 0), and all their ancestors, are never evicted.
    - `insert(key, kv_indices)` returns n, the length of the longest prefix of `key` that was already
      cached. The cache takes ownership of `kv_indices[n:]`; `kv_indices[:n]` stay with the caller
      (who frees those that are not the cache's own slots).
    - `evictable_size()` counts slots held by the cache in unlocked nodes; `protected_size()` those
      in locked nodes. `evict(n)` frees at least min(n, evictable_size()) slots, LRU leaves first,
      and returns how many it freed.
    - `reset()` frees everything the cache owns; only legal when nothing is locked.

    Request-level helpers the scheduler calls (fields of `radixserve.state.Req`):
    - `cache_unfinished_req(req)`: after a prefill chunk; the KV of `req.fill_ids` is in
      `req_to_token[req.req_pool_idx, :len(req.fill_ids)]`. Inserts it, frees duplicate slots,
      rewrites the request's row to point at the cache's slots (read and write rows through the
      pool's `read` / `write`, never the device table: a batch may be running on the device),
      moves the request's lock from its old `req.last_node` to the new one and sets
      `req.prefix_indices` / `req.last_node`.
    - `shares_prefixes` (class attribute, default True): False for a cache that never matches (the
      scheduler then does not hold back requests to let them share a prefix within one batch).
    - `cache_finished_req(req)`: the request is done; its KV covers `req.kv_committed_ids()`.
      Inserts (or, for a non-sharing cache, frees) it, unlocks `req.last_node`. It does not free the
      request's ReqToTokenPool row (the scheduler does).

    Memory it works with: `self.req_to_token_pool` (`alloc()`/`free(row)` are the scheduler's;
    the cache only calls `read(row, end, start=0)` and `write(row, start, slots)`) and
    `self.allocator` (`free(slots)` for slots it owns; it never allocates). See docs/contracts.md.

    Check a cache with `radixserve.testing.check_prefix_cache(MyCache)`.

    Added in plugin API 1.0 (`shares_prefixes` in 1.0 as well, defaulted so older plugins keep working).
    """

    supports_tensor_parallel: bool = False
    """Class flag: this component works when `runtime.tp_size > 1` (the cache lives on rank 0 only
    and must touch the KV layout only through `ReqToTokenPool.write`/`write_positions`, which the
    runner replays on the other ranks; a cache that copies KV data itself cannot be mirrored).
    The stack resolution refuses a tp_size > 1 config that selects a component leaving it False,
    naming it. Added in plugin API 1.3."""

    shares_prefixes: bool = True

    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: TokenAllocator) -> None:
        """The scheduler builds a cache as `Cache(req_to_token_pool, allocator, **options)`, the options
        from `stack.prefix_cache_options` (plugin API 1.20): a subclass adds keyword parameters for them
        (an unknown name is refused at start-up; a ValueError here is the refusal of a value)."""
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator

    @abc.abstractmethod
    def match_prefix(self, key: list[int]) -> MatchResult:
        """The longest cached prefix of `key`.

        :param key: token ids (the scheduler passes `req.fill_ids[:-1]`: one token is always
            computed so the model has a row to take logits from).
        :return: `MatchResult(kv_indices, last_node)`: int64 CPU slots, one per matched token,
            slot i holding token key[i]; `last_node` is the handle to lock. An empty match
            returns an empty tensor and a handle that locking accepts (e.g. the root or None).

        Restrictions: changes no slot ownership and locks nothing (it may reorganise internal
        structure and update recency).

        Added in plugin API 1.0.
        """

    @abc.abstractmethod
    def insert(self, key: list[int], kv_indices: torch.Tensor) -> int:
        """Cache `key`, whose KV is in `kv_indices` (one slot per token, int64).

        :return: n, how many leading tokens of `key` were already cached. The cache takes
            ownership of `kv_indices[n:]` (it may keep them, or free them at once through
            `allocator.free` if it does not share); `kv_indices[:n]` stay with the caller.

        Added in plugin API 1.0.
        """

    @abc.abstractmethod
    def inc_lock_ref(self, node: Any) -> None:
        """Protect the path ending at `node` (a `MatchResult.last_node`) from eviction; counted,
        so two requests may lock the same node. Moves its slots from evictable to protected.

        Added in plugin API 1.0.
        """

    @abc.abstractmethod
    def dec_lock_ref(self, node: Any) -> None:
        """Undo one `inc_lock_ref(node)`; the handle stays valid even if the structure changed
        (e.g. an edge was split) since it was locked.

        Added in plugin API 1.0.
        """

    @abc.abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least min(num_tokens, evictable_size()) unlocked slots through
        `allocator.free`, least recently used first, never a locked path.

        :return: how many slots were freed (may exceed num_tokens: whole entries go).

        Added in plugin API 1.0.
        """

    @abc.abstractmethod
    def evictable_size(self) -> int:
        """Slots the cache owns on unlocked paths (what `evict` can free).

        Added in plugin API 1.0.
        """

    @abc.abstractmethod
    def protected_size(self) -> int:
        """Slots the cache owns on locked paths. evictable + protected = every slot it owns.

        Added in plugin API 1.0.
        """

    @abc.abstractmethod
    def reset(self) -> None:
        """Free every slot the cache owns and forget everything (the scheduler's flush). Only
        called when nothing is locked; may raise RuntimeError otherwise.

        Added in plugin API 1.0.
        """

    @abc.abstractmethod
    def cache_unfinished_req(self, req: Req) -> None:
        """After a prefill chunk of `req` (see the class docstring for the fields involved).

        Added in plugin API 1.0.
        """

    @abc.abstractmethod
    def cache_finished_req(self, req: Req) -> None:
        """When `req` finishes, is aborted or retracted (see the class docstring).

        Added in plugin API 1.0.
        """

    def stats(self) -> dict[str, int]:
        """Counters for metrics (e.g. hit_tokens, evicted_tokens); optional. Each numeric entry
        appears in the scheduler's stats as `prefix_cache_<name>` (so in /server_info, the
        `radixserve_stats` hook and /metrics as `radixserve_scheduler_prefix_cache_<name>`);
        other values are left out. Called once per stats request: keep it cheap.

        Added in plugin API 1.0.
        """
        return {}
