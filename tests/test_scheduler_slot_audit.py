"""The scheduler names a prefix cache that breaks KV slot ownership (audit 29, findings 1-3): locks
held or slots leaked with no request running, an impossible free + cached count, a leak left after
a flush; and with scheduler.debug_kv_checks a double free fails the request that does it (a 500)
instead of corrupting outputs. Each kind of violation is logged once, not every step.

The broken caches are RadixCache with one bug each, driven on the toy runner (whose outputs read
every token through its KV slot)."""

from __future__ import annotations

import logging

import pytest
from radixserve.config import Config
from radixserve.plugins.registry import Registry
from radixserve.runtime.messages import GenerateRequest
from radixserve.scheduler import Scheduler
from radixserve.state import SamplingParams
from radixserve.testing import ToyRunner, toy_reference
from radixserve_cache_radix.radix_cache import RadixCache

VOCAB = 1000
LOGGER = "radixserve.scheduler"


class NoUnlock(RadixCache):
    """cache_finished_req keeps the request's lock."""

    def cache_finished_req(self, req):
        self.dec_lock_ref = lambda node: None  # the unlock inside is skipped
        try:
            super().cache_finished_req(req)
        finally:
            del self.dec_lock_ref


class NoDupFree(RadixCache):
    """The request's slots that duplicate cached ones are never freed (leaked)."""

    def _insert_and_free_duplicates(self, ids, kv, old_len):
        self.insert(ids, kv)


class DupDoubleFree(RadixCache):
    """The duplicates are freed twice (with `only_at_finish`, only in cache_finished_req)."""

    only_at_finish = False
    _finishing = False

    def cache_finished_req(self, req):
        self._finishing = True
        try:
            super().cache_finished_req(req)
        finally:
            self._finishing = False

    def _insert_and_free_duplicates(self, ids, kv, old_len):
        cached = self.insert(ids, kv)
        self.allocator.free(kv[old_len:cached])
        if self._finishing or not self.only_at_finish:
            self.allocator.free(kv[old_len:cached])


class FinishDoubleFree(DupDoubleFree):
    only_at_finish = True


class EvictRaises(RadixCache):
    def evict(self, num_tokens):
        if num_tokens > 0:
            raise ValueError("free: slot already free (double free)")
        return 0


def make(cache_cls, debug: bool, max_total_tokens: int = 4096, **scheduler) -> Scheduler:
    runner = ToyRunner(vocab_size=VOCAB, max_total_tokens=max_total_tokens)
    runner.token_allocator.debug_checks = debug  # the toy runner checks by default; the server does not
    config = Config.build({"scheduler": {"debug_kv_checks": debug, **scheduler}, "runtime": {"overlap": False}})
    registry = Registry.discover()
    cache = cache_cls(runner.req_to_token_pool, runner.token_allocator)
    return Scheduler(config, runner, cache, registry.load("policy", "fcfs")(),
                     cache_label=f"prefix cache {cache_cls.__name__!r} (test)")


def run(sched: Scheduler, reqs: list[tuple[str, list[int], int]], max_steps: int = 5000) -> dict:
    for rid, prompt, n in reqs:
        sched.add_request(GenerateRequest(rid=rid, input_ids=prompt,
                                          sampling_params=SamplingParams(max_new_tokens=n, temperature=0)))
    res: dict[str, dict] = {}
    for _ in range(max_steps):
        for out in sched.step():
            r = res.setdefault(out.rid, {"ids": [], "out": None})
            r["ids"] += out.new_ids
            r["out"] = out
        if not sched.has_work():
            return res
    raise AssertionError("did not finish")


def lines(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and r.name.startswith(LOGGER)]


PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def test_the_built_scheduler_names_its_cache_by_stack_name_and_distribution():
    config = Config.build({"stack": {"prefix_cache": "radix"}})
    sched = Scheduler.from_config(config, ToyRunner(vocab_size=VOCAB), Registry.discover())
    assert sched.cache_label == "prefix cache 'radix' (radixserve-cache-radix)"


def test_a_correct_cache_logs_nothing(caplog):
    sched = make(RadixCache, debug=False, max_total_tokens=64)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        # shared prefixes, a repeated prompt, eviction under a small pool
        res = run(sched, [("a", PROMPT, 6), ("b", PROMPT, 6), ("c", PROMPT + [1, 2], 20), ("d", [3] * 30, 20)])
        assert sched.flush_cache()
    assert all(res[r]["ids"] == toy_reference(p, n, VOCAB) for r, p, n in
               [("a", PROMPT, 6), ("b", PROMPT, 6), ("c", PROMPT + [1, 2], 20), ("d", [3] * 30, 20)])
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_locks_held_with_nothing_running_are_named_once(caplog):
    """Finding 2: the request that can never fit waited forever and the log said nothing."""
    sched = make(NoUnlock, debug=False)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        run(sched, [("a", PROMPT, 4)])
        run(sched, [("b", PROMPT + [1], 4)])
        for _ in range(5):  # idle steps: still one line
            sched.step()
    got = lines(caplog, logging.WARNING)
    assert len(got) == 1, got
    # the lock taken on the prompt's 8 tokens after its prefill stays
    assert got[0].startswith("prefix cache 'NoUnlock' (test) holds 8 locked slots with no request running: "
                             "cache_finished_req must release the request's lock (docs/contracts.md section 2), and a "
                             "schedule policy must not lock (section 4)"), got
    # cache/policy audit 33: /flush_cache answered "requests are running" with none running (reset() refused the locks)
    refusal = sched.flush_refusal()
    assert refusal is not None and refusal.status == 500, refusal
    assert refusal.message.startswith("prefix cache 'NoUnlock' (test) still holds 9 locked KV slots with no request "
                                      "running, so it cannot be flushed: a lock was never released"), refusal


