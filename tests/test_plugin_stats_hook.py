"""A plugin's `radixserve_stats` hook receives the scheduler's stats (plugin-authoring.md lists it;
the core declared it but never called it until an outsider's plugin found out)."""

from __future__ import annotations

import logging
import types

from radixserve.plugins import hookimpl
from radixserve.plugins.registry import Registry
from radixserve.runtime.scheduler_process import SchedulerServer, StatsHookReporter


def _registry_with_stats_plugin(received: list[dict], fail: bool = False) -> Registry:
    module = types.ModuleType("stats_plugin")
    module.PLUGIN_API = ">=1,<2"

    @hookimpl
    def radixserve_stats(stats):
        if fail:
            raise RuntimeError("a bug in the plugin")
        received.append(stats)

    module.radixserve_stats = radixserve_stats
    registry = Registry()
    registry.add_builtin()
    registry.add_plugin_module(module, name="stats_plugin", distribution="stats-plugin")
    return registry


class _Scheduler:
    """Steps until `steps` run out; `stats()` says how many ran."""

    def __init__(self, steps: int) -> None:
        self.left, self.done = steps, 0

    def has_work(self) -> bool:
        return self.left > 0

    def step(self) -> list:
        self.left -= 1
        self.done += 1
        return []

    def stats(self) -> dict:
        return {"steps": self.done, "running": int(self.left > 0)}


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _serve(scheduler: _Scheduler, reporter: StatsHookReporter, clock: _Clock) -> None:
    """SchedulerServer.serve_forever without sockets: each step advances the clock by one second."""
    server = SchedulerServer.__new__(SchedulerServer)
    server.scheduler, server.stats_reporter, server.running = scheduler, reporter, True
    server.close = lambda: None

    def drain(block: bool) -> None:
        clock.now += 1.0
        if block:  # idle: a real server would wait for a message; the test ends here
            server.running = False

    server._drain = drain
    server.serve_forever()


def test_the_stats_hook_gets_stats_every_interval_while_busy_and_once_when_idle():
    received: list[dict] = []
    clock = _Clock()
    reporter = StatsHookReporter.for_registry(_registry_with_stats_plugin(received), interval_s=5.0, clock=clock)
    _serve(_Scheduler(steps=12), reporter, clock)
    # due at t=0 (first step at t=1), then every 5 s: after steps 1, 6, 11; the 12th step leaves it idle
    assert [s["steps"] for s in received] == [1, 6, 11, 12]
    assert received[-1]["running"] == 0, "the last report shows the idle scheduler"


def test_steps_while_idle_report_nothing():
    """Control messages wake an idle scheduler for a step with nothing to run: no report (the hook's
    contract: never while idle)."""
    received: list[dict] = []
    clock = _Clock()
    reporter = StatsHookReporter.for_registry(_registry_with_stats_plugin(received), interval_s=5.0, clock=clock)
    idle = _Scheduler(steps=0)
    for _ in range(3):
        had_work = idle.has_work()
        clock.now += 10.0
        reporter.after_step(idle, had_work)
    assert received == []


def test_a_failing_stats_hook_is_logged_and_serving_goes_on(caplog):
    clock = _Clock()
    reporter = StatsHookReporter.for_registry(_registry_with_stats_plugin([], fail=True), clock=clock)
    scheduler = _Scheduler(steps=3)
    with caplog.at_level(logging.ERROR):
        _serve(scheduler, reporter, clock)
    assert scheduler.done == 3
    assert any("radixserve_stats hook failed" in r.getMessage() for r in caplog.records)


def test_without_a_stats_plugin_no_stats_are_computed():
    registry = Registry()
    registry.add_builtin()
    reporter = StatsHookReporter.for_registry(registry)
    assert reporter.hook is None

    class NoStats(_Scheduler):
        def stats(self) -> dict:
            raise AssertionError("stats() computed for nobody")

    _serve(NoStats(steps=3), reporter, _Clock())
