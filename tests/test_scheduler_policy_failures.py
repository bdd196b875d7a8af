"""A schedule policy's bug does not end the runtime (audit 30): an `order()` that raises, or returns
something other than the waiting requests each once, makes that step admit in arrival order, the
log names the policy (traceback once, then a count), and every request still finishes with the
outputs it has alone. `Req.arrival_time` is monotonic seconds (a policy can age requests), no longer
a counter that read as 50,000 s of waiting.

Driven on the toy runner (whose outputs read every token through its KV slot)."""

from __future__ import annotations

import logging
import time

from radixserve.config import Config
from radixserve.interfaces import SchedulePolicy
from radixserve.plugins.registry import Registry
from radixserve.runtime.messages import GenerateRequest
from radixserve.scheduler import Scheduler
from radixserve.state import SamplingParams
from radixserve.testing import ToyRunner, toy_reference
from radixserve_cache_radix.radix_cache import RadixCache

VOCAB = 1000
LOGGER = "radixserve.scheduler"
REQS = [("a", [5, 6, 7, 8], 6), ("b", [9, 10, 11], 5), ("c", [12, 13, 14, 15, 16], 4)]


class Raises(SchedulePolicy):
    def __init__(self) -> None:
        self.calls = 0

    def order(self, waiting, cache):
        self.calls += 1
        raise RuntimeError("policy bug")


class DropsOne(SchedulePolicy):
    """Returns all but the last waiting request: that one would never be admitted."""

    def order(self, waiting, cache):
        return waiting[:-1]


class MatchesThenRaises(SchedulePolicy):
    """Stores a prefix match (as the contract allows) and then raises."""

    def order(self, waiting, cache):
        for r in waiting:
            m = cache.match_prefix(r.fill_ids)
            r.prefix_indices, r.last_node = m.kv_indices, m.last_node
        raise ValueError("after matching")


class Records(SchedulePolicy):
    def __init__(self) -> None:
        self.seen: dict[str, float] = {}

    def order(self, waiting, cache):
        self.seen.update({r.rid: r.arrival_time for r in waiting})
        return sorted(waiting, key=lambda r: r.arrival_time)


def make(policy: SchedulePolicy, max_running: int = 8) -> Scheduler:
    runner = ToyRunner(vocab_size=VOCAB, max_total_tokens=4096)
    config = Config.build({"scheduler": {"max_running_requests": max_running}, "runtime": {"overlap": False}})
    cache = RadixCache(runner.req_to_token_pool, runner.token_allocator)
    return Scheduler(config, runner, cache, policy, policy_label="policy 'buggy' (test-dist)")


def run(sched: Scheduler, reqs, max_steps: int = 2000) -> dict[str, list[int]]:
    for rid, prompt, n in reqs:
        sched.add_request(GenerateRequest(rid=rid, input_ids=prompt,
                                          sampling_params=SamplingParams(max_new_tokens=n, temperature=0)))
    res: dict[str, list[int]] = {}
    for _ in range(max_steps):
        for out in sched.step():
            assert out.error is None, out.error
            res.setdefault(out.rid, []).extend(out.new_ids)
        if not sched.has_work():
            return res
    raise AssertionError(f"did not finish: {sorted(res)}")


def expected() -> dict[str, list[int]]:
    return {rid: toy_reference(p, n, VOCAB) for rid, p, n in REQS}


def test_a_policy_that_raises_is_named_once_and_serving_goes_on(caplog):
    policy = Raises()
    sched = make(policy, max_running=1)  # a queue: order() runs on many steps
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert run(sched, REQS) == expected()
    assert policy.calls >= 3
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith(LOGGER)]
    assert len(errors) == 1, caplog.text  # the traceback once, not once per step
    assert errors[0].getMessage().startswith("policy 'buggy' (test-dist): order() failed; this step admits in "
                                             "arrival order")
    assert errors[0].exc_info and "policy bug" in str(errors[0].exc_info[1])


def test_a_policy_that_drops_a_request_cannot_starve_it(caplog):
    sched = make(DropsOne(), max_running=1)
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        assert run(sched, REQS) == expected()
    assert "returned 2 requests for 3 waiting, not a permutation" in caplog.text


def test_a_match_stored_before_the_failure_is_dropped_not_leaked():
    sched = make(MatchesThenRaises())
    run(sched, [("warm", [5, 6, 7, 8, 1, 2], 3)])  # something cached for the failing policy to match and lock
    assert run(sched, REQS) == expected()
    assert sched.cache.protected_size() == 0  # nothing locked is left behind


def test_arrival_time_is_monotonic_seconds_and_strictly_increasing():
    policy = Records()
    sched = make(policy)
    before = time.monotonic()
    run(sched, REQS)
    after = time.monotonic()
    times = [policy.seen[rid] for rid, _, _ in REQS]
    assert all(before <= t <= after + 1e-3 for t in times), (before, times, after)
    assert times == sorted(times) and len(set(times)) == len(times)


def test_the_built_scheduler_names_its_policy_by_stack_name_and_distribution():
    config = Config.build({"stack": {"policy": "priority"}})
    sched = Scheduler.from_config(config, ToyRunner(vocab_size=VOCAB), Registry.discover())
    assert sched.policy_label == "policy 'priority' (radixserve-policies)"


class ReturnsNone(SchedulePolicy):
    def order(self, waiting, cache):
        waiting.sort(key=lambda r: r.arrival_time)  # sorts in place and forgets to return the list


class ReturnsRids(SchedulePolicy):
    def order(self, waiting, cache):
        return [r.rid for r in waiting]


class ReturnsTuple(SchedulePolicy):
    def order(self, waiting, cache):
        return tuple(reversed(waiting))


def test_a_wrong_return_type_is_named_in_the_kits_words(caplog):
    """Plugin-author audit 37, D5: the log said `TypeError: 'NoneType' object is not iterable` where the
    conformance kit says `returned NoneType, not a list`."""
    for policy, words in ((ReturnsNone(), "order() returned NoneType, not a list (contract section 4)"),
                          (ReturnsRids(), "order() returned a list of str, not the waiting requests themselves")):
        caplog.clear()
        sched = make(policy, max_running=1)
        with caplog.at_level(logging.ERROR, logger=LOGGER):
            assert run(sched, REQS) == expected()  # served as before, in arrival order
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith(LOGGER)]
        assert len(errors) == 1 and words in str(errors[0].exc_info[1]), caplog.text
        assert "policy 'buggy' (test-dist): order() failed" in errors[0].getMessage()
        assert sched.stats()["plugin_failures"] >= 1
    sched = make(ReturnsTuple(), max_running=1)  # a sequence of the requests themselves is still taken
    assert run(sched, REQS) == expected() and sched.stats()["plugin_failures"] == 0


class Counts(SchedulePolicy):
    def __init__(self) -> None:
        self.calls: list[int] = []

    def order(self, waiting, cache):
        self.calls.append(len(waiting))
        return list(waiting)


def test_order_is_not_called_while_no_waiting_request_can_be_admitted():
    """Plugin-author audit 37, D7: with the batch full (max_running_requests) order() ran on every decode
    step while requests waited, so a slow policy slowed every step; it runs only when a request can be
    admitted."""
    policy = Counts()
    sched = make(policy, max_running=1)
    assert run(sched, REQS) == expected()
    assert policy.calls == [3, 2, 1], policy.calls  # once per admission, not once per step (15 decode steps)
    policy = Counts()
    sched = make(policy, max_running=8)  # room for all: one call admits them
    assert run(sched, REQS) == expected()
    assert policy.calls == [3], policy.calls
