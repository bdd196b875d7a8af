"""`run_router(config) -> int`: start `runtime.dp_size` replicas and serve the router in front.

Exit codes, as a single server's: 2 when there is no model to serve; 0 after SIGINT/SIGTERM (no new requests, in-flight ones get
`server.shutdown_grace_s` and then end with an error, then every replica is stopped with SIGTERM
and waited for); 1 when a replica fails to start or every replica has died; 130 when interrupted
during startup. One replica dying while others live is not an exit: it leaves rotation, its
in-flight requests fail at once, the others keep serving."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path

import uvicorn

from radixserve.config import Config
from radixserve.runtime.child import watch_exit
from radixserve.server.launch import graceful_server, listen_socket, on_signals, run_event_loop, setup_logging
from radixserve.server.router.app import create_router_app
from radixserve.server.router.core import Router
from radixserve.server.router.metrics import RouterMetrics
from radixserve.server.router.policies import make_policy
from radixserve.server.router.replicas import (
    Replica,
    ReplicaStartError,
    spawn_replica,
    stop_replicas,
    wait_ready,
)

logger = logging.getLogger("radixserve.router")


def run_router(config: Config) -> int:
    setup_logging(config.server.log_level, "router")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per forwarded request otherwise
    try:
        return run_event_loop(_route(config))
    except KeyboardInterrupt:
        return 130


async def _start_replicas(config: Config, socket_dir: str) -> tuple[list[Replica], int]:
    """Every replica started and healthy, or ([], exit code) with those started stopped again."""
    n = config.runtime.dp_size
    logger.info("starting %d replicas (router policy %s)", n, config.router.policy)
    replicas = [spawn_replica(config, i, f"{socket_dir}/replica-{i}.sock") for i in range(n)]
    starting = asyncio.ensure_future(
        asyncio.gather(*(wait_ready(r, config.router.replica_start_timeout_s) for r in replicas))
    )
    with on_signals(lambda _sig: starting.cancel()):
        try:
            await starting
            return replicas, 0
        except asyncio.CancelledError:
            logger.info("interrupted during startup")
            code = 130
        except ReplicaStartError as e:
            logger.error("%s", e)
            code = 2 if e.exit_code == 2 else 1  # 2: no model to serve, as a single server says
    await stop_replicas(replicas, timeout_s=5.0)
    return [], code


async def _route(config: Config) -> int:
    sock = listen_socket(config)  # a busy port fails before any replica starts
    if sock is None:
        return 2
    sweep_stale_socket_dirs()
    socket_dir = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-")  # 0700: only this user reaches the replicas
    try:
        replicas, code = await _start_replicas(config, socket_dir)
        if not replicas:
            return code
        return await _serve(config, replicas, sock)
    finally:
        sock.close()
        shutil.rmtree(socket_dir, ignore_errors=True)


SOCKET_DIR_PREFIX = "radixserve-dp-"


def sweep_stale_socket_dirs(tmp: str | None = None) -> list[str]:
    """Remove the replica-socket folders of routers that no longer run (a router killed with SIGKILL
    cannot remove its own): this user's `radixserve-dp-<pid>-*` whose pid is gone. Returns those removed."""
    removed = []
    for path in Path(tmp or tempfile.gettempdir()).glob(f"{SOCKET_DIR_PREFIX}*"):
        pid = path.name[len(SOCKET_DIR_PREFIX):].split("-", 1)[0]
        try:
            if not pid.isdigit() or path.stat().st_uid != os.getuid() or _alive(int(pid)):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process with that pid
        return True
    return True


async def _serve(config: Config, replicas: list[Replica], sock: socket.socket) -> int:
    metrics = RouterMetrics()
    router = Router(replicas, make_policy(config.router, len(replicas)), metrics)
    exit_code = 0
    try:
        server, shutdown = graceful_server(create_router_app(router, config, metrics), config, router)

        def all_dead(reason: str) -> None:
            nonlocal exit_code
            if shutdown.started:
                return
            logger.error("shutting down: %s", reason)
            exit_code = 1
            server.should_exit = True

        router.on_all_dead.append(all_dead)
        loop = asyncio.get_running_loop()
        for r in replicas:

            def exited(r: Replica = r) -> None:
                code = r.proc.wait()
                if not shutdown.started:
                    router.replica_died(r, f"the replica process exited with code {code}")

            r.stop_watch = watch_exit(loop, r.proc, exited)
        announce = asyncio.create_task(_announce(server, config, len(replicas)))
        try:
            await server.serve(sockets=[sock])
        finally:
            announce.cancel()
    finally:
        codes = await stop_replicas(replicas)
        logger.info("replicas stopped (exit codes %s)", codes)
    logger.info("router stopped (exit code %d)", exit_code)
    return exit_code


async def _announce(server: uvicorn.Server, config: Config, n: int) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    logger.info(
        "RadixServe router ready: %d replicas, policy %s, on http://%s:%d%s",
        n,
        config.router.policy,
        config.server.host,
        config.server.port,
        "" if config.server.api_key is None else " (API key required)",
    )
