"""Graceful shutdown of the HTTP server on SIGINT / SIGTERM.

First signal: stop admitting (new requests get 503 in the OpenAI error shape, /health turns 503),
give the in-flight requests up to `grace_s` to finish, end the rest with an error (a final SSE
`data: {"error": ...}` event then `data: [DONE]`, or the error body of a non-streaming request),
then let uvicorn close the connections. A second signal ends the in-flight requests at once; a
third makes uvicorn stop waiting for connections. launch.py stops the runtime's children after.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any

logger = logging.getLogger("radixserve.server")

SHUTDOWN_MESSAGE = "the server is shutting down"
POLL_S = 0.05


def _late_result_to_a_cancelled_future(context: dict[str, Any]) -> bool:
    """The loop's report of a callback that set a result on a future already cancelled: a read or timer that
    completed in the same loop pass as the request ending it. Harmless (the result has no reader), but logged
    as a traceback; it shows up when shutdown ends streams mid-read (CI under load, session 37)."""
    handle, exc = context.get("handle"), context.get("exception")
    # uvloop's handles do not expose their callback: its name is in their repr (`<Handle Future.set_result>`)
    return isinstance(exc, asyncio.InvalidStateError) and "Future.set_result" in repr(handle)


def quiet_late_results(loop: asyncio.AbstractEventLoop) -> None:
    """From shutdown on, `_late_result_to_a_cancelled_future` reports go to the debug log, not as a traceback;
    every other report keeps the loop's handler."""
    previous = loop.get_exception_handler()

    def handler(lp: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if _late_result_to_a_cancelled_future(context):
            logger.debug("a result came after its request ended (shutdown): %s", context.get("message"))
        elif previous is not None:
            previous(lp, context)
        else:
            lp.default_exception_handler(context)

    loop.set_exception_handler(handler)


class GracefulShutdown:
    """Drives one shutdown of `server` (a uvicorn.Server, set once built) around the
    TokenizerManager `tm`."""

    def __init__(self, tm: Any, grace_s: float) -> None:
        self.tm = tm
        self.server: Any = None
        self.grace_s = grace_s
        self.signals = 0
        self._hurry = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def started(self) -> bool:
        return self._task is not None

    def on_signal(self, sig: int) -> None:
        self.signals += 1
        name = signal.Signals(sig).name
        if self._task is None:
            logger.info("%s received: shutting down (no new requests)", name)
            loop = asyncio.get_running_loop()
            quiet_late_results(loop)
            self._task = loop.create_task(self._run(sig))
        elif self.signals == 2:
            logger.info("%s received again: ending the in-flight requests now", name)
            self._hurry.set()
        else:
            logger.info("%s received again: closing the connections now", name)
            self.server.force_exit = True

    async def _run(self, sig: int = signal.SIGINT) -> None:
        self.tm.stop_admitting(SHUTDOWN_MESSAGE)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace_s
        if self.tm.in_flight() and self.grace_s > 0:
            # either signal hurries (on_signal): a supervisor's SIGTERM came from no terminal
            again = "Ctrl-C again" if sig == signal.SIGINT else "send SIGTERM or SIGINT again"
            logger.info(
                "waiting up to %.1f s for %d in-flight request(s) (%s to end them now)",
                self.grace_s,
                self.tm.in_flight(),
                again,
            )
        while self.tm.in_flight() and not self._hurry.is_set() and loop.time() < deadline:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._hurry.wait(), POLL_S)
        left = self.tm.in_flight()
        if left:
            logger.warning("ending %d request(s) still running: %s", left, SHUTDOWN_MESSAGE)
            self.tm.end_in_flight(SHUTDOWN_MESSAGE)
        self.server.should_exit = True
