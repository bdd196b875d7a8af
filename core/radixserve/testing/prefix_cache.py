"""Conformance kit for prefix caches.

Every KV slot the kit hands out is tagged with the token prefix whose last token it holds, so any
slot a cache returns can be checked for content, not just count. Three parts:

- API level, random operations (insert, match, lock, unlock, evict, reset) against a model of
  what the cache owns: matches return slots holding exactly the matched prefix (the whole cached
  prefix for a cache that shares), sizes add up, no slot is leaked, freed twice or owned twice,
  eviction frees what it reports and never a locked prefix.
- Request level, driven the way the scheduler drives it (match + lock at admission, chunked
  prefill with `cache_unfinished_req`, decode, `cache_finished_req`), under memory pressure
  (allocations that fail are retried after `evict`).
- End to end: the real scheduler with the toy runner (see `radixserve.testing.toy_runner`), whose
  outputs depend on every KV slot holding the right token, under a pool small enough to evict.

After each part every lock is released and `reset()` must return every slot (free == total).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from radixserve.interfaces.prefix_cache import PrefixCache, match_result_problem
from radixserve.memory import ReqToTokenPool, TokenAllocator
from radixserve.plugins.registry import class_problem
from radixserve.state import Req, SamplingParams
from radixserve.testing._threads import single_threaded

CacheFactory = Callable[[ReqToTokenPool, TokenAllocator], PrefixCache]


def _call(where: str, method: str, fn: Callable, *args):
    """`fn(*args)`, a call into the cache: an exception from it becomes an AssertionError naming the
    kit's case, seed and step (`where`) and the method (the kit's own AssertionErrors pass as they are)."""
    try:
        return fn(*args)
    except AssertionError:
        raise
    except Exception as e:
        raise AssertionError(f"{where}: {method} raised {type(e).__name__}: {e}") from e


def _match(cache: PrefixCache, key: list[int], where: str):
    """`cache.match_prefix(key)`, checked to be a MatchResult (the scheduler's words for a wrong type)."""
    m = _call(where, f"match_prefix(key tokens {key})", cache.match_prefix, key)
    problem = match_result_problem(m, len(key))
    assert problem is None, f"{where}: {problem}"
    return m


class RecordingAllocator(TokenAllocator):
    """A TokenAllocator (with double-free checks) that remembers the slots freed since `take_freed`."""

    def __init__(self, size: int) -> None:
        super().__init__(size, debug_checks=True)
        self._freed: list[int] = []
        self.where = ""  # the kit's case, step and operation now running, for the error below

    def free(self, slots: torch.Tensor) -> None:
        if slots is None or slots.numel() == 0:
            return
        try:
            super().free(slots)
        except ValueError as e:  # the double-free check: name the case, step, call and slots, not only the error
            raise AssertionError(f"{self.where}: allocator.free({self._describe(slots)}) refused: {e}") from e
        self._freed += slots.detach().to("cpu", torch.int64).flatten().tolist()

    def _describe(self, slots: torch.Tensor) -> str:
        flat = slots.detach().to("cpu", torch.int64).flatten()
        self._merge()  # the free list, whole: which of these slots were already free
        again = flat[torch.isin(flat, self._free)].tolist()
        shown = flat.tolist()
        text = f"slots {shown[:10]}{' ...' if len(shown) > 10 else ''}"
        return text + (f"; already free: {again[:10]}" if again else "")

    def take_freed(self) -> list[int]:
        out, self._freed = self._freed, []
        return out


class _Model:
    """What the cache owns: prefix (tuple of tokens) -> slot, and the slots' contents."""

    def __init__(self, cache: PrefixCache, alloc: RecordingAllocator) -> None:
        self.cache, self.alloc = cache, alloc
        self.owned: dict[tuple[int, ...], int] = {}
        self.content: dict[int, tuple[int, ...]] = {}  # slot -> the prefix whose last token it holds
        self.locks: list[tuple[object, tuple[int, ...]]] = []
        self.name = type(cache).__name__

    def fresh_slots(self, key: list[int], start: int = 0) -> torch.Tensor | None:
        """Slots for key[start:], each tagged with its prefix; evicts when the pool is short."""
        n = len(key) - start
        slots = self.alloc.alloc(n)
        if slots is None:
            self.evict(n - self.alloc.available_size())
            slots = self.alloc.alloc(n)
        if slots is not None:
            for i, s in enumerate(slots.tolist()):
                self.content[s] = tuple(key[: start + i + 1])
        return slots

    def expected(self, key: list[int]) -> list[int]:
        out = []
        for i in range(1, len(key) + 1):
            slot = self.owned.get(tuple(key[:i]))
            if slot is None:
                break
            out.append(slot)
        return out

    def check_match(self, key: list[int], where: str) -> list[int]:
        self.alloc.take_freed()
        m = _match(self.cache, key, where)
        assert not self.alloc.take_freed(), f"{where}: match_prefix freed slots"
        got = m.kv_indices.tolist()
        assert m.length == len(got)
        for i, slot in enumerate(got):
            assert self.content.get(slot) == tuple(key[: i + 1]), (
                f"{where}: match_prefix(key tokens {key}) returned slot {slot} at position {i}, which holds the KV "
                f"of tokens {list(self.content.get(slot) or ())} instead of tokens {key[: i + 1]}")
        want = self.expected(key)
        if self.cache.shares_prefixes:
            assert got == want, (
                f"{where}: match_prefix(key tokens {key}) returned slots {got}, but the cache holds slots {want} for "
                f"tokens {key[: len(want)]} (contract: return the longest cached prefix)")
        else:
            assert got == want[: len(got)], (
                f"{where}: match_prefix(key tokens {key}) returned slots {got}, not slots of a cached prefix "
                f"(the cache holds slots {want} for tokens {key[: len(want)]})")
        return got

    def evict(self, n: int) -> int:
        self.alloc.take_freed()
        evictable = self.cache.evictable_size()
        freed = _call(self.alloc.where or self.name, f"evict({n})", self.cache.evict, n)
        slots = self.alloc.take_freed()
        where = f"{self.alloc.where or self.name}: {self.name}.evict({n})"
        assert freed == len(slots), f"{where} returned {freed} but freed {len(slots)} slots"
        assert freed >= min(n, evictable), f"{where} freed {freed} of {evictable} evictable slots"
        self.drop(slots, where)
        return freed

    def drop(self, slots: list[int], where: str) -> None:
        """The cache freed `slots`: they must have been its own and not locked."""
        by_slot = {s: p for p, s in self.owned.items()}
        locked = self.locked_prefixes()
        for s in slots:
            prefix = by_slot.get(s)
            assert prefix is not None, f"{where}: freed slot {s}, which the cache did not own"
            assert prefix not in locked, f"{where}: freed slot {s} of the locked prefix (tokens {list(prefix)})"
            del self.owned[prefix]
        for prefix in self.owned:
            assert prefix[:-1] == () or prefix[:-1] in self.owned, (
                f"{where}: kept tokens {list(prefix)} but freed the slot of their parent prefix, tokens "
                f"{list(prefix[:-1])} (a cached prefix lost a token)")

    def locked_prefixes(self) -> set[tuple[int, ...]]:
        return {p[:i] for _, p in self.locks for i in range(1, len(p) + 1)}

    def insert(self, key: list[int], slots: torch.Tensor, where: str) -> int:
        self.alloc.take_freed()
        n = _call(where, f"insert(key tokens {key}, slots {slots.tolist()})", self.cache.insert, key, slots)
        assert isinstance(n, int) and 0 <= n <= len(key), (
            f"{where}: insert returned {n!r} ({type(n).__name__}) for {len(key)} tokens: expected an int in "
            f"[0, {len(key)}], the already-cached length (contract section 2)")
        assert n == len(self.expected(key)) or not self.cache.shares_prefixes, (
            f"{where}: insert(key tokens {key}) returned {n}, but {len(self.expected(key))} tokens were cached")
        for i in range(n, len(key)):
            self.owned[tuple(key[: i + 1])] = int(slots[i])
        self.drop(self.alloc.take_freed(), f"{where} (insert)")
        return n

    def check_sizes(self, where: str, held_elsewhere: int = 0) -> None:
        c = self.cache
        owned = len(self.owned)
        ev, pr = c.evictable_size(), c.protected_size()
        assert ev + pr == owned, f"{where}: evictable {ev} + protected {pr} != {owned} slots the cache owns"
        assert self.alloc.available_size() + owned + held_elsewhere == self.alloc.size, (
            f"{where}: {self.alloc.available_size()} free + {owned} cached + {held_elsewhere} held by requests != "
            f"{self.alloc.size} slots: slots leaked")
        if not self.locks:
            assert pr == 0, f"{where}: protected_size() is {pr} with nothing locked"
        else:
            assert pr >= len(self.locked_prefixes() & set(self.owned)), f"{where}: locked slots not counted as protected"

    def release_all_and_reset(self, where: str) -> None:
        for node, _ in self.locks:
            _call(where, "dec_lock_ref", self.cache.dec_lock_ref, node)
        self.locks = []
        self.alloc.take_freed()
        _call(where, "reset()", self.cache.reset)
        self.drop(self.alloc.take_freed(), f"{where} (reset)")
        assert not self.owned, f"{where}: reset() kept {len(self.owned)} slots"
        assert self.alloc.available_size() == self.alloc.size, (
            f"{where}: after reset {self.alloc.available_size()} of {self.alloc.size} slots are free (leak)")


def _api_level(factory: CacheFactory, seed: int, steps: int, pool: int, max_len: int = 8) -> None:
    """Random operations on keys of up to ~1.5 x `max_len` tokens (a cache that keeps whole blocks of 16
    tokens only sees its insert, evict and lock paths with keys past 16: cache/policy audit 33)."""
    rng = random.Random(seed)
    alloc = RecordingAllocator(pool)
    cache = factory(ReqToTokenPool(4, 64), alloc)
    m = _Model(cache, alloc)
    keys: list[list[int]] = [[0]]

    def rand_key() -> list[int]:
        if rng.random() < 0.5:  # a prefix or an extension of a key seen before: splits and shared paths
            base = rng.choice(keys)[: rng.randint(1, max_len)]
            return base + [rng.randint(0, 3) for _ in range(rng.randint(0, max_len // 2))]
        return [rng.randint(0, 3) for _ in range(rng.randint(1, max_len))]

    keys_note = "" if max_len <= 8 else f", keys up to {max_len + max_len // 2} tokens"
    for step in range(steps):
        op = rng.choice(("insert", "insert", "match", "lock", "unlock", "evict", "reset"))
        where = f"{m.name} (seed {seed}{keys_note}, step {step}, {op})"
        alloc.where = where
        if op == "insert":
            key = rand_key()
            slots = m.fresh_slots(key)
            if slots is None:
                continue
            n = m.insert(key, slots, where)
            alloc.free(slots[:n])  # the caller keeps (and frees) the duplicates
            alloc.take_freed()
            keys.append(key)
        elif op == "match":
            m.check_match(rand_key(), where)
        elif op == "lock":
            key = rand_key()
            got = m.check_match(key, where)
            node = _match(cache, key, where).last_node
            _call(where, "inc_lock_ref", cache.inc_lock_ref, node)
            m.locks.append((node, tuple(key[: len(got)])))
        elif op == "unlock" and m.locks:
            node, _ = m.locks.pop(rng.randrange(len(m.locks)))
            _call(where, "dec_lock_ref", cache.dec_lock_ref, node)
        elif op == "evict":
            m.evict(rng.randint(0, pool // 2))
        elif op == "reset" and not m.locks:
            m.release_all_and_reset(where)
        m.check_sizes(where)
    alloc.where = f"{m.name} (seed {seed}, end, reset)"
    m.release_all_and_reset(f"{m.name} (seed {seed}, end)")


class _RequestDriver:
    """Drives requests through a cache the way the scheduler does, checking slot contents."""

    def __init__(self, factory: CacheFactory, seed: int, pool: int) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.alloc = RecordingAllocator(pool)
        self.table = ReqToTokenPool(4, 64)
        self.cache = factory(self.table, self.alloc)
        self.m = _Model(self.cache, self.alloc)
        self.running: list[Req] = []
        self.where = f"{self.m.name} (seed {seed}, request level)"
        self.steps = 0

    def _at(self, op: str, req: Req | None = None) -> None:
        """Name the call now running in the allocator's errors."""
        self.steps += 1
        rid = f" of request {req.rid}" if req is not None else ""
        self.alloc.where = f"{self.m.name} (seed {self.seed}, request level, step {self.steps}, {op}{rid})"

    def _slots(self, req: Req, start: int, end: int) -> torch.Tensor:
        """Fresh slots for positions [start, end) of the request, evicting when the pool is short."""
        short = (end - start) - self.alloc.available_size()
        if short > 0:
            self.alloc.take_freed()
            evictable = self.cache.evictable_size()
            self._at(f"evict({short})", req)
            freed = _call(self.alloc.where, f"evict({short})", self.cache.evict, short)
            slots = self.alloc.take_freed()
            assert freed == len(slots) and freed >= min(short, evictable), (
                f"{self.where}: evict({short}) returned {freed}, freed {len(slots)} of {evictable} evictable slots")
            self._assert_not_in_use(slots, "evict")
        slots = self.m.fresh_slots(req.all_ids()[:end], start)
        assert slots is not None, f"{self.where}: no {end - start} free slots even after evicting everything evictable"
        return slots

    def _assert_not_in_use(self, freed: list[int], call: str) -> None:
        """No slot a running request still reads may be freed (that includes every locked prefix)."""
        freed_set = set(freed)
        for req in self.running:
            row = self.table.read(req.req_pool_idx, req.kv_len).tolist()
            both = freed_set.intersection(row)
            assert not both, f"{self.where}: {call} freed slots {sorted(both)[:10]} that request {req.rid} still uses"

    def _assert_row(self, req: Req, call: str) -> None:
        row = self.table.read(req.req_pool_idx, req.kv_len).tolist()
        ids = req.all_ids()
        for pos, slot in enumerate(row):
            assert self.m.content.get(slot) == tuple(ids[: pos + 1]), (
                f"{self.where}: after {call}, request {req.rid} position {pos} points at slot {slot}, which holds "
                f"another token prefix")
        prefix = [] if req.prefix_indices is None else req.prefix_indices.tolist()
        assert prefix == row[: len(prefix)], f"{self.where}: after {call}, prefix_indices != the row's first slots"

    def admit(self, prompt: list[int], max_new: int) -> None:
        req = Req(rid=f"r{len(self.running)}-{prompt[:3]}", origin_input_ids=list(prompt),
                  sampling_params=SamplingParams(max_new_tokens=max_new))
        req.fill_ids = req.all_ids()
        self._at("match_prefix", req)
        m = _match(self.cache, req.fill_ids[:-1], self.alloc.where)  # one token is always computed
        for i, slot in enumerate(m.kv_indices.tolist()):
            assert self.m.content.get(slot) == tuple(prompt[: i + 1]), (
                f"{self.alloc.where}: match_prefix(key tokens {req.fill_ids[:-1]}) returned slot {slot} at position "
                f"{i}, which holds the KV of other tokens")
        req.prefix_indices, req.last_node = m.kv_indices, m.last_node
        self._at("inc_lock_ref", req)
        _call(self.alloc.where, "inc_lock_ref", self.cache.inc_lock_ref, req.last_node)
        req.req_pool_idx = self.table.alloc()
        assert req.req_pool_idx is not None
        self.table.write(req.req_pool_idx, 0, req.prefix_indices)
        req.kv_len = m.length
        self.running.append(req)

    def step(self, req: Req, chunk: int) -> None:
        prompt_len = len(req.origin_input_ids)
        if req.kv_len < prompt_len:  # a prefill chunk
            end = min(req.kv_len + chunk, prompt_len)
            self.table.write(req.req_pool_idx, req.kv_len, self._slots(req, req.kv_len, end))
            req.kv_len = end
            req.fill_ids = req.all_ids()[: req.kv_len]
            self.alloc.take_freed()
            self._at("cache_unfinished_req", req)
            _call(self.alloc.where, "cache_unfinished_req", self.cache.cache_unfinished_req, req)
            self._assert_not_in_use(self.alloc.take_freed(), "cache_unfinished_req")
            self._assert_row(req, "cache_unfinished_req")
            if req.kv_len < prompt_len:
                return
        else:  # decode: the newest sampled token gets its KV
            self.table.write(req.req_pool_idx, req.kv_len, self._slots(req, req.kv_len, req.kv_len + 1))
            req.kv_len += 1
            self._assert_row(req, "decode")
        req.output_ids.append(self.rng.randint(0, 9))
        if len(req.output_ids) >= req.sampling_params.max_new_tokens:
            self.finish(req)

    def finish(self, req: Req) -> None:
        self.running.remove(req)
        self.alloc.take_freed()
        self._at("cache_finished_req", req)
        _call(self.alloc.where, "cache_finished_req", self.cache.cache_finished_req, req)
        self._assert_not_in_use(self.alloc.take_freed(), "cache_finished_req")
        self.table.free(req.req_pool_idx)  # raises if the cache freed the row itself
        req.req_pool_idx = None

    def run(self, num_requests: int) -> None:
        rng = self.rng
        stems = [[rng.randint(0, 9) for _ in range(rng.randint(4, 14))] for _ in range(3)]
        todo = []
        for _ in range(num_requests):
            stem = rng.choice(stems)
            todo.append((stem[: rng.randint(1, len(stem))] + [rng.randint(0, 9) for _ in range(rng.randint(1, 8))],
                         rng.randint(1, 6)))
        chunk = rng.randint(2, 6)
        while todo or self.running:
            while todo and len(self.running) < 3:
                self.admit(*todo.pop())
            for req in rng.sample(self.running, len(self.running)):
                self.step(req, chunk)
            assert self.cache.evictable_size() >= 0 and self.cache.protected_size() >= 0
        assert self.cache.protected_size() == 0, (
            f"{self.where}: protected_size() is {self.cache.protected_size()} after every request finished "
            f"(cache_finished_req must release the request's lock)")
        self.alloc.take_freed()
        self._at("reset")
        _call(self.alloc.where, "reset()", self.cache.reset)
        assert self.alloc.available_size() == self.alloc.size, (
            f"{self.where}: after every request finished and reset(), {self.alloc.available_size()} of "
            f"{self.alloc.size} slots are free (slots leaked)")


@single_threaded
def check_prefix_cache(
    cache: CacheFactory,
    *,
    seeds: tuple[int, ...] = (0, 1, 2),
    api_steps: int = 150,
    num_requests: int = 10,
    end_to_end: bool = True,
) -> None:
    """Run a prefix cache against its contract; raise AssertionError naming the first violation.

    :param cache: the class (or any callable) built as `cache(req_to_token_pool, allocator)`.
    :param seeds: one random run of each part per seed.
    :param api_steps: random API operations per seed.
    :param num_requests: requests driven through the request-level helpers per seed.
    :param end_to_end: also run the scheduler with the toy model over this cache (a small pool,
        so it evicts and retracts) and compare every output with the reference.
    """
    if isinstance(cache, type):  # as the core checks the class a stack selects (plugins.registry.class_problem)
        problem = class_problem("prefix_cache", cache)
        if problem is not None:
            raise AssertionError(f"{cache.__module__}.{cache.__qualname__} {problem}")
    for seed in seeds:
        _api_level(cache, seed, api_steps, pool=40)
        _api_level(cache, seed, api_steps, pool=240, max_len=40)  # several 16-token blocks a key
        _RequestDriver(cache, seed, pool=90).run(num_requests)
    if end_to_end:
        from radixserve.testing.end_to_end import ArrivalOrder, check_scheduler_outputs

        check_scheduler_outputs(cache, ArrivalOrder, seed=seeds[0])
