"""What every recorded benchmark states about where it ran: the machine and the commit."""

from __future__ import annotations

import os
import platform
import subprocess


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine() -> str:
    return (
        f"{cpu_model()}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.1f} at start"
    )


def commit() -> str:
    """Short HEAD, with +dirty when tracked files differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def emit(row: dict, result_file: str | None) -> None:
    """Print one result row as a JSON line and append it to `result_file` when given."""
    import json

    line = json.dumps(row)
    print(line, flush=True)
    if result_file:
        with open(result_file, "a") as f:
            f.write(line + "\n")
