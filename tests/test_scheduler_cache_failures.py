"""A prefix cache's bug does not end the runtime or leak KV memory (cache audit 37c, defects 1-2).

- `match_prefix` that raises or returns the wrong type (a tuple, not a MatchResult) at admission:
  the request being admitted ends with a 500, the failure is logged once naming the cache (in the
  conformance kit's words for a wrong type) and counted in `plugin_failures`, and serving goes on.
- `insert` that raises inside `cache_unfinished_req` / `cache_finished_req`: the request ends with a
  500 and the scheduler returns its own KV slots (those the cache did not take or free) and its lock,
  so the pool does not drain.

Driven on the toy runner (whose outputs read every token through its KV slot)."""

from __future__ import annotations

import logging

import pytest
import torch
from radixserve.config import Config
from radixserve.interfaces import MatchResult
from radixserve.plugins.registry import Registry
from radixserve.scheduler import Scheduler
from radixserve.testing import ToyRunner, toy_reference
from radixserve_cache_radix.radix_cache import RadixCache
from test_scheduler_slot_audit import run

VOCAB = 1000
LOGGER = "radixserve.scheduler"
LONG = 12  # keys longer than this make the broken caches below fail


class MatchRaises(RadixCache):
    def match_prefix(self, key):
        if len(key) > LONG:
            raise RuntimeError("simulated bug in match_prefix")
        return super().match_prefix(key)


class MatchReturnsTuple(RadixCache):
    def match_prefix(self, key):
        m = super().match_prefix(key)
        return (m.kv_indices, m.last_node) if len(key) > LONG else m


class InsertRaises(RadixCache):
    """insert raises before changing anything."""

    def insert(self, key, kv_indices):
        if len(key) > LONG:
            raise RuntimeError("simulated bug in insert")
        return super().insert(key, kv_indices)


class InsertRaisesAfterInserting(RadixCache):
    """insert takes the slots (kv[n:] are the cache's now) and then raises."""

    def insert(self, key, kv_indices):
        n = super().insert(key, kv_indices)
        if len(key) > LONG:
            raise RuntimeError("simulated bug after insert")
        return n


class RaisesAfterFreeingDuplicates(RadixCache):
    """The duplicates are freed, then the helper raises (before rewriting the row)."""

    def _insert_and_free_duplicates(self, ids, kv, old_len):
        super()._insert_and_free_duplicates(ids, kv, old_len)
        if len(ids) > LONG:
            raise RuntimeError("simulated bug after freeing the duplicates")


def make(cache_cls, max_total_tokens: int = 4096, debug: bool = False, **scheduler) -> Scheduler:
    runner = ToyRunner(vocab_size=VOCAB, max_total_tokens=max_total_tokens)
    runner.token_allocator.debug_checks = debug
    config = Config.build({"scheduler": {"debug_kv_checks": debug, **scheduler}, "runtime": {"overlap": False}})
    cache = cache_cls(runner.req_to_token_pool, runner.token_allocator)
    return Scheduler(config, runner, cache, Registry.discover().load("policy", "fcfs")(),
                     cache_label=f"prefix cache {cache_cls.__name__!r} (test-dist)")


def accounted(sched: Scheduler) -> int:
    """Free + cached slots: the pool's size when no request holds KV and nothing leaked."""
    return sched.allocator.available_size() + sched.cache.evictable_size() + sched.cache.protected_size()


SHORT = [("s1", [5, 6, 7, 8], 5), ("s2", [9, 10, 11], 4)]
LONG_PROMPT = list(range(100, 100 + LONG + 8))


@pytest.mark.parametrize("cache_cls, words", [
    (MatchRaises, "RuntimeError: simulated bug in match_prefix"),
    (MatchReturnsTuple, "TypeError: match_prefix returned tuple, expected MatchResult (contract section 2)"),
])
def test_a_failing_match_prefix_fails_only_the_request_being_admitted(caplog, cache_cls, words):
    sched = make(cache_cls)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        res = run(sched, [("long1", LONG_PROMPT, 4), *SHORT, ("long2", LONG_PROMPT[::-1], 4)])
        res2 = run(sched, [("long3", LONG_PROMPT + [1], 3), ("s3", [40, 41, 42], 6)])
    for rid in ("long1", "long2"):
        out = res[rid]["out"]
        assert out.error_status == 500 and "prefix cache failed" in out.error and res[rid]["ids"] == [], out
    assert res2["long3"]["out"].error_status == 500
    for rid, prompt, n in SHORT:
        assert res[rid]["ids"] == toy_reference(prompt, n, VOCAB) and res[rid]["out"].error is None
    assert res2["s3"]["ids"] == toy_reference([40, 41, 42], 6, VOCAB)
    stats = sched.stats()
    assert stats["plugin_failures"] == 3 and stats["failed_requests"] == 3 and stats["finished_requests"] == 3
    first = f"prefix cache '{cache_cls.__name__}' (test-dist): match_prefix failed"
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].getMessage().startswith(first), caplog.text  # once, naming the cache
    assert words in caplog.text
    assert accounted(sched) == sched.allocator.size and sched.cache.protected_size() == 0
    assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size


