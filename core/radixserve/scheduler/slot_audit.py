"""Cheap checks of KV slot ownership (docs/contracts.md sections 1-2) in the running server.

Every slot is free, held by a resident request, or owned by the prefix cache; the kits check a
cache's bookkeeping, but a cache can break it on a path the kits never reach, and the server then
stalls or corrupts outputs without a word (audit 29). These checks read three counters the
scheduler reads anyway, name the prefix cache, and log each kind of violation once."""

from __future__ import annotations

import logging
from typing import Any

CONTRACT = "docs/contracts.md"


class SlotAudit:
    """`after_step(idle)` after every scheduler step; `after_reset()` after a flush. `label` names
    the cache in the lines, e.g. "prefix cache 'lru' (radixserve-prefixcache-lru)"."""

    def __init__(self, logger: logging.Logger, label: str, allocator: Any, cache: Any) -> None:
        self.logger, self.label, self.allocator, self.cache = logger, label, allocator, cache
        self.logged: set[str] = set()  # kinds already reported: one line each, not one per step

    def _once(self, kind: str, level: int, message: str, *args: Any) -> None:
        if kind not in self.logged:
            self.logged.add(kind)
            self.logger.log(level, message, *args)

    def after_step(self, idle: bool) -> None:
        """`idle`: no request holds KV (none running, being chunked or in flight); waiting ones hold none."""
        size, free = self.allocator.size, self.allocator.available_size()
        evictable, protected = self.cache.evictable_size(), self.cache.protected_size()
        cached = evictable + protected
        if free + cached > size:  # true at any step: requests only add to the owned slots
            self._once("impossible", logging.ERROR,
                       "%s: %d free + %d cached = %d KV slots, more than the pool's %d: a slot was freed twice and may "
                       "be handed out twice (wrong outputs); scheduler.debug_kv_checks=true fails the request "
                       "that does it (%s section 1)", self.label, free, cached, free + cached, size, CONTRACT)
        if not idle:
            return
        if protected:
            self._once("locked", logging.WARNING,
                       "%s holds %d locked slots with no request running: cache_finished_req must release the "
                       "request's lock (%s section 2), and a schedule policy must not lock (section 4); locked "
                       "slots are never evicted, so a waiting request may never fit", self.label, protected, CONTRACT)
        if free + cached < size:
            self._once("leaked", logging.WARNING,
                       "%s: with no request running, %d free + %d cached = %d of %d KV slots: %d leaked (owned by "
                       "nobody); the cache must free every slot it does not keep, such as the duplicates in "
                       "cache_unfinished_req / cache_finished_req (%s sections 1-2)",
                       self.label, free, cached, free + cached, size, size - free - cached, CONTRACT)

    def after_reset(self) -> int:
        """After `cache.reset()` with no request resident every slot is free; the number that is not."""
        size, free = self.allocator.size, self.allocator.available_size()
        if free != size:
            cached = self.cache.evictable_size() + self.cache.protected_size()
            self._once("reset", logging.WARNING,
                       "%s: after reset() with no request running, %d of %d KV slots are free (%d still counted as "
                       "cached): reset() must free every slot the cache owns, and the cache every slot it does not "
                       "keep (%s section 1)", self.label, free, size, cached, CONTRACT)
        return size - free
