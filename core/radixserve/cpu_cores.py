"""How many CPU cores this process may use: its affinity mask, capped by a cgroup CPU quota.

torch sizes its thread pool from the affinity mask alone. In a container limited by a CPU quota
(`docker run --cpus=2`, a Kubernetes CPU limit) on a larger host, the mask holds every host core
while the quota lets the process run on only a few at a time: each kernel is a parallel region
whose threads wait for one another, so threads the quota has paused stall every region (a decode
step slowed ~60x on 2 cores shared with other work). The default thread count therefore follows
the quota as well (as Go's GOMAXPROCS and .NET do)."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def cgroup_cpu_limit(root: Path | None = None, proc_cgroup: Path | None = None) -> float | None:
    """The CPU quota of this process's cgroup in cores (2.5 for 250 ms per 100 ms), or None when there
    is none. cgroup v2: the smallest `cpu.max` ("max 100000" is no limit) of the process's cgroup (its
    `0::/path` line in /proc/self/cgroup; a systemd service's CPUQuota) and its ancestors, the file
    system's root included (a container's own cgroup namespace); else v1's `cpu.cfs_quota_us` /
    `cpu.cfs_period_us` (-1 is no limit). Unreadable or malformed files count as no limit. `root`,
    `proc_cgroup`: the cgroup file system and the membership file (defaults CGROUP_ROOT, PROC_CGROUP)."""
    root = CGROUP_ROOT if root is None else root
    limits = [_v2_limit(d) for d in _v2_dirs(root, PROC_CGROUP if proc_cgroup is None else proc_cgroup)]
    found = [x for x in limits if x is not None]
    if found:
        return min(found)
    try:
        quota = float((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = float((root / "cpu" / "cpu.cfs_period_us").read_text())
        return _cores(quota, period)
    except (OSError, ValueError):
        return None


def _v2_dirs(root: Path, proc_cgroup: Path) -> list[Path]:
    """The process's cgroup v2 directory and its ancestors up to `root` (`root` alone when unknown)."""
    try:
        line = next((ln for ln in proc_cgroup.read_text().splitlines() if ln.startswith("0::")), None)
    except OSError:
        line = None
    dirs = [root]
    if line is not None:
        for part in [p for p in line[3:].strip().split("/") if p and p != ".."]:
            dirs.append(dirs[-1] / part)
    return dirs


def _v2_limit(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else _cores(float(quota), float(period))
    except (OSError, ValueError):
        return None


def _cores(quota: float, period: float) -> float | None:
    return quota / period if quota > 0 and period > 0 else None


def usable_cores(root: Path | None = None) -> int:
    """Cores this process may run on at once: the affinity mask's size, capped by the cgroup quota
    rounded up (a quota of 2.5 cores keeps 3 threads busy part of the time), at least 1."""
    return _usable_under(cgroup_cpu_limit(root))


def _usable_under(limit: float | None) -> int:
    """usable_cores for a quota already read (`limit` cores, None: none)."""
    mask = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(mask, math.ceil(limit)) if limit is not None else mask)


def set_torch_threads(num_threads: int | None) -> str | None:
    """Size torch's CPU thread pool for a serving process: `num_threads` (runtime.num_threads) when
    given, else torch's own default (one thread per physical core of the affinity mask) capped by
    `usable_cores()`: never raised, so hyperthreads stay unused as torch leaves them. Returns a line
    for the log when a cgroup quota lowered the count (why fewer threads run than the host has cores)."""
    import torch

    if num_threads:
        torch.set_num_threads(num_threads)
        return None
    before = torch.get_num_threads()
    limit = cgroup_cpu_limit()  # read once: the cap and the log line's figure
    cores = min(_usable_under(limit), before)
    if cores < before:
        torch.set_num_threads(cores)
        return (f"CPU threads: {cores} (the cgroup CPU limit is {limit:g} cores; torch would have "
                f"started {before}); set runtime.num_threads to override")
    return None
