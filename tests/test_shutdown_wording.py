"""The graceful shutdown's log says what a second signal does, in the words of the first one."""

from __future__ import annotations

import asyncio
import logging
import signal

import pytest
from radixserve.server.shutdown import GracefulShutdown


class _Manager:
    def __init__(self, running: int) -> None:
        self.running = running

    def stop_admitting(self, reason: str) -> None:
        pass

    def in_flight(self) -> int:
        return self.running

    def end_in_flight(self, reason: str) -> None:
        self.running = 0


class _Server:
    should_exit = False
    force_exit = False


def _waiting_line(sig: int, caplog) -> str:
    async def run() -> None:
        sd = GracefulShutdown(_Manager(running=2), grace_s=60)
        sd.server = _Server()
        sd.on_signal(sig)
        await asyncio.sleep(0.1)
        sd.on_signal(sig)  # the hint is true: a second one of the same signal ends them now
        while not sd.server.should_exit:
            await asyncio.sleep(0.01)

    with caplog.at_level(logging.INFO, logger="radixserve.server"):
        asyncio.run(run())
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting up to")]
    return line


@pytest.mark.parametrize("sig, hint", [
    (signal.SIGTERM, "(send SIGTERM or SIGINT again to end them now)"),
    (signal.SIGINT, "(Ctrl-C again to end them now)"),
])
def test_the_waiting_line_names_the_signal_that_hurries(sig, hint, caplog):
    line = _waiting_line(sig, caplog)
    assert line == f"waiting up to 60.0 s for 2 in-flight request(s) {hint}"


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_a_late_result_to_a_cancelled_future_logs_no_traceback_once_shutting_down(loop_kind, caplog):
    """CI (session 37): a router's SIGTERM ended a stream mid-read and the loop logged "Exception in callback
    Future.set_result ... InvalidStateError" with a traceback; from shutdown on it goes to the debug log, and any
    other callback error is still reported."""
    from radixserve.server.shutdown import quiet_late_results

    async def main() -> list:
        loop = asyncio.get_running_loop()
        reported: list = []
        loop.set_exception_handler(lambda lp, ctx: reported.append(ctx["message"]))
        quiet_late_results(loop)
        late = loop.create_future()
        loop.call_soon(late.set_result, 1)
        late.cancel()
        loop.call_soon(lambda: 1 / 0)  # not a late result: still the loop's handler's
        await asyncio.sleep(0.01)
        return reported

    with caplog.at_level(logging.DEBUG, logger="radixserve.server"):
        if loop_kind == "uvloop":
            import uvloop

            reported = uvloop.run(main())
        else:
            reported = asyncio.run(main())
    assert len(reported) == 1 and "Exception in callback" in reported[0], reported
    assert any("a result came after its request ended" in r.getMessage() for r in caplog.records)
