"""The example third-party plugin from docs/examples works by pip-installing it, as the
authoring guide says: discovered, listed, and selected through a YAML stack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from plugin_fixtures import run_cli

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "docs" / "examples" / "radixserve-example-policy"


@pytest.fixture(scope="module")
def installed_example():
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "install", "--no-deps", "--no-build-isolation", str(EXAMPLE)], check=True, timeout=300)
    yield
    subprocess.run([*pip, "uninstall", "-y", "radixserve-example-policy"], check=True, timeout=120)


def test_example_plugin_is_listed(installed_example):
    r = run_cli(["plugins", "--json"])
    assert r.returncode == 0, r.stderr
    comps = {(c["kind"], c["name"]): c for c in json.loads(r.stdout)["components"]}
    assert comps[("policy", "shortest-first")]["distribution"] == "radixserve-example-policy"


def test_example_plugin_selected_by_stack(installed_example, tmp_path):
    stack = tmp_path / "stack.yaml"
    stack.write_text("stack:\n  policy: shortest-first\n")
    r = run_cli(["config", "show", "--config", str(stack)])
    assert r.returncode == 0, r.stderr
    # the resolved stack names the distribution that provides the selected component
    assert "policy: shortest-first  # stack.policy; radixserve-example-policy" in r.stdout


def test_example_policy_orders_shortest_first(installed_example):
    code = (
        "from radixserve.plugins.registry import Registry\n"
        "from radixserve.state import Req, SamplingParams\n"
        "P = Registry.discover().load('policy', 'shortest-first')\n"
        "reqs = [Req(rid=str(n), origin_input_ids=[1]*n, sampling_params=SamplingParams(), arrival_time=t)"
        " for t, n in enumerate([5, 2, 9, 2])]\n"
        "print([r.rid for r in P().order(reqs, None)])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['2', '2', '5', '9']"
