"""The router's replicas: one full RadixServe server each (its own TokenizerManager, scheduler and
detokenizer; TP ranks too, once a replica's config asks for them), serving HTTP on a unix socket
in the router's private 0700 directory.

A replica is started as `python -m radixserve.server.router.replica_main` with its spec (config,
socket path, parent pid) as JSON on stdin, in its own session: a terminal's Ctrl-C reaches the
router only, and the router alone decides when replicas stop (SIGTERM: the replica's own graceful
shutdown; SIGKILL after a timeout). A replica whose router died exits by itself (a watchdog)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import httpx

from radixserve.config import Config
from radixserve.cpu_cores import usable_cores
from radixserve.runtime.child import sys_path_for_children

logger = logging.getLogger("radixserve.router")

MODULE = "radixserve.server.router.replica_main"
STOP_TIMEOUT_S = 20.0
READY_POLL_S = 0.5


class ReplicaStartError(RuntimeError):
    """A replica exited (`exit_code`) or did not become healthy (`exit_code` None) during startup."""

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def replica_config(config: Config, index: int) -> Config:
    """The config one replica runs: the router's, as a single engine with no key on its private
    socket, and on the CPU with its share of the cores unless runtime.num_threads says otherwise."""
    runtime: dict[str, Any] = {"dp_size": 1}
    if config.runtime.num_threads is None and config.runtime.resolved_device() == "cpu":
        runtime["num_threads"] = max(1, usable_cores() // config.runtime.dp_size)
    return config.with_overrides({"runtime": runtime, "server": {"api_key": None}})


@dataclass(eq=False)
class Replica:
    index: int
    socket_path: str
    proc: subprocess.Popen
    client: httpx.AsyncClient
    flights: set = field(default_factory=set)  # router.Flight objects in progress on this replica
    alive: bool = True
    dead_reason: str | None = None
    stop_watch: Any = None

    @property
    def load(self) -> int:
        return len(self.flights)


def spawn_replica(config: Config, index: int, socket_path: str) -> Replica:
    spec = {
        "index": index,
        "config": replica_config(config, index).model_dump(mode="json"),
        "socket_path": socket_path,
        "parent_pid": os.getpid(),
        "sys_path": sys_path_for_children(),
    }
    env = dict(os.environ)
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.Popen(
        [sys.executable, "-m", MODULE, f"replica-{index}"],  # the last word labels it for `ps`
        stdin=subprocess.PIPE,
        env=env,
        start_new_session=True,
        close_fds=True,
    )
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(spec).encode())  # stdin, not argv: the config may carry secrets
    proc.stdin.close()
    transport = httpx.AsyncHTTPTransport(uds=socket_path)
    # no read timeout: a generation may take as long as it takes; a dead replica closes the socket
    client = httpx.AsyncClient(
        transport=transport, base_url="http://replica", timeout=httpx.Timeout(None, connect=10.0)
    )
    return Replica(index, socket_path, proc, client)


async def wait_ready(replica: Replica, timeout_s: float) -> None:
    """Return once the replica answers /health with 200; ReplicaStartError if it exits first or
    is not healthy within `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        code = replica.proc.poll()
        if code is not None:
            raise ReplicaStartError(f"replica {replica.index} exited during startup with code {code}", code)
        with contextlib.suppress(httpx.HTTPError, OSError):
            r = await replica.client.get("/health", timeout=5.0)
            if r.status_code == 200:
                return
        if loop.time() > deadline:
            raise ReplicaStartError(f"replica {replica.index} did not become healthy within {timeout_s:.0f} s")
        await asyncio.sleep(READY_POLL_S)


async def stop_replicas(replicas: list[Replica], timeout_s: float = STOP_TIMEOUT_S) -> list[int | None]:
    """SIGTERM every live replica (its graceful shutdown), wait up to `timeout_s`, then SIGKILL its
    process group. Returns the exit codes."""
    for r in replicas:
        if r.stop_watch is not None:
            r.stop_watch()
            r.stop_watch = None
        if r.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                r.proc.send_signal(signal.SIGTERM)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while any(r.proc.poll() is None for r in replicas) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    for r in replicas:
        if r.proc.poll() is None:
            logger.warning("replica %d did not stop within %.0f s: killing it", r.index, timeout_s)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.proc.pid, signal.SIGKILL)
            r.proc.wait()
        with contextlib.suppress(Exception):
            await r.client.aclose()
    return [r.proc.returncode for r in replicas]
