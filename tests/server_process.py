"""Test helper (not a test): start a `radixserve serve` subprocess, wait for it to answer /health,
and check what it leaves behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def with_tiny_tokenizer(model_dir: str) -> str:
    """`model_dir` (a tiny random checkpoint) with the tiny test tokenizer saved beside it, which a
    server or Engine needs: ~300 tokens, which the tiny models' 512 ids cover."""
    from radixserve.testing.grammar import tiny_tokenizer

    if not os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        tiny_tokenizer().save_pretrained(model_dir)
    return model_dir


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_server(cmd: list[str], log_path: Path, **popen_kwargs) -> tuple[subprocess.Popen, object]:
    """Start `cmd` with stdout and stderr into `log_path`: (the process, the open log file, which the
    caller closes once the process is gone)."""
    log = open(log_path, "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, **popen_kwargs), log


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


def child_pids(pid: int) -> list[int]:
    """The direct children of `pid`."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def descendant_pids(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        child, parent = (int(x) for x in line.split())
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def is_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def stop_server(proc: subprocess.Popen, timeout_s: float = 60.0) -> int:
    """SIGTERM `proc` (the graceful shutdown) and wait up to `timeout_s`; past that kill it, with
    its whole process group when it leads one (started with `start_new_session=True`). Returns its
    exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            proc.wait()
    return proc.returncode


class ServerProcess:
    """`radixserve serve --port <free port> *args` as a subprocess, healthy once constructed; its
    output goes to `log_path`. `new_session=True` starts it in its own process group (so a stuck
    shutdown can be ended with every process it started)."""

    def __init__(self, args: list[str], log_path: Path, timeout_s: float, new_session: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(self.port), *args]
        self.proc, self.log = spawn_server(cmd, log_path, start_new_session=new_session)
        wait_until_healthy(self.proc, self.url, log_path, timeout_s)

    def logs(self) -> str:
        """The last 5000 characters of the server's output so far."""
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()[-5000:]

    def stop(self) -> int:
        """`stop_server`, then close the log; the exit code."""
        code = stop_server(self.proc)
        self.log.close()
        return code
