"""The scheduler process survives a message whose handling fails (issue 12: one request must
never take the server down)."""

from __future__ import annotations

import logging

import msgspec
from radixserve.runtime.messages import (
    AbortRequest,
    BatchTokenOut,
    ControlReply,
    FlushCacheRequest,
    GenerateRequest,
    make_encoder,
    scheduler_decoder,
)
from radixserve.runtime.scheduler_process import SchedulerServer
from radixserve.state import SamplingParams


class _Scheduler:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, rid: str) -> bool:
        if rid == "boom":
            raise RuntimeError("a bug in abort")
        self.aborted.append(rid)
        return True

    def flush_refusal(self):
        raise RuntimeError("a bug in flush")

    def add_request(self, msg) -> None:
        raise RuntimeError("a bug in admission")

    failed_admissions = 0

    def count_failed_admission(self) -> None:
        self.failed_admissions += 1


class _Socket:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, raw: bytes) -> None:
        self.sent.append(raw)


def _server() -> SchedulerServer:
    server = SchedulerServer.__new__(SchedulerServer)  # no sockets: only message handling is tested
    server.scheduler = _Scheduler()
    server.dec = scheduler_decoder()
    server.enc = make_encoder()
    server.to_manager, server.to_detok = _Socket(), _Socket()
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


def test_whoever_waits_on_a_failed_message_gets_an_answer():
    """A flush whose handler raises must not leave /flush_cache waiting forever, nor a request
    whose admission raises leave its client hanging."""
    server = _server()
    enc = make_encoder()
    server._handle_safely(enc.encode(FlushCacheRequest(req_id=7)))
    server._handle_safely(enc.encode(GenerateRequest(rid="r1", input_ids=[1, 2], sampling_params=SamplingParams())))
    [reply] = [msgspec.msgpack.decode(raw, type=ControlReply) for raw in server.to_manager.sent]
    assert reply.req_id == 7 and reply.ok is False
    [batch] = [msgspec.msgpack.decode(raw, type=BatchTokenOut) for raw in server.to_detok.sent]
    [out] = batch.outs
    assert out.rid == "r1" and out.error_status == 500 and out.error
    assert server.scheduler.failed_admissions == 1  # counted in failed_requests as every other 500
