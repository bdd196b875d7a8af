"""The runtime's child processes (scheduler, detokenizer): how the parent starts them and how they begin.

Why a fresh interpreter (`python -m radixserve.runtime.child`) and not multiprocessing's "spawn":
spawn re-imports the parent's `__main__` module in every child, so a plain script that builds an
`Engine` without an `if __name__ == "__main__":` guard would start another Engine inside each
child (and fail in multiprocessing's bootstrapping check). A child started with `-m` imports
radixserve and nothing of the user's code.

The child reads its `ChildSpec` as JSON on stdin: argv is visible to every user of the machine
(`ps`), and the config may carry the server's API key.

Signals: a child runs in its own session and ignores SIGINT and SIGTERM. A terminal's Ctrl-C goes
to the whole foreground process group and a supervisor may signal every process; only the parent
decides when the runtime stops (it sends a ShutdownRequest, and kills a child that does not
exit in time). A child whose parent died exits by itself (the parent watchdog)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixserve.logs import configure_logging
from radixserve.runtime.ipc import PortArgs

if TYPE_CHECKING:  # asyncio (and ssl with it, ~9 MB resident) is the parent's: the detokenizer has no event loop
    import asyncio

MODULE = "radixserve.runtime.child"
# set in every runtime child's environment (to its process name): a runtime started inside one is refused
RUNTIME_CHILD_ENV = "RADIXSERVE_RUNTIME_CHILD"


def sys_path_for_children() -> list[str]:
    """The parent's import path as a child gets it, less the directory of the parent's own script
    (and the "" of `python -c` or the REPL). Why: a child imports radixserve and plugins, never the
    user's modules, and a script there named like a dependency (`gguf.py`) shadowed that dependency
    in the child; an unguarded Engine script so named started another Engine in every scheduler,
    without end (audit 30)."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    script_dir = os.path.dirname(os.path.abspath(main_file)) if main_file else None
    return [p for p in sys.path if p and os.path.abspath(p) != script_dir]


def adopt_import_path(parent_paths: list[str]) -> None:
    """A process started with `python -m` (a runtime child, a data-parallel replica) takes the
    parent's import path (`sys_path_for_children`) in place of its own first entry, the working
    directory: a file there must not shadow a dependency either."""
    sys.path[:] = list(dict.fromkeys(sys.path[1:] + [p for p in parent_paths if p]))


def refuse_inside_runtime_child() -> None:
    """Raise where this process is itself a runtime child (see RUNTIME_CHILD_ENV)."""
    process = os.environ.get(RUNTIME_CHILD_ENV)
    if process:
        raise RuntimeError(
            f"a RadixServe runtime is being started inside the runtime's own {process} process: a module that "
            "process imported builds an Engine or a server when imported (a file named like a dependency, "
            "e.g. gguf.py, next to your script or in the working directory?); rename it, or put the Engine "
            "under if __name__ == '__main__':"
        )


@dataclass(frozen=True)
class ChildSpec:
    """Everything a child needs, sent by the parent on the child's stdin."""

    process: str  # "scheduler" or "detokenizer"
    config: dict[str, Any]  # Config.model_dump(mode="json")
    ports: PortArgs
    parent_pid: int
    tokenizer_path: str  # the detokenizer's: the prepared serving-tokenizer directory (see serving_tokenizer.py)
    sys_path: list[str]  # the parent's import path: plugins on it resolve the same in the child
    tp_rank: int = 0  # tensor parallelism: this process's rank ("tp_worker": > 0; "scheduler": 0)
    dist_init_addr: str = ""  # host:port of the TP rendezvous (rank 0 serves it); "" when tp_size == 1
    log_prefix: str = ""  # before the process's label in its log lines (a data-parallel replica's "[replica I] ")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ChildSpec:
        data = json.loads(text)
        data["ports"] = PortArgs(**data["ports"])
        return cls(**data)


def log_level(config: dict[str, Any]) -> int:
    """The level of `server.log_level` in a config dict (a child gets the parent's config as JSON):
    the children log at the level the user chose for the server, not always at INFO."""
    name = str((config.get("server") or {}).get("log_level") or "info")
    return getattr(logging, name.upper(), logging.INFO)