def test_a_lock_call_that_raises_at_admission_fails_that_request():
    class LockRaises(RadixCache):
        armed = False  # the next inc_lock_ref raises (once): set after a finished, so b's admission hits it

        def inc_lock_ref(self, node):
            if self.armed:
                self.armed = False
                raise RuntimeError("simulated bug in inc_lock_ref")
            return super().inc_lock_ref(node)

    sched = make(LockRaises)
    assert run(sched, [("a", LONG_PROMPT, 3)])["a"]["out"].error is None
    sched.cache.armed = True
    res = run(sched, [("b", LONG_PROMPT + [7], 3), ("c", [40, 41, 42], 4)])
    assert res["b"]["out"].error_status == 500 and res["c"]["ids"] == toy_reference([40, 41, 42], 4, VOCAB)
    assert sched.stats()["plugin_failures"] == 1
    assert accounted(sched) == sched.allocator.size and sched.cache.protected_size() == 0


@pytest.mark.parametrize("cache_cls", [InsertRaises, InsertRaisesAfterInserting, RaisesAfterFreeingDuplicates])
@pytest.mark.parametrize("chunked", [None, 8])
def test_a_failing_insert_returns_the_requests_slots(cache_cls, chunked):
    """Defect 2: each failure leaked the request's slots until the pool was empty and every later
    request hung. After N failing requests, free + cached is the pool again, nothing stays locked,
    and a request that needs the whole pool is served."""
    pool = 160
    sched = make(cache_cls, max_total_tokens=pool, chunked_prefill_size=chunked)
    start = sched.allocator.available_size()
    assert start == pool
    # a cached short prompt first (its slots are the cache's), then failing long ones sharing it
    assert run(sched, [("a", [5, 6, 7, 8], 3)])["a"]["out"].error is None
    for i in range(8):  # 8 x 30 tokens > the pool: a leak would drain it
        prompt = [5, 6, 7, 8] + [200 + 7 * i + j for j in range(26)]
        res = run(sched, [(f"long{i}", prompt, 5)])
        out = res[f"long{i}"]["out"]
        assert out.error_status == 500 and "prefix cache failed" in out.error, out
        assert accounted(sched) == pool, (i, sched.allocator.available_size(), sched.cache.evictable_size())
        assert sched.cache.protected_size() == 0
    assert sched.stats()["plugin_failures"] == 8
    # the whole pool is usable again: a request that needs nearly all of it (short: insert never fails)
    big = run(sched, [("s", [9, 10, 11], 4)])
    assert big["s"]["ids"] == toy_reference([9, 10, 11], 4, VOCAB)
    assert sched.flush_cache() and sched.allocator.available_size() == pool


def test_a_failing_insert_with_debug_kv_checks_frees_nothing_twice():
    """Under debug_kv_checks a second free raises: the reclaim must not free what the cache freed or kept."""
    for cache_cls in (InsertRaisesAfterInserting, RaisesAfterFreeingDuplicates):
        sched = make(cache_cls, max_total_tokens=200, debug=True)
        run(sched, [("a", LONG_PROMPT[:LONG], 3)])
        for i in range(3):
            res = run(sched, [(f"b{i}", LONG_PROMPT + [i], 4)])
            assert res[f"b{i}"]["out"].error_status == 500
            assert accounted(sched) == 200
        assert sched.flush_cache() and sched.allocator.available_size() == 200


def test_match_result_problem_words():
    from radixserve.interfaces.prefix_cache import match_result_problem

    assert match_result_problem(MatchResult(torch.tensor([1, 2]), None), 2) is None
    assert match_result_problem((1, 2), 3) == "match_prefix returned tuple, expected MatchResult (contract section 2)"
    assert "int64 CPU" in match_result_problem(MatchResult(torch.tensor([1.0]), None), 3)
    assert "3 slots for a key of 2 tokens" in match_result_problem(MatchResult(torch.tensor([1, 2, 3]), None), 2)
