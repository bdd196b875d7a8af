"""Test helper (not a test): wait for a `radixserve serve` subprocess to answer /health."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx


def wait_until_healthy(proc: subprocess.Popen, url: str, log_path: Path, timeout_s: float) -> None:
    """Return once GET {url}/health answers 200; raise AssertionError with the log's tail if the
    server exits first or is not healthy within `timeout_s` (then it is killed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"server did not become healthy:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.3)
