"""Helpers that fabricate installed plugin distributions (a dist-info folder plus a module on a
sys.path entry) so discovery runs through the real entry-point machinery without pip."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path


def make_fake_distribution(
    site: Path, dist: str, plugin_name: str, module: str, body: str, version: str = "1.0"
) -> None:
    """Write `module.py` and `<dist>-<version>.dist-info` with an entry point into `site`."""
    (site / f"{module}.py").write_text(textwrap.dedent(body))
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[radixserve.plugins]\n{plugin_name} = {module}\n")


def run_cli(args: list[str], site: Path | None = None, env: dict | None = None, cwd: Path | None = None):
    """Run `python -m radixserve.cli ARGS` with `site` prepended to PYTHONPATH."""
    full_env = dict(os.environ)
    if site is not None:
        full_env["PYTHONPATH"] = os.pathsep.join([str(site), full_env.get("PYTHONPATH", "")])
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "radixserve.cli", *args], capture_output=True, text=True, env=full_env, cwd=cwd, timeout=120
    )


POLICY_PLUGIN = """
from radixserve.plugins import hookimpl
PLUGIN_API = "{api}"

@hookimpl
def radixserve_register(registry):
    registry.register("policy", "{name}", "radixserve_policies.fcfs:FCFSPolicy")
"""