def setup_logging(spec: ChildSpec) -> None:
    """The child's root logger, before its entry point (whose own basicConfig is then a no-op):
    the parent's level, and every line says which process wrote it."""
    label = f"tp{spec.tp_rank}" if spec.process == "tp_worker" else spec.process
    configure_logging(log_level(spec.config), spec.log_prefix + label)


def _run_scheduler(spec: ChildSpec) -> None:
    from radixserve.runtime.scheduler_process import run_scheduler_process

    run_scheduler_process(spec.config, spec.ports, spec.parent_pid, spec.dist_init_addr)


def _run_detokenizer(spec: ChildSpec) -> None:
    from radixserve.runtime.detokenizer import run_detokenizer_process

    run_detokenizer_process(spec.config, spec.ports, spec.tokenizer_path, spec.parent_pid)


def _run_tp_worker(spec: ChildSpec) -> None:
    from radixserve.runtime.tp import run_tp_worker_process

    run_tp_worker_process(spec.config, spec.tp_rank, spec.dist_init_addr, spec.parent_pid)


ENTRY_POINTS: dict[str, Callable[[ChildSpec], None]] = {
    "scheduler": _run_scheduler, "detokenizer": _run_detokenizer, "tp_worker": _run_tp_worker,
}


def spawn(spec: ChildSpec) -> subprocess.Popen:
    """Start one child; it inherits stdout/stderr (its log lines go where the parent's go)."""
    if spec.process not in ENTRY_POINTS:
        raise ValueError(f"unknown runtime child process {spec.process!r}")
    env = dict(os.environ)
    # the radixserve the parent runs, even when the parent found it through its own sys.path only
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env[RUNTIME_CHILD_ENV] = spec.process
    proc = subprocess.Popen(
        [sys.executable, "-m", MODULE, spec.process],  # the name in argv only labels the process for `ps`
        stdin=subprocess.PIPE,
        env=env,
        start_new_session=True,  # out of the terminal's process group: Ctrl-C reaches the parent only
        close_fds=True,
    )
    assert proc.stdin is not None
    proc.stdin.write(spec.to_json().encode())
    proc.stdin.close()
    return proc


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a child and every process it started: it leads its own session (`spawn`), so its
    process group and session hold what it runs, e.g. the compilers of a first start's native kernel
    build, which would otherwise go on compiling for a minute after the child is gone. The session
    too, not only the group: ninja starts each compiler in a process group of its own (audit 30:
    five compilers outlived a server stopped during its first start)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # already gone (and reaped), or not ours
        proc.kill()
    for pid in _session_members(proc.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _session_members(sid: int) -> list[int]:
    """The pids of the live processes in session `sid` (Linux /proc; elsewhere none)."""
    members = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        if int(fields[3]) == sid:  # after the name: state, ppid, pgrp, session
            members.append(int(entry))
    return members


def watch_exit(
    loop: asyncio.AbstractEventLoop, proc: subprocess.Popen, on_exit: Callable[[], None]
) -> Callable[[], None]:
    """Call `on_exit()` on `loop` as soon as `proc` exits (not when it is merely signalled).
    Returns a function that stops watching. Linux: a pidfd in the event loop; elsewhere a thread."""
    if hasattr(os, "pidfd_open"):
        fd = os.pidfd_open(proc.pid)

        def fired() -> None:
            loop.remove_reader(fd)
            on_exit()

        loop.add_reader(fd, fired)
        closed = False

        def stop() -> None:
            nonlocal closed
            if not closed:
                closed = True
                loop.remove_reader(fd)
                os.close(fd)

        return stop

    cancelled = threading.Event()

    def wait() -> None:
        proc.wait()
        if not cancelled.is_set():
            try:
                loop.call_soon_threadsafe(on_exit)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    threading.Thread(target=wait, name=f"watch-{proc.pid}", daemon=True).start()
    return cancelled.set


def _ignore_stop_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def main() -> None:
    _ignore_stop_signals()
    spec = ChildSpec.from_json(sys.stdin.read())
    sys.stdin.close()
    adopt_import_path(spec.sys_path)
    setup_logging(spec)
    ENTRY_POINTS[spec.process](spec)
    # the entry returned after a ShutdownRequest, its sockets closed: skip the interpreter's
    # teardown (seconds with torch loaded), which the parent's shutdown would otherwise wait for
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
