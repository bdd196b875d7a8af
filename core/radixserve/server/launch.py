"""`run_server(config) -> int`: start the runtime, serve HTTP until told to stop, shut down cleanly.

Exit codes: 0 after SIGINT/SIGTERM (graceful, see shutdown.py: no new requests, in-flight ones get
`server.shutdown_grace_s` seconds and then end with an error event, then the runtime's children
are stopped); 1 when the runtime fails to start or a child process dies while serving (detected
within about a second: /health turns 503 and the server exits); 2 when a runtime process refuses a
config value at start-up (one `radixserve: error:` line), when there is no model to serve or the
host:port cannot be listened on (checked before the model loads); 130 when interrupted during startup."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Coroutine
from typing import Any, NoReturn, TypeVar

import uvicorn

from radixserve.config import Config, ConfigError
from radixserve.logs import configure_logging

logger = logging.getLogger("radixserve.server")
T = TypeVar("T")

STATS_INTERVAL_S = 10.0  # periodic scheduler stats log line, while there is activity
HEALTH_POLL_S = 0.5
CONNECTION_CLOSE_S = 2  # uvicorn's wait for responses to flush, after every request has ended
SIGNALS = (signal.SIGINT, signal.SIGTERM)
# stats that move with no activity (a rate over the server's life, a clock): not "a change" worth a line
_DRIFTING_STATS = ("time", "throughput")


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on uvloop where it is installed (a core dependency, absent on Windows): the
    front end handles one event per token per stream, and on a 2-core CPU its time is taken from the
    model's threads (with httptools: 14% less front-end CPU a run, benchmarks/results/cpu-served-vs-vllm.md)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def stop_signals() -> tuple[int, ...]:
    """The signals that start the graceful shutdown: SIGINT, SIGTERM, and SIGHUP (a closed terminal or
    SSH session, a supervisor's reload) unless the server was started ignoring it (`nohup`)."""
    return SIGNALS + (() if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else (signal.SIGHUP,))


class _Server(uvicorn.Server):
    """uvicorn's server with its signal handling replaced: SIGINT/SIGTERM go to `on_signal` (the
    graceful shutdown) instead of closing the server at once, and are not re-raised after
    shutdown (that would kill the process before the runtime's children are stopped)."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[int], None]) -> None:
        super().__init__(config)
        self.on_signal = on_signal

    def capture_signals(self):
        return on_signals(self.on_signal)


@contextlib.contextmanager
def on_signals(handler: Callable[[int], None]):
    """While inside (in a running event loop): SIGINT/SIGTERM call `handler(signum)` instead of
    their default action. Shared by the server, the router and their start-up phases."""
    loop = asyncio.get_running_loop()
    signals = stop_signals()
    for sig in signals:
        loop.add_signal_handler(sig, handler, sig)
    try:
        yield
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


class _WithoutCtrlCHint(logging.Filter):
    """A data-parallel replica's "Uvicorn running on unix socket ..." line without uvicorn's "(Press CTRL+C to
    quit)": a replica ignores the terminal's signals (its router stops it), so the hint was wrong there."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and "(Press CTRL+C to quit)" in record.msg:
            record.msg = record.msg.replace(" (Press CTRL+C to quit)", "")
        return True


def graceful_server(app: Any, config: Config, target: Any, uds: str | None = None) -> tuple[_Server, Any]:
    """The uvicorn server for `app` on `config.server`'s host and port (or the unix socket `uds`),
    with SIGINT/SIGTERM starting a `GracefulShutdown` of `target` (the runtime, or the router):
    returns (server, shutdown)."""
    from radixserve.server.shutdown import GracefulShutdown

    s = config.server
    shutdown = GracefulShutdown(target, s.shutdown_grace_s)
    server = _Server(
        uvicorn.Config(
            app,
            host=s.host,
            port=s.port,
            uds=uds,
            log_level=s.log_level,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=CONNECTION_CLOSE_S,
            lifespan="off",
        ),
        on_signal=shutdown.on_signal,
    )
    shutdown.server = server
    if uds is not None:  # a replica behind the router
        logging.getLogger("uvicorn.error").addFilter(_WithoutCtrlCHint())
    return server, shutdown


def listen_socket(config: Config) -> socket.socket | None:
    """The server's TCP socket, bound to `config.server`'s host and port before anything slow starts
    (a busy port is then an error in a second, not after loading a model and compiling kernels);
    uvicorn listens on it later (`serve(sockets=[...])`). None, with the error logged, when the
    address cannot be bound."""
    host, port = config.server.host, config.server.port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        logger.error("%s", bind_error_message(host, port, e))
        return None
    return sock


def bind_error_message(host: str, port: int, e: OSError) -> str:
    """The error line for a failed bind, with the hint that fits the cause: a busy port, a host
    that does not resolve or is not this machine's, a privileged port."""
    if isinstance(e, socket.gaierror):  # before errno: its codes (EAI_*) overlap errno's numbers
        hint = "is --host an IP address or a name of this machine?"
    elif e.errno == errno.EADDRINUSE:
        hint = "another server on that port? pick one with --port"
    elif e.errno == errno.EADDRNOTAVAIL:
        hint = "is --host an address of this machine? 0.0.0.0 listens on all of them"
    elif e.errno == errno.EACCES and 0 < port < 1024:
        hint = "ports below 1024 need privileges; pick another with --port"
    else:
        hint = ""
    return f"cannot listen on {host}:{port}: {e.strerror or e}" + (f" ({hint})" if hint else "")


