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