def test_a_request_that_can_never_fit_past_locked_slots_ends_instead_of_waiting_forever():
    """Audit 37c (D6): with a cache that never unlocks, the locked slots are never evicted; a request needing more
    than the rest waited forever, nothing running, while /health said 200. It now ends with a 500 saying why, and the
    server goes on serving what fits."""
    sched = make(NoUnlock, debug=False, max_total_tokens=40)
    run(sched, [("a", list(range(1, 21)), 2)])  # its 20 prompt slots stay locked
    res = run(sched, [("b", list(range(100, 130)), 2)])  # 30 slots: never, with 20 locked of 40
    out = res["b"]["out"]
    assert out.error_status == 500 and out.error.startswith("the KV pool can never make room for this request: 30 "
                                                           "slots needed"), out.error
    assert "prefix cache 'NoUnlock' (test) holds 20 locked slots" in out.error, out.error
    small = run(sched, [("c", [7, 8, 9], 2)])  # what fits is still served
    assert small["c"]["ids"] == toy_reference([7, 8, 9], 2, VOCAB)


def test_a_reset_that_raises_is_the_flush_refusal_a_500_naming_the_cache():
    class ResetFails(RadixCache):
        def reset(self):
            raise RuntimeError("index corrupt")

    sched = make(ResetFails, debug=False)
    run(sched, [("a", PROMPT, 4)])
    refusal = sched.flush_refusal()
    assert refusal is not None and refusal.status == 500
    assert refusal.message.startswith("prefix cache 'ResetFails' (test) failed to reset: RuntimeError: index corrupt")
    assert not sched.flush_cache()


def test_a_flush_while_requests_run_is_a_400_that_counts_them():
    sched = make(RadixCache, debug=False)
    sched.add_request(GenerateRequest(rid="a", input_ids=PROMPT, sampling_params=SamplingParams(max_new_tokens=50)))
    sched.step()
    refusal = sched.flush_refusal()
    assert refusal is not None and refusal.status == 400
    assert refusal.message.startswith("cannot flush the cache while requests are running (1 running, 0 waiting)")


def test_a_prompt_prefilled_in_chunks_counts_as_running_in_the_flush_refusal():
    """Long-context audit 34: during a chunked prefill the refusal said "(0 running, 0 waiting)"."""
    sched = make(RadixCache, debug=False, chunked_prefill_size=4)
    sched.add_request(GenerateRequest(rid="a", input_ids=list(range(5, 45)), sampling_params=SamplingParams(max_new_tokens=5)))
    sched.step()
    assert sched.chunked_req is not None and not sched.running
    refusal = sched.flush_refusal()
    assert refusal is not None and refusal.message.startswith("cannot flush the cache while requests are running "
                                                              "(1 running, 0 waiting)"), refusal


def test_leaked_slots_are_named_when_idle_and_after_a_flush(caplog):
    """Finding 3: 48 slots gone after /flush_cache, and no line (and, until session 38, /flush_cache said ok)."""
    sched = make(NoDupFree, debug=False)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        run(sched, [("a", PROMPT, 4)])
        assert not caplog.records  # nothing leaked yet: no duplicates
        # duplicates: the prompt's last token (recomputed) and the KV of its 3 committed outputs (a's too)
        res = run(sched, [("b", PROMPT, 4)])
        for _ in range(5):
            sched.step()
        # the cache is emptied, but /flush_cache must not answer ok while the leaked slots stay taken
        for _ in range(2):  # again: still one line of each kind
            refusal = sched.flush_refusal()
            assert refusal is not None and refusal.status == 500, refusal
            assert refusal.message == ("prefix cache 'NoDupFree' (test) was emptied, but 4 of 4096 KV slots are still "
                                       "not free: the cache leaked them (it must free every slot it does not keep: "
                                       "docs/contracts.md section 1); restart the server to recover the slots")
            assert sched.cache.evictable_size() == 0
    assert res["b"]["ids"] == toy_reference(PROMPT, 4, VOCAB)
    got = lines(caplog, logging.WARNING)
    assert len(got) == 2, got
    assert got[0] == ("prefix cache 'NoDupFree' (test): with no request running, 4081 free + 11 cached = 4092 of 4096 KV "
                      "slots: 4 leaked (owned by nobody); the cache must free every slot it does not keep, such as the "
                      "duplicates in cache_unfinished_req / cache_finished_req (docs/contracts.md sections 1-2)")
    assert got[1].startswith("prefix cache 'NoDupFree' (test): after reset() with no request running, 4092 of 4096 KV "
                             "slots are free (0 still counted as cached)"), got