def setup_logging(level: str, label: str = "server") -> None:
    configure_logging(level, label)


def run_server(config: Config, registry: Any = None, uds: str | None = None, log_prefix: str = "") -> int:
    """`registry`: this process's plugin registry (None: built from `config`). `uds`: serve on this
    unix socket instead of host:port (a data-parallel replica). `log_prefix`: put before the label of
    this process's log lines and its children's (a replica's "[replica I] "). With runtime.dp_size > 1
    this runs the router and its replicas instead (server/router/launch.py)."""
    if config.runtime.dp_size > 1:
        from radixserve.server.router.launch import run_router

        return run_router(config)
    setup_logging(config.server.log_level, f"{log_prefix}server")
    try:
        return run_event_loop(_serve(config, registry, uds, log_prefix))
    except KeyboardInterrupt:
        return 130


def end_process(code: int) -> NoReturn:
    """Exit now with `code`, after flushing the logs and std streams. Why not sys.exit: once
    run_server has returned, the children are stopped and the ipc directory removed; the
    interpreter's teardown (torch and transformers loaded) would only add seconds to a shutdown
    that a supervisor or a terminal is waiting for."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


async def _start_runtime(config: Config, registry: Any, log_prefix: str) -> tuple[Any, int]:
    """A started TokenizerManager, or (None, exit code). SIGINT/SIGTERM abort a slow start."""
    from radixserve.runtime.tokenizer_manager import TokenizerManager

    try:
        tm = TokenizerManager(config, registry, log_prefix=log_prefix)
    except FileNotFoundError as e:  # a bad --model: the CLI's one-line form, as every other bad value gets
        print(f"radixserve: error: {e}", file=sys.stderr)
        return None, 2
    starting = asyncio.ensure_future(tm.start())
    with on_signals(lambda _sig: starting.cancel()):  # also while a failed start is cleaned up
        try:
            logger.info("loading %s ...", tm.model_path)
            await starting
            return tm, 0
        except asyncio.CancelledError:
            logger.info("interrupted during startup")
            await tm.shutdown()
            return None, 130
        except Exception as e:
            await tm.shutdown()
            # a bad value found by the scheduler, or by the start itself (ConfigError: the cache directory):
            # exit 2, as `generate` gives
            user_error = getattr(e, "user_error", None) or (str(e) if isinstance(e, ConfigError) else None)
            if user_error:
                print(f"radixserve: error: {user_error}", file=sys.stderr)
                return None, 2
            if str(e) != tm.dead_reason:  # a child's failure is logged once, when it arrives
                logger.error("the runtime failed to start: %s", e)
            return None, 1


async def _serve(config: Config, registry: Any, uds: str | None = None, log_prefix: str = "") -> int:
    from radixserve.server.app import create_app

    sock = None
    if uds is None:
        sock = listen_socket(config)
        if sock is None:
            return 2
    tm, code = await _start_runtime(config, registry, log_prefix)
    if tm is None:
        if sock is not None:
            sock.close()
        return code
    exit_code = 0
    try:
        server, shutdown = graceful_server(create_app(tm, config, tm.registry), config, tm, uds)

        def runtime_died(reason: str) -> None:
            nonlocal exit_code
            if exit_code == 0:
                logger.error("shutting down: %s", reason)
            exit_code = 1
            server.should_exit = True

        tm.on_death.append(runtime_died)
        tasks = [
            asyncio.create_task(_watch_health(tm, shutdown, runtime_died)),
            asyncio.create_task(_log_stats(tm)),
            asyncio.create_task(_announce(server, tm, config, uds)),
        ]
        try:
            await server.serve(sockets=None if sock is None else [sock])
        finally:
            for t in tasks:
                t.cancel()
    finally:
        await tm.shutdown()
    logger.info("server stopped (exit code %d)", exit_code)
    return exit_code


async def _watch_health(tm: Any, shutdown: Any, on_dead) -> None:
    """Belt and braces next to tm.on_death: any way the runtime turns unhealthy stops the server
    (except the graceful shutdown, which turns it unhealthy on purpose)."""
    while True:
        await asyncio.sleep(HEALTH_POLL_S)
        if shutdown.started and tm.dead_reason is None:
            continue
        if not tm.is_healthy():
            on_dead(getattr(tm, "dead_reason", None) or "the runtime is not healthy")
            return


async def _announce(server: uvicorn.Server, tm: Any, config: Config, uds: str | None = None) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    port = config.server.port
    if not uds and port == 0 and server.servers and server.servers[0].sockets:  # --port 0: the one the OS chose
        port = server.servers[0].sockets[0].getsockname()[1]
    where = f"unix:{uds}" if uds else f"http://{config.server.host}:{port}"
    logger.info(
        "RadixServe ready: model %r (context %d) on %s%s",
        tm.model_name,
        tm.context_len,
        where,
        "" if config.server.api_key is None else " (API key required)",
    )


async def _log_stats(tm: Any) -> None:
    """One INFO line of scheduler stats every STATS_INTERVAL_S while it changes (quiet when idle)."""
    last: dict | None = None
    while True:
        await asyncio.sleep(STATS_INTERVAL_S)
        try:
            stats = await tm.get_stats()
        except Exception:
            continue
        numeric = {k: v for k, v in stats.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        moved = {k: v for k, v in numeric.items() if k not in _DRIFTING_STATS}
        if moved != last:
            logger.info("stats: %s", " ".join(f"{k}={_fmt(v)}" for k, v in numeric.items() if k != "time"))
            last = moved


def _fmt(v: float) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)
