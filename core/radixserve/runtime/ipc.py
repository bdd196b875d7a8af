"""ZMQ endpoints in a private directory, and the orphan guard every child installs."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class PortArgs:
    """ipc:// endpoints; each is bound by its reader (PULL) and connected to by writers (PUSH)."""

    ipc_dir: str
    scheduler_input: str
    detokenizer_input: str
    manager_input: str

    @classmethod
    def create(cls) -> PortArgs:
        d = tempfile.mkdtemp(prefix="radixserve-")  # mode 0700: only this user can connect
        os.chmod(d, 0o700)
        return cls(
            ipc_dir=d,
            scheduler_input=f"ipc://{d}/scheduler",
            detokenizer_input=f"ipc://{d}/detokenizer",
            manager_input=f"ipc://{d}/manager",
        )

    def cleanup(self) -> None:
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def install_parent_watchdog(parent_pid: int, interval_s: float = 0.5) -> None:
    """Exit this process (hard, from a daemon thread) as soon as `parent_pid` is gone; a process that leads its
    own process group (a runtime child, started in a session of its own) takes the group along, its compilers
    included.

    Why: a killed parent runs no cleanup, and a child blocked on a socket would live forever; the native
    kernels' ninja and c++ processes, orphaned, compiled on for minutes (engine audit 31)."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                if os.getpgrp() == os.getpid():
                    with contextlib.suppress(OSError):
                        os.killpg(os.getpid(), signal.SIGKILL)  # this process with them
                os._exit(1)
            time.sleep(interval_s)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()
