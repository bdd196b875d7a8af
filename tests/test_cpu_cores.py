"""The default CPU thread count follows a container's CPU quota, not only the affinity mask: torch
sized its pool from the mask, so under `docker run --cpus=2` on a larger host most threads of every
parallel region waited for threads the quota had paused."""

from __future__ import annotations

import os

import pytest
import torch
from radixserve.cpu_cores import cgroup_cpu_limit, set_torch_threads, usable_cores


def _cgroup(tmp_path, v2: str | None = None, v1: tuple[str, str] | None = None):
    if v2 is not None:
        (tmp_path / "cpu.max").write_text(v2)
    if v1 is not None:
        (tmp_path / "cpu").mkdir()
        (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(v1[0])
        (tmp_path / "cpu" / "cpu.cfs_period_us").write_text(v1[1])
    return tmp_path


@pytest.mark.parametrize("v2, v1, cores", [
    ("200000 100000\n", None, 2.0),
    ("150000 100000\n", None, 1.5),
    ("max 100000\n", None, None),  # v2 without a limit
    (None, ("-1\n", "100000\n"), None),  # v1 without a limit
    (None, ("300000\n", "100000\n"), 3.0),
    (None, None, None),  # no cgroup files at all
    ("garbage\n", None, None),
])
def test_the_cgroup_quota_is_read_from_v2_or_v1(tmp_path, v2, v1, cores):
    assert cgroup_cpu_limit(_cgroup(tmp_path, v2, v1)) == cores


def test_usable_cores_is_the_affinity_mask_capped_by_the_quota_rounded_up(tmp_path):
    mask = len(os.sched_getaffinity(0))
    assert usable_cores(_cgroup(tmp_path)) == mask
    assert usable_cores(_cgroup(tmp_path, "50000 100000")) == 1  # half a core: one thread
    assert usable_cores(_cgroup(tmp_path / "", "10000000 100000")) == mask  # a quota above the mask changes nothing


def test_a_quota_below_the_mask_sets_the_threads_and_says_why(tmp_path, monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr("radixserve.cpu_cores.CGROUP_ROOT", _cgroup(tmp_path, "100000 100000"))
        torch.set_num_threads(2)
        note = set_torch_threads(None)
        assert torch.get_num_threads() == 1
        assert note and "CPU threads: 1" in note and "runtime.num_threads" in note
        assert set_torch_threads(2) is None and torch.get_num_threads() == 2  # the config's count wins
        monkeypatch.setattr("radixserve.cpu_cores.CGROUP_ROOT", _cgroup(tmp_path / "none"))
        torch.set_num_threads(1)  # torch's default (physical cores) below the mask: never raised
        assert set_torch_threads(None) is None and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_quota_on_the_process_cgroup_or_an_ancestor_is_found(tmp_path):
    """A systemd service's CPUQuota sits in its own cgroup (/proc/self/cgroup's `0::/system.slice/x.service`), not at
    the cgroup file system's root; the smallest quota on the way down applies."""
    proc = tmp_path / "cgroup"
    proc.write_text("0::/system.slice/x.service\n")
    service = tmp_path / "fs" / "system.slice" / "x.service"
    service.mkdir(parents=True)
    (service / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(tmp_path / "fs", proc) == 1.5
    (tmp_path / "fs" / "system.slice" / "cpu.max").write_text("100000 100000\n")  # the slice allows less
    assert cgroup_cpu_limit(tmp_path / "fs", proc) == 1.0
    proc.write_text("12:cpu:/\n")  # cgroup v1 only: no v2 line, the root alone
    assert cgroup_cpu_limit(tmp_path / "fs", proc) is None