def test_an_impossible_count_is_an_error_line_once(caplog):
    """Finding 1 without the debug switch: free + cached above the pool size is named as an error."""
    sched = make(DupDoubleFree, debug=False)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        run(sched, [("a", PROMPT, 4)])
        run(sched, [("b", PROMPT, 4)])  # its duplicates freed twice: they may be handed out twice next
        for _ in range(3):
            sched.step()
    # named before the corruption shows (the toy runner then sees a slot written twice: a failed batch)
    errors = lines(caplog, logging.ERROR)
    assert [e.startswith("prefix cache") for e in errors].count(True) == 1 and errors[0].startswith("prefix cache"), errors
    assert errors[0].startswith("prefix cache 'DupDoubleFree' (test): 4086 free + 11 cached = 4097 KV slots, more than "
                                "the pool's 4096"), errors
    assert "a slot was freed twice" in errors[0] and "scheduler.debug_kv_checks=true" in errors[0]


def test_with_debug_kv_checks_a_double_free_fails_only_that_request(caplog):
    """Finding 1 with the switch: the request whose cache call double-frees ends with a 500 naming the
    prefix cache in the log; the others keep their outputs and the server goes on."""
    sched = make(DupDoubleFree, debug=True)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        first = run(sched, [("a", PROMPT, 4)])
        second = run(sched, [("b", PROMPT, 4), ("c", [40, 41, 42, 43], 6)])
    assert first["a"]["ids"] == toy_reference(PROMPT, 4, VOCAB)
    out = second["b"]["out"]
    assert out.error_status == 500 and "prefix cache failed" in out.error and second["b"]["ids"] == []
    assert second["c"]["ids"] == toy_reference([40, 41, 42, 43], 6, VOCAB) and second["c"]["out"].error is None
    assert sched.stats()["failed_requests"] == 1 and sched.stats()["finished_requests"] == 2
    assert "prefix cache 'DupDoubleFree' (test): cache_unfinished_req raised" in caplog.text
    assert "ValueError: free: slot already free (double free)" in caplog.text  # the traceback, once
    assert "locked slots" not in caplog.text  # the failed request's lock was released
    assert not sched.running and not sched.waiting and sched.req_to_token_pool.available_size() == \
        sched.req_to_token_pool.size
    # and the server still serves
    assert run(sched, [("d", [50, 51, 52], 5)])["d"]["ids"] == toy_reference([50, 51, 52], 5, VOCAB)


def test_with_debug_kv_checks_a_double_free_at_finish_fails_that_request(caplog):
    """cache_finished_req's double free: a 500 for that request instead of its output."""
    sched = make(FinishDoubleFree, debug=True)
    assert run(sched, [("a", PROMPT, 4)])["a"]["ids"] == toy_reference(PROMPT, 4, VOCAB)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        res = run(sched, [("b", PROMPT, 4)])  # its output tokens' slots duplicate a's: freed twice at finish
    assert res["b"]["out"].error_status == 500 and res["b"]["ids"] == []
    assert "prefix cache 'FinishDoubleFree' (test): cache_finished_req raised" in caplog.text
    assert sched.stats()["failed_requests"] == 1 and sched.stats()["finished_requests"] == 1


def test_an_evict_that_raises_is_named_and_the_request_that_needs_it_ends():
    """An evict that raises (a double free under debug_kv_checks) neither stops the server nor
    leaves the request that needed the room waiting forever."""
    sched = make(EvictRaises, debug=True, max_total_tokens=40)
    first = run(sched, [("a", list(range(1, 21)), 4)])
    assert first["a"]["ids"] == toy_reference(list(range(1, 21)), 4, VOCAB)
    res = run(sched, [("b", list(range(100, 125)), 4)])  # needs the cached slots back
    assert res["b"]["out"].error_status == 500 and "prefix cache failed" in res["b"]["out"].error
    assert sched.flush_cache() and sched.allocator.available_size() == sched.allocator.size


@pytest.mark.parametrize("debug", [False, True])
def test_debug_kv_checks_reaches_the_model_runners_allocator(tiny_llama_dir, debug):
    from radixserve.model_runner import ModelRunner

    cfg = Config.build({"model": {"path": tiny_llama_dir("llama")}, "runtime": {"device": "cpu", "num_threads": 1},
                        "scheduler": {"max_total_tokens": 64, "max_running_requests": 2, "debug_kv_checks": debug}})
    alloc = ModelRunner(cfg, show_progress=False).token_allocator
    assert alloc.debug_checks is debug
    if debug:
        slots = alloc.alloc(2)
        alloc.free(slots)
        with pytest.raises(ValueError, match="double free"):
            alloc.free(slots)
