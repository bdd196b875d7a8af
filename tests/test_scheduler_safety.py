"""The scheduler process survives a message whose handling fails (issue 12: one request must
never take the server down)."""

from __future__ import annotations

import logging

from radixserve.runtime.messages import AbortRequest, FlushCacheRequest, make_encoder, scheduler_decoder
from radixserve.runtime.scheduler_process import SchedulerServer


class _Scheduler:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, rid: str) -> bool:
        if rid == "boom":
            raise RuntimeError("a bug in abort")
        self.aborted.append(rid)
        return True

    def flush_cache(self) -> bool:
        raise RuntimeError("a bug in flush")


def _server() -> SchedulerServer:
    server = SchedulerServer.__new__(SchedulerServer)  # no sockets: only message handling is tested
    server.scheduler = _Scheduler()
    server.dec = scheduler_decoder()
    server.running = True
    return server


def test_a_failing_or_garbled_message_is_logged_and_the_loop_keeps_serving(caplog):
    server = _server()
    enc = make_encoder()
    with caplog.at_level(logging.ERROR):
        server._handle_safely(enc.encode(AbortRequest("boom")))
        server._handle_safely(b"\xff not a message")
        server._handle_safely(enc.encode(FlushCacheRequest(req_id=1)))
        server._handle_safely(enc.encode(AbortRequest("fine")))
    assert server.running and server.scheduler.aborted == ["fine"]
    failures = [r for r in caplog.records if "dropped a message" in r.getMessage()]
    assert len(failures) == 3 and all(r.exc_info for r in failures), "one traceback per failure"
