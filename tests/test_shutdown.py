"""Shutdown of `radixserve serve` with streams in flight, as a terminal (Ctrl-C: SIGINT to the whole
process group) and a supervisor (SIGTERM to the main pid) do it: exit 0 within the grace period
plus 2 s, new requests refused with 503 meanwhile, every stream ending with a final error or done
event, no traceback in the log, no child process left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_process import child_pids, free_port, is_alive, wait_until_healthy

GRACE_S = 2.0
STREAMS = 8
START_TIMEOUT_S = 600


class _Stream(threading.Thread):
    """One streaming /v1/completions request long enough to outlast the grace period; records every
    SSE data payload."""

    def __init__(self, url: str, model: str, index: int) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.index = url, model, index
        self.events: list[str] = []
        self.first = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {
            "model": self.model,
            "prompt": f"Story {self.index}: once upon a time",
            "max_tokens": 1500,
            "ignore_eos": True,
            "temperature": 0.8,
            "stream": True,
        }
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: ") :])
                        self.first.set()
        except BaseException as e:  # a cut connection: the test reports it
            self.error = e
        finally:
            self.first.set()


def _start_server(log_path: Path) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port),
        f"server.shutdown_grace_s={GRACE_S}", "scheduler.cpu_kv_cache_gb=1.0", "runtime.num_threads=1",
    ]  # fmt: skip
    log = open(log_path, "w")
    # its own session, like a shell's foreground job: os.killpg then reaches exactly what a terminal's Ctrl-C would
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(proc, url, log_path, START_TIMEOUT_S)
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    return proc, url, model


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl_c_to_the_process_group", "sigterm_to_the_main_pid"])
def test_signal_with_streams_in_flight_exits_cleanly(tmp_path, how):
    log_path = tmp_path / "server.log"
    proc, url, model = _start_server(log_path)
    try:
        children = child_pids(proc.pid)
        assert len(children) == 2, children
        streams = [_Stream(url, model, i) for i in range(STREAMS)]
        for s in streams:
            s.start()
        for s in streams:
            assert s.first.wait(120), "a stream produced no event"
        assert all(s.error is None and s.events for s in streams), [s.error for s in streams]

        signalled = time.monotonic()
        if how == "ctrl_c_to_the_process_group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        time.sleep(0.3)
        # while the in-flight requests drain: refused in the OpenAI error shape
        refused = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503, refused.text
        # the reason /health gives, not "the runtime is not healthy" (it is healthy, and stopping)
        assert refused.json()["error"]["message"].startswith("the server is shutting down"), refused.text
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["error"]["message"] == "the server is shutting down"

        code = proc.wait(GRACE_S + 30)
        took = time.monotonic() - signalled
        for s in streams:
            s.join(10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = log_path.read_text()
    assert code == 0, log[-4000:]
    assert took <= GRACE_S + 2, f"exit took {took:.1f} s\n{log[-4000:]}"
    assert "Traceback" not in log, log[-6000:]
    for s in streams:
        assert s.error is None, f"stream {s.index} was cut: {s.error!r}"
        assert s.events[-1] == "[DONE]", s.events[-3:]
        last = json.loads(s.events[-2])
        # the grace period is shorter than the streams: each ends with the shutdown error event
        assert "error" in last or last["choices"][0]["finish_reason"], last
        # one code per outcome (operator audit 30: "503" here, "service_unavailable" for a refused request)
        assert "error" not in last or last["error"]["code"] == "service_unavailable", last
    assert any("error" in json.loads(s.events[-2]) for s in streams)
    deadline = time.monotonic() + 5
    while any(is_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(is_alive(c) for c in children), "a child process outlived the server"


class _FakeManager:
    """The TokenizerManager surface GracefulShutdown uses; requests finish when told."""

    def __init__(self, running: int) -> None:
        self.running = running
        self.stopped_with: str | None = None
        self.ended_with: str | None = None

    def stop_admitting(self, reason: str) -> None:
        self.stopped_with = reason

    def in_flight(self) -> int:
        return self.running

    def end_in_flight(self, reason: str) -> None:
        self.ended_with = reason
        self.running = 0


class _FakeServer:
    should_exit = False
    force_exit = False


def _shutdown(tm: _FakeManager, grace_s: float):
    from radixserve.server.shutdown import GracefulShutdown

    sd = GracefulShutdown(tm, grace_s)
    sd.server = _FakeServer()
    return sd


def test_requests_that_finish_within_the_grace_period_are_not_ended():
    import asyncio

    async def run() -> _FakeManager:
        tm = _FakeManager(running=2)
        sd = _shutdown(tm, grace_s=30)
        sd.on_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        assert tm.stopped_with and not sd.server.should_exit  # draining, still serving
        tm.running = 0  # the requests finish
        await asyncio.sleep(0.2)
        assert sd.server.should_exit
        return tm

    assert asyncio.run(run()).ended_with is None


def test_a_second_signal_ends_the_in_flight_requests_at_once():
    import asyncio

    async def run() -> tuple[_FakeManager, float]:
        tm = _FakeManager(running=3)
        sd = _shutdown(tm, grace_s=60)
        sd.on_signal(signal.SIGINT)
        await asyncio.sleep(0.1)
        assert not sd.server.should_exit
        started = time.monotonic()
        sd.on_signal(signal.SIGINT)
        while not sd.server.should_exit:
            await asyncio.sleep(0.01)
        return tm, time.monotonic() - started

    tm, took = asyncio.run(run())
    assert took < 1 and tm.ended_with == "the server is shutting down"
